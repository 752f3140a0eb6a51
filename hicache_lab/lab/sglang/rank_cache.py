"""`run --cache-impl sglang`: every rank's cache is sglang 0.5.23's own `UnifiedRadixCache` (with its
`HybridCacheController`, host pool and, with L3, its own storage backend and threads), built with that rank's
real process groups (world.py), so that SGLang's own agreement (`_sync_hicache_ready_counts`, `_all_reduce`,
`_pp_sync`, `_drain_async_work`, the prefetch sync groups) runs across the lab's ranks.

The lab's scheduler, model, oracle and trace drive it through the cache contract (`mem_cache/base.py`):
`SGLangRankCache` is `SGLangCache` (cache.py: each operation an SGLang entry point) plus what a rank of a run
asks besides: its step clock, storage prefetch, observation and integrity. The model reads and writes SGLang's
device pool (`SGLangPool`), so `--check-outputs` checks the bytes SGLang's copies moved. Each copy finishes
when this rank's own copy engine says (the lab's latency model), so ranks see their copies finish at different
steps, as SGLang's ranks do; with `--sync legacy` (reverts.py) SGLang's own objects agree as they did before
the PP and CP fixes.
"""

from __future__ import annotations

import hashlib
from array import array
from pathlib import Path

import torch

from ...config import CacheConfig
from ...mem_cache.build import KVShape
from ...mem_cache.utils import match_key
from .cache import SGLangCache


class SGLangPool:
    """SGLang's device KV pool as the lab's model reads it (`DeviceKVPool.buffers`): per-layer K and V of
    `[slots, heads, head_dim]` (SGLang's hold a page more: slot 0's page is its padding)."""

    def __init__(self, kv, shape: KVShape):
        self.kv, self.bytes_per_token = kv, shape.bytes_per_token

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.k_buffer[layer], self.kv.v_buffer[layer]


class SGLangRankCache(SGLangCache):
    """One rank's SGLang cache in a lab world, answering the whole cache contract."""

    def __init__(self, cfg: CacheConfig, host_tokens: int, clock, shape: KVShape, world):
        super().__init__(cfg, host_tokens, clock, shape, world)
        self.pool = SGLangPool(self.kv, shape)
        self.handles: dict[int, object] = {}  # rid -> SGLang's CacheRequestHandle of its prefetch
        self.ready = (0, 0)  # this rank's own poll of finished acks at the last step start

    # -- the step --------------------------------------------------------------------------------------

    def advance(self, step: int) -> None:
        self.clock.advance(step)

    def check_hicache_events(self) -> tuple[int, int]:
        if self.controller is not None:
            c, count = self.controller, self.cache._count_ready_acks
            self.ready = count(c.ack_write_queue), count(c.ack_load_queue)
        return super().check_hicache_events()

    def start_loading(self):
        """SGLang's loads start (on CPU its copy moves the bytes as it starts): nothing for the forward to wait on."""
        super().start_loading()
        return None

    # -- storage ---------------------------------------------------------------------------------------

    def prefetch_from_storage(self, rid: int, prompt: list[int]) -> None:
        """SGLang's scheduler's `_prefetch_kvcache`: match, then ask SGLang's cache to prefetch what lies beyond
        the match, below a backed-up (or root) anchor."""
        if self.controller is None or not self.cache.enable_storage:
            return
        match = self.match_prefix(match_key(prompt, self.cfg.page_size))
        anchor, held = match.last_host_node, len(match.device_indices) + match.host_hit_length
        cache = self.cache
        if not (cache.is_backuped(anchor) or cache.is_root(anchor)):
            return
        handle = self.handles[rid] = self.sg.params.CacheRequestHandle(rid=str(rid), attempt_id=0)
        end = len(match_key(prompt, 1))  # SGLang's `_compute_max_prefix_len`: all but the last token
        cache.prefetch_from_storage(
            handle,
            anchor,
            array("q", prompt[held:end]),
            cache.get_last_hash_value(anchor),
            None,
            matched_prefix_tokens=list(prompt[:held]),
        )

    def check_prefetch_progress(self, rid: int) -> int | None:
        """SGLang's `check_prefetch_progress`, then `pop_prefetch_loaded_span`: None while it waits, else the
        tokens it put in the tree. SGLang's scheduler closes the prefetch's accounting at the admission that
        follows (`finish_storage_prefetch_admission`); the lab's asks no more of it, so it is closed here, with
        every loaded token counted as fulfilled (it feeds SGLang's metrics and its wait's deadline only)."""
        handle = self.handles.get(rid)
        if handle is None:
            return 0
        if not self.cache.check_prefetch_progress(handle):
            return None
        loaded, _ = self.cache.pop_prefetch_loaded_span(handle)
        self.cache.finish_storage_prefetch_admission(handle, fulfilled_tokens=loaded, reason=None)
        del self.handles[rid]
        return loaded

    def copies_in_flight(self) -> bool:
        return super().copies_in_flight() or bool(self.cache.ongoing_prefetch if self.controller else False)

    def waits_on_storage(self) -> bool:
        return bool(self.handles) or bool(self.controller is not None and self.cache.enable_storage and self._busy())

    def _busy(self) -> bool:
        c = self.controller
        return any(q is not None and q.qsize() for q in (c.prefetch_hit_queue, c.ack_backup_queue, c.backup_queue))

    # -- observation -----------------------------------------------------------------------------------

    def tree_slots(self) -> torch.Tensor:
        """Every device slot the tree holds."""
        return self.cache.tree_core.all_values_flatten()

    def digest(self) -> str:
        """The tree as far as its totals and device slots show it: equal on ranks that took the same decisions."""
        values = self.tree_slots()
        state = (
            sorted(values.tolist()),
            self.cache.total_size(),
            self.evictable(),
            self.device_free(),
            self.host_free(),
        )
        return hashlib.sha256(repr(state).encode()).hexdigest()

    def observe(self) -> dict:
        return {
            "ready_write": self.ready[0],
            "ready_load": self.ready[1],
            "digest": self.digest(),
            "device_free": self.device_free(),
            "host_free": self.host_free(),
        }

    def check_integrity(self, held_by_requests: int = 0) -> None:
        """SGLang's own `sanity_check`, and every device slot free, in the tree, or held by a request."""
        self.cache.sanity_check()
        in_tree = len(self.tree_slots())
        accounted = self.device_free() + in_tree + held_by_requests
        size = self.cfg.max_total_tokens
        assert accounted == size, f"SGLang's device slots leaked: {accounted} accounted of {size}"

    def copy_check(self):
        return None

    def summary(self) -> dict:
        """SGLang's prefetch counters, and in the lab's terms (`storage`, as the lab's storage tier reports them):
        prefetches issued, declined for the rate limit, revoked, and the pages of this rank's keys in the store."""
        if self.controller is None or not self.cache.enable_storage:
            return {}
        stats = self.cache.prefetch_outcome_stats_snapshot()
        backend = self.controller.storage_backend
        storage = {
            "prefetches": stats["issued"],
            "rate_limited": stats["declined_rate_limited"],
            "revoked": stats["revoked_insufficient"] + stats["revoked_full_miss"],
            "pages_backed_up": len(list(Path(backend.file_path).glob(f"*{backend.config_suffix}.bin"))),
        }
        return {"storage": storage, "sglang": {"prefetch": stats}}

    def close(self) -> None:
        """SGLang's storage threads stop; the copy engine finishes."""
        if self.controller is not None and self.cache.enable_storage:
            self.cache.detach_storage_backend()
        self.clock.close()
