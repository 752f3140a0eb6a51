"""Recording a rank's cache operations (`run --record-cache-ops`), so that SGLang's cache can answer the same
questions (replay.py replays them: `python -m hicache_lab conform RUN_DIR`).

`RecordingCache` stands between a rank's scheduler and its cache and writes every operation of the scheduler's
contract (`mem_cache/base.BasePrefixCache`) with the lab's answer and the pools' state after it, one JSON line each, to
`rank{R}.cache_ops.jsonl`; the first line holds the cache's configuration. `RECORDING` binds it into a run
(entrypoints/binders.py). Nodes are named by their ids, slots
by their numbers. Nothing is decided here: each call goes to the cache unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ...config import RunConfig
from ...entrypoints.binders import Binder
from ...entrypoints.outdir import open_run_file
from ...mem_cache.base import BasePrefixCache

OPS_FILE = "rank{rank}.cache_ops.jsonl"


class RecordingBinder(Binder):
    """`run --record-cache-ops`: a `RecordingCache` between each rank's scheduler and its cache."""

    fields = ("record_cache_ops",)

    def wrap_cache(self, cfg: RunConfig, cache: BasePrefixCache, out_dir: Path, rank: int) -> BasePrefixCache:
        if not cfg.lab.record_cache_ops:
            return cache
        return RecordingCache(cache, ops_path(out_dir, rank), rank, cfg.lab.fault)


def ops_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / OPS_FILE.format(rank=rank)


def _state(cache: BasePrefixCache) -> list[int]:
    """What both caches are compared on after every operation: free device slots, free host slots, evictable."""
    return [cache.device_alloc.available_size(), cache.host_free(), cache.tree.evictable_size()]


def _request_args(slots: torch.Tensor, prefix_len: int, last_node, **more) -> dict:
    """How an operation on a request's slots is written: its slots, the prefix the tree holds, its node."""
    return {"slots": slots.tolist(), "prefix_len": prefix_len, "node": last_node.id, **more}


class RecordingCache:
    """The lab's cache, as the scheduler sees it, with every call of its contract written down. Anything else
    (hooks, observation, the step loop) reaches the cache itself through attribute lookup."""

    def __init__(self, cache: BasePrefixCache, path: Path, rank: int, fault: str = ""):
        self._cache = cache
        self._file = open_run_file(path)  # closed by close(), with the cache
        self._last_match = None
        self.operations = 0
        host = cache.host_alloc.size if cache.cfg.enable_hierarchical_cache else 0
        config = {"op": "config", "cache": dataclasses.asdict(cache.cfg), "host_tokens": host, "rank": rank}
        self._write(config | {"fault": fault})  # a fault changes the lab's answers on purpose: conform says so

    def __getattr__(self, name: str):
        return getattr(self._cache, name)

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def _record(self, op: str, args: dict, answer=None) -> None:
        self._write({"op": op, "args": args, "ans": answer, "state": _state(self._cache)})
        self.operations += 1

    # -- the contract's operations --------------------------------------------------------------------

    def advance(self, step: int) -> None:
        self._cache.advance(step)
        self._record("advance", {"step": step})

    def check_hicache_events(self) -> tuple[int, int]:
        acks = self._cache.check_hicache_events()
        self._record("check_hicache_events", {}, list(acks))
        return acks

    def flush_pending_backups(self) -> None:
        self._cache.flush_pending_backups()
        self._record("flush_pending_backups", {})

    def match_prefix(self, key: tuple[int, ...]):
        match = self._last_match = self._cache.match_prefix(key)
        answer = {
            "device": match.device_indices.tolist(),
            "host": match.host_hit_length,
            "device_node": match.last_device_node.id,
        }
        self._record("match_prefix", {"key": list(key)}, answer)
        return match

    def inc_lock_ref(self, node) -> None:
        self._cache.inc_lock_ref(node)
        self._record("inc_lock_ref", {"node": node.id})

    def dec_lock_ref(self, node) -> None:
        self._cache.dec_lock_ref(node)
        self._record("dec_lock_ref", {"node": node.id})

    def device_room(self) -> int:
        room = self._cache.device_room()
        self._record("device_room", {}, room)
        return room

    def lock_match(self, match):
        if match is not self._last_match:
            raise RuntimeError("the recorder replays lock_match on the last match only: the scheduler's order")
        prefix, last = self._cache.lock_match(match)
        self._record("lock_match", {}, {"prefix": prefix.tolist(), "node": last.id})
        return prefix, last

    def evict(self, num_tokens: int) -> int:
        freed = self._cache.evict(num_tokens)
        self._record("evict", {"tokens": num_tokens}, freed)
        return freed

    def evict_host(self, num_tokens: int) -> int:
        freed = self._cache.evict_host(num_tokens)
        self._record("evict_host", {"tokens": num_tokens}, freed)
        return freed

    def evict_to_free(self, num_tokens: int) -> bool:
        ok = self._cache.evict_to_free(num_tokens)
        self._record("evict_to_free", {"tokens": num_tokens}, ok)
        return ok

    def alloc_device(self, num_tokens: int, demand: int | None = None) -> torch.Tensor:
        slots = self._cache.alloc_device(num_tokens, demand)
        self._record("alloc_device", {"tokens": num_tokens, "demand": demand}, slots.tolist())
        return slots

    def free_request(self, slots, prefix_len: int, last_node) -> None:
        args = _request_args(slots, prefix_len, last_node)
        self._cache.free_request(slots, prefix_len, last_node)
        self._record("free_request", args)

    def cache_unfinished_req(self, tokens, slots, prefix_len: int, last_node, inserted_len: int):
        args = _request_args(slots, prefix_len, last_node, tokens=list(tokens), inserted_len=inserted_len)
        tree_slots, node = self._cache.cache_unfinished_req(tokens, slots, prefix_len, last_node, inserted_len)
        self._record("cache_unfinished_req", args, {"prefix": tree_slots.tolist(), "node": node.id})
        return tree_slots, node

    def cache_finished_req(self, tokens, slots, prefix_len: int, last_node, inserted_len: int = 0, prompt_len: int = 0):
        args = _request_args(
            slots, prefix_len, last_node, tokens=list(tokens), inserted_len=inserted_len, prompt_len=prompt_len
        )
        matched = self._cache.cache_finished_req(tokens, slots, prefix_len, last_node, inserted_len, prompt_len)
        self._record("cache_finished_req", args, matched)
        return matched

    def start_loading(self):
        event = self._cache.start_loading()
        self._record("start_loading", {}, event is not None)
        return event

    def copies_in_flight(self) -> bool:
        busy = self._cache.copies_in_flight()
        self._record("copies_in_flight", {}, busy)
        return busy

    def check_integrity(self, held_by_requests: int = 0) -> None:
        """A round begins (the scheduler checks the cache at each round's start)."""
        self._cache.check_integrity(held_by_requests)
        self._record("new_round", {})

    def flush(self) -> None:
        self._cache.flush()
        self._record("flush", {})

    def close(self) -> None:
        """The recording's last line says how many operations it holds: a file cut short has none. The cache
        closes (its copy threads end) even where the recording cannot be written."""
        try:
            self._write({"op": "end", "operations": self.operations})
            self._file.close()
        finally:
            self._cache.close()


RECORDING = RecordingBinder()
