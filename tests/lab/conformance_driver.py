"""Drives one rank's cache through the operations of the scheduler's contract, as `Scheduler` does, recording
them (mem_cache/recording.py), so that lab/conformance.py can replay them through SGLang's cache. The operations
come from a test: `("request", base, pages, keep)`, `("finish", i)`, `("step",)`, `("evict", n)`,
`("evict_host", n)`."""

from __future__ import annotations

from pathlib import Path

import torch

from hicache_lab.config import CacheConfig, ParallelConfig
from hicache_lab.distributed.cache_sync import CacheSync
from hicache_lab.mem_cache.build import KVShape, build_cache
from hicache_lab.mem_cache.recording import RecordingCache

DEVICE_TOKENS = 64


def lab_cache(groups, page_size: int, policy: str, max_delay: int, host_ratio: float, seed: int = 0):
    cfg = CacheConfig(
        max_total_tokens=DEVICE_TOKENS,
        page_size=page_size,
        enable_hierarchical_cache=True,
        hicache_ratio=host_ratio,
        write_policy=policy,
        max_copy_delay_steps=max_delay,
    )
    sync = CacheSync("fixed", groups, ParallelConfig().fixes)
    return build_cache(cfg, KVShape(num_layers=2, num_heads=1, head_dim=2), sync, seed=seed)[1]


class Driver:
    def __init__(self, cache, path: Path):
        self.cache = RecordingCache(cache, path, rank=0)
        self.ps = cache.cfg.page_size
        self.history: list[tuple[int, ...]] = [()]
        self.open: list[tuple] = []
        self.steps = 0
        self.fresh = 1000  # tokens never seen before

    def key(self, base: int, pages: int) -> tuple[int, ...]:
        """An extension of a recent key by `pages` pages (shared prefixes), at most half the device pool."""
        start = self.history[-1 - base % len(self.history)]
        ext = tuple(range(self.fresh, self.fresh + pages * self.ps))
        self.fresh += len(ext)
        return (start + ext)[: DEVICE_TOKENS // 2 // self.ps * self.ps]

    def request(self, base: int, pages: int, keep: bool) -> None:
        """Admit as the scheduler does: match all but the last page, lock, check room, load back, allocate."""
        c, key = self.cache, self.key(base, pages)
        match = c.match_prefix(key[: len(key) - self.ps])
        c.inc_lock_ref(match.last_device_node)
        if c.device_room() < len(key) - len(match.device_indices):
            c.dec_lock_ref(match.last_device_node)
            return
        prefix, last = c.lock_match(match)
        c.start_loading()
        own = c.alloc_device(len(key) - len(prefix))
        self.history.append(key)
        self.open.append((key, torch.cat([prefix, own]), len(prefix), last))
        if not keep:
            self.finish(len(self.open) - 1)

    def finish(self, i: int) -> None:
        if self.open:
            key, slots, prefix_len, last = self.open.pop(i % len(self.open))
            self.cache.cache_finished_req(key, slots, prefix_len, last)
            self.cache.flush_pending_backups()

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
