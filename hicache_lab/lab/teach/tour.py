"""One rank's HiRadixCache driven by hand, one request at a time (notebooks/01_hicache_tour.ipynb).

`OneRank.serve(tokens)` does what the scheduler does for one request, without a model: match the prefix, lock it,
load back what only the host holds, allocate slots for the rest (evicting if needed), write its KV, insert it and
unlock; its write-through host copy starts as the batch ends. `step()` is the start of the next scheduler step:
copies due by now finish (virtual latency) and the cache consumes the finished acks. A world of one: the agreement
calls run on size-1 groups, exactly where they run on many ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...config import CacheConfig
from ...mem_cache.build import one_rank_cache
from ...mem_cache.utils import whole_pages


class OneRank:
    def __init__(self, device_tokens: int = 32, host_ratio: float = 2.0, page_size: int = 4, max_delay: int = 1):
        self.owns_world = not dist.is_initialized()
        if self.owns_world:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.cfg = CacheConfig(
            max_total_tokens=device_tokens,
            hicache_ratio=host_ratio,
            page_size=page_size,
            enable_hierarchical_cache=True,
            load_back_threshold=page_size,
            max_copy_delay_steps=max_delay,
        )
        self.pool, self.cache = one_rank_cache(self.cfg, check_copies=True)
        self.tree = self.cache.tree
        self.steps = 0

    def step(self) -> tuple[int, int]:
        """The next scheduler step begins: due copies finish; (write acks, load acks) consumed."""
        self.steps += 1
        self.cache.advance(self.steps)
        return self.cache.check_hicache_events()

    def serve(self, tokens: list[int]) -> dict[str, int]:
        """Serve one request whose whole sequence is `tokens` (page-aligned); how its tokens were found."""
        key = whole_pages(tokens, self.cfg.page_size)
        match = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(match.last_device_node)
        prefix, last = self.cache.lock_match(match)  # loads back what only the host holds
        self.cache.start_loading()
        own = self.cache.alloc_device(len(key) - len(prefix))
        k, v = self.pool.buffers(0)
        k[own], v[own] = 1.0, -1.0  # the "forward pass" writes this request's new KV
        self.cache.cache_finished_req(key, torch.cat([prefix, own]), len(prefix), last)
        self.cache.flush_pending_backups()  # the batch ends: its host writes start, as one copy
        loaded = len(prefix) - len(match.device_indices)
        return {"device_hit": len(match.device_indices), "loaded_from_host": loaded, "new": len(key) - len(prefix)}

    def pools(self) -> dict[str, int]:
        c = self.cache
        return {
            "device_free": c.device_alloc.available_size(),
            "device_size": c.device_alloc.size,
            "host_free": c.host_alloc.available_size(),
            "host_size": c.host_alloc.size,
            "write_acks_queued": len(c.controller.ack_write_queue),
            "load_acks_queued": len(c.controller.ack_load_queue),
        }

    def close(self) -> None:
        """Leave the world of one (so that a run can start its own in this process)."""
        self.cache.close()
        if self.owns_world:
            dist.destroy_process_group()
