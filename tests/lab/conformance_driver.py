"""Drives one rank's cache through the operations of the scheduler's contract, as `Scheduler` does, recording
them (lab/sglang/recording.py), so that lab/sglang/replay.py can replay them through SGLang's cache. The operations
come from a test: `("request", conversation, pages, keep)`, `("decode", i)`, `("finish", i)`, `("retract", i)`,
`("step",)`, `("evict", n)`, `("evict_host", n)`. A request goes into the tree after its prefill and again when
it finishes, its answer a page per `decode`; a retracted one leaves without inserting. A request continues one
of a few conversations by `pages` new pages (a conversation longer than half the device pool starts over), so
the tree branches, leaves compete for eviction, and a conversation taken up again finds its prefix on the
device, on the host only, or gone."""

from __future__ import annotations

from pathlib import Path

import torch

from hicache_lab.config import CacheConfig
from hicache_lab.lab.sglang.recording import RecordingCache
from hicache_lab.mem_cache.build import one_rank_cache

DEVICE_TOKENS = 128
NEW_TOKENS = 5  # a request's new tokens per `pages`, rounded up to whole pages (so host hits of 10 tokens occur)


def lab_cache(groups, page_size: int, policy: str, max_delay: int, host_ratio: float, seed: int = 0, **overrides):
    """One rank's cache as `build_cache` makes it for a run (`one_rank_cache`); CacheConfig fields by name on top."""
    cfg = CacheConfig(
        **overrides,
        max_total_tokens=DEVICE_TOKENS,
        page_size=page_size,
        enable_hierarchical_cache=True,
        hicache_ratio=host_ratio,
        write_policy=policy,
        max_copy_delay_steps=max_delay,
    )
    return one_rank_cache(cfg, groups, seed=seed)[1]


def random_ops(rng, count: int) -> list[tuple]:
    """`count` operations drawn as the tests' strategy draws them."""
    kinds = ["request", "request", "decode", "finish", "retract", "step", "step", "evict", "evict_host"]
    ops = []
    for kind in rng.choices(kinds, k=count):
        if kind == "request":
            ops.append((kind, rng.randint(0, 5), rng.randint(1, 8), rng.random() < 0.5))
        elif kind in ("decode", "finish", "retract"):
            ops.append((kind, rng.randint(0, 7)))
        elif kind == "step":
            ops.append((kind,))
        else:
            ops.append((kind, rng.randint(1, 32)))
    return ops


class Driver:
    def __init__(self, cache, path: Path):
        self.cache = RecordingCache(cache, path, rank=0)
        self.ps = cache.cfg.page_size
        self.conversations: dict[int, tuple[int, ...]] = {}
        self.open: list[tuple] = []
        self.steps = 0
        self.fresh = 1000  # tokens never seen before

    def key(self, conversation: int, pages: int) -> tuple[int, ...]:
        """The conversation so far and about `pages` x 5 new tokens."""
        start = self.conversations.get(conversation, ())
        if len(start) + pages * self.ps > DEVICE_TOKENS // 2:
            start = ()
        ext = tuple(range(self.fresh, self.fresh + -(-pages * NEW_TOKENS // self.ps) * self.ps))
        self.fresh += len(ext)
        return start + ext

    def request(self, conversation: int, pages: int, keep: bool) -> None:
        """Admit as the scheduler does (match all but the last page, lock, check room, load back, allocate),
        then insert the prompt as its prefill's result does."""
        c, key = self.cache, self.key(conversation, pages)
        match = c.match_prefix(key[: len(key) - self.ps])
        c.inc_lock_ref(match.last_device_node)
        if c.device_room() < len(key) - len(match.device_indices):
            c.dec_lock_ref(match.last_device_node)
            return
        prefix, last = c.lock_match(match)
        c.start_loading()
        slots = torch.cat([prefix, c.alloc_device(len(key) - len(prefix))])
        tree_slots, last = c.cache_unfinished_req(key, slots, len(prefix), last, 0)
        self.conversations[conversation] = key
        self.open.append(
            {"conversation": conversation, "key": key, "prompt": len(key), "slots": tree_slots, "last": last}
        )
        if not keep:
            self.finish(len(self.open) - 1)

    def decode(self, i: int) -> None:
        """One page of answer for an open request (the slots a decode step takes, evicting first)."""
        if self.open and self.cache.evict_to_free(self.ps):
            req = self.open[i % len(self.open)]
            page = self.cache.alloc_device(self.ps, self.ps * len(self.open))
            req["slots"] = torch.cat([req["slots"], page])
            req["key"] += tuple(range(self.fresh, self.fresh + self.ps))
            self.fresh += self.ps
            self.conversations[req["conversation"]] = req["key"]

    def finish(self, i: int) -> None:
        if self.open:
            req = self.open.pop(i % len(self.open))
            prompt = req["prompt"]
            self.cache.cache_finished_req(req["key"], req["slots"], prompt, req["last"], prompt, prompt)
            self.cache.flush_pending_backups()

    def retract(self, i: int) -> None:
        if self.open:
            req = self.open.pop(i % len(self.open))
            self.cache.free_request(req["slots"], req["prompt"], req["last"])

    def step(self) -> None:
        self.steps += 1
        self.cache.advance(self.steps)
        self.cache.check_hicache_events()

    def evict(self, n: int) -> None:
        self.cache.evict(n)

    def evict_host(self, n: int) -> None:
        self.cache.evict_host(n)

    def apply(self, op: tuple) -> None:
        kind, *args = op
        getattr(self, kind)(*args)

    def close(self) -> None:
        while self.open:
            self.finish(0)
        for _ in range(5):  # every copy due by then (delays are at most 3 steps)
            self.step()
        self.cache.close()
