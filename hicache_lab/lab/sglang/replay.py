"""The lab's cache against SGLang's, operation by operation.

A run with `--record-cache-ops` writes every operation its scheduler asked of its cache, with the lab's answers
(lab/sglang/recording.py). `replay` (`python -m hicache_lab conform RUN_DIR`: conform_cli.py) sends the same
operations, in the same order, to SGLang's cache (cache.py), and each answer is compared with the lab's: matched
device length and slots, host hit length, room, load-back length, inserted prefix, the slots and node a prefill's
insert hands back (`cache_unfinished_req`), whether eviction freed what a decode step needs, acks consumed, loads
started, copies in flight, and free device / host slots and evictable tokens after every operation. The two caches
number their slots and nodes differently, so the replay keeps a map from the lab's to SGLang's, built from the
answers (`alloc_device`, load backs) and checked by every later one: a match must name the same KV in both. Each
copy finishes in SGLang at the step the recorded rank consumed its ack (`completion.AgreedCompletion`). Where the
answers differ the lab's decisions are kept (its next operations are replayed as recorded), so later rounds show
what the difference led to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...config import CacheConfig
from ...errors import ConfigError
from ...jsonl import read_jsonl
from .cache import SGLangCache
from .completion import AgreedCompletion


def read_ops(path: Path) -> tuple[dict, list[dict]]:
    """The recorded configuration and operations of one rank's file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no recorded cache operations (run with --record-cache-ops)")
    records = [record for _, record in read_jsonl(path, "conform")]
    if records[0].get("op") != "config":
        raise ConfigError(f"{path}: not a cache-operations file (no configuration line)")
    end, ops = records[-1], records[1:-1]
    if end.get("op") != "end" or end.get("operations") != len(ops):
        raise ConfigError(
            f"{path}: the recording stops after {len(records) - 1} operations without its end line (its run was "
            "killed, or the file was cut): conform compares only whole recordings; record the run again"
        )
    unknown = sorted(set(records[0]["cache"]) - {f.name for f in dataclasses.fields(CacheConfig)})
    if unknown:
        raise ConfigError(
            f"{path}: recorded by another version of the lab (cache fields unknown here: {', '.join(unknown)}); "
            "record the run again with this one"
        )
    return records[0], ops


@dataclass
class RoundHits:
    """Hit tokens of one round's admissions, by tier."""

    admitted: int = 0
    device: int = 0
    host: int = 0


@dataclass
class OpDifference:
    index: int  # operation number in the file (0 = the first operation after the configuration)
    op: str
    what: str
    lab: object
    sglang: object

    def __str__(self) -> str:
        return f"operation {self.index} ({self.op}): {self.what}: lab {self.lab}, SGLang {self.sglang}"


@dataclass
class Replay:
    """What a replay found: per-round hits as the lab answered and as SGLang did, and every difference."""

    operations: int = 0
    replayed: int = 0
    lab: list[RoundHits] = field(default_factory=list)
    sglang: list[RoundHits] = field(default_factory=list)
    differences: list[OpDifference] = field(default_factory=list)
    stopped: str | None = None  # why the replay could not go on (SGLang refused an operation the lab did)
    fault: str = ""  # the --fault the run was recorded with: it, not the lab, explains the differences

    @property
    def equal(self) -> bool:
        return not self.differences and self.stopped is None


class _Replayer:
    """Sends a rank's recorded operations, one by one, to SGLang's cache (`apply`: each through its method in
    `CACHE_OPS`), and notes every answer that differs from the lab's."""

    def __init__(self, config: dict):
        cfg = CacheConfig(**config["cache"])
        self.clock = AgreedCompletion()
        self.sglang = SGLangCache(cfg, config["host_tokens"], self.clock)
        self.nodes: dict[int, int] = {}  # lab node id -> SGLang node id
        self.slots: dict[int, int] = {}  # lab slot -> SGLang slot
        self.match = None
        self.lab_match: dict | None = None
        self.result = Replay()

    def apply(self, index: int, record: dict) -> None:
        """Operation `index` on SGLang's cache; its answer, and the pools after it, compared with the lab's."""
        op, s = record["op"], self.sglang
        if op not in CACHE_OPS:
            raise ConfigError(f"operation {index}: unknown cache operation {op!r}")
        CACHE_OPS[op](self, (index, op), record.get("args", {}), record.get("ans"))
        got_state = [s.device_free(), s.host_free(), s.evictable()]
        if got_state != record["state"]:
            self.differ((index, op), "after it: free device, free host, evictable", record["state"], got_state)

    def differ(self, at: tuple[int, str], what: str, lab, sglang) -> None:
        self.result.differences.append(OpDifference(*at, what, lab, sglang))

    def to_sglang(self, slots: list[int]) -> torch.Tensor:
        missing = [s for s in slots if s not in self.slots]
        if missing:
            raise LookupError(f"lab slots {missing[:4]} were never matched to SGLang's")
        return torch.tensor([self.slots[s] for s in slots], dtype=torch.int64)

    def learn_slots(self, lab: list[int], sglang: torch.Tensor) -> None:
        self.slots.update(zip(lab, sglang.tolist(), strict=True))

    def same_slots(self, at: tuple[int, str], lab: list[int], sglang: torch.Tensor) -> None:
        """The same KV on both sides: same length, and the lab's slots are (by the map) SGLang's."""
        if len(lab) != len(sglang):
            self.differ(at, "prefix length", len(lab), len(sglang))
        elif any(self.slots.get(a) != b for a, b in zip(lab, sglang.tolist(), strict=True)):
            self.differ(at, "prefix slots (another KV)", lab[:8], sglang.tolist()[:8])

    # -- the operations, each as `(at, args, lab's answer)` ------------------------------------------------

    def advance(self, at, args: dict, lab) -> None:
        self.sglang.clock.advance(args["step"])

    def check_hicache_events(self, at, args: dict, lab) -> None:
        self.clock.allow(*lab)
        if (got := list(self.sglang.check_hicache_events())) != lab:
            self.differ(at, "acks consumed (write, load)", lab, got)

    def match_prefix(self, at, args: dict, lab) -> None:
        self.match, self.lab_match = self.sglang.match_prefix(tuple(args["key"])), lab
        self.nodes[lab["device_node"]] = self.match.last_device_node
        self.same_slots(at, lab["device"], self.match.device_indices)
        if self.match.host_hit_length != lab["host"]:
            self.differ(at, "host hit length", lab["host"], self.match.host_hit_length)

    def lock_ref(self, at, args: dict, lab) -> None:  # inc_lock_ref, dec_lock_ref
        getattr(self.sglang, at[1])(self.nodes[args["node"]])

    def device_room(self, at, args: dict, lab) -> None:
        if (got := self.sglang.device_room()) != lab:
            self.differ(at, "device room", lab, got)

    def lock_match(self, at, args: dict, lab) -> None:
        """The match locked (and its host part loaded back): the prefix both hand the request, and its hits."""
        device = len(self.lab_match["device"])
        prefix, last = self.sglang.lock_match(self.match)
        self.nodes[lab["node"]] = last
        loaded_lab, loaded = lab["prefix"][device:], prefix[len(self.match.device_indices) :]
        if len(loaded_lab) == len(loaded):
            self.learn_slots(loaded_lab, loaded)
        self.same_slots(at, lab["prefix"], prefix)
        for hits, prefix_len, device_len in (
            (self.result.lab[-1], len(lab["prefix"]), device),
            (self.result.sglang[-1], len(prefix), len(self.match.device_indices)),
        ):
            hits.admitted += 1
            hits.device += device_len
            hits.host += prefix_len - device_len

    def evict(self, at, args: dict, lab) -> None:  # evict, evict_host
        if (got := getattr(self.sglang, at[1])(args["tokens"])) != lab:
            self.differ(at, "tokens freed", lab, got)

    def alloc_device(self, at, args: dict, lab) -> None:
        self.learn_slots(lab, self.sglang.alloc_device(args["tokens"], args.get("demand")))

    def evict_to_free(self, at, args: dict, lab) -> None:
        if self.sglang.evict_to_free(args["tokens"]) != lab:
            self.differ(at, "the slots are free", lab, not lab)

    def free_request(self, at, args: dict, lab) -> None:
        self.sglang.free_request(self.to_sglang(args["slots"]), args["prefix_len"], self.nodes[args["node"]])

    def cache_unfinished_req(self, at, args: dict, lab) -> None:
        slots, node = self.to_sglang(args["slots"]), self.nodes[args["node"]]
        prefix, last = self.sglang.cache_unfinished_req(
            tuple(args["tokens"]), slots, args["prefix_len"], node, args["inserted_len"]
        )
        self.nodes[lab["node"]] = last
        self.same_slots(at, lab["prefix"], prefix)

    def cache_finished_req(self, at, args: dict, lab) -> None:
        slots, node = self.to_sglang(args["slots"]), self.nodes[args["node"]]
        tokens, prefix_len = tuple(args["tokens"]), args["prefix_len"]
        got = self.sglang.cache_finished_req(tokens, slots, prefix_len, node, args["inserted_len"], args["prompt_len"])
        if got != lab:
            self.differ(at, "tokens the tree already held", lab, got)

    def start_loading(self, at, args: dict, lab) -> None:
        if self.sglang.start_loading() != lab:
            self.differ(at, "a load started", lab, not lab)

    def copies_in_flight(self, at, args: dict, lab) -> None:
        if self.sglang.copies_in_flight() != lab:
            self.differ(at, "copies in flight", lab, not lab)

    def flush_pending_backups(self, at, args: dict, lab) -> None:
        self.sglang.flush_pending_backups()

    def new_round(self, at, args: dict, lab) -> None:
        self.result.lab.append(RoundHits())
        self.result.sglang.append(RoundHits())

    def flush(self, at, args: dict, lab) -> None:
        self.clock.finish_all()
        self.sglang.flush()


CACHE_OPS = {  # each recorded operation: how it is replayed
    "advance": _Replayer.advance,
    "check_hicache_events": _Replayer.check_hicache_events,
    "match_prefix": _Replayer.match_prefix,
    "inc_lock_ref": _Replayer.lock_ref,
    "dec_lock_ref": _Replayer.lock_ref,
    "device_room": _Replayer.device_room,
    "lock_match": _Replayer.lock_match,
    "evict": _Replayer.evict,
    "evict_host": _Replayer.evict,
    "alloc_device": _Replayer.alloc_device,
    "evict_to_free": _Replayer.evict_to_free,
    "free_request": _Replayer.free_request,
    "cache_unfinished_req": _Replayer.cache_unfinished_req,
    "cache_finished_req": _Replayer.cache_finished_req,
    "start_loading": _Replayer.start_loading,
    "copies_in_flight": _Replayer.copies_in_flight,
    "flush_pending_backups": _Replayer.flush_pending_backups,
    "new_round": _Replayer.new_round,
    "flush": _Replayer.flush,
}


def replay(path: Path) -> Replay:
    """Replay one rank's recorded operations through SGLang's cache (needs sglang 0.5.23)."""
    config, ops = read_ops(path)
    if config["cache"].get("storage_backend", "none") != "none":
        raise ConfigError(
            f"{path}: a run with an L3 tier; conform compares the device and host tiers (run without "
            "--hicache-storage-backend)"
        )
    replayer = _Replayer(config)
    result = replayer.result
    result.operations, result.fault = len(ops), config.get("fault", "")
    result.lab.append(RoundHits())
    result.sglang.append(RoundHits())
    for index, record in enumerate(ops):
        try:
            replayer.apply(index, record)
        except Exception as exc:  # SGLang refused what the lab did (after an earlier difference)
            result.stopped = f"operation {index} ({record['op']}): {type(exc).__name__}: {exc}"
            break
        result.replayed = index + 1
    if not (result.lab[0].admitted or result.sglang[0].admitted):  # what came before the first round
        del result.lab[0], result.sglang[0]
    return result
