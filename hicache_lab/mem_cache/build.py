"""The one wiring of a rank's cache: device pool and allocator; with the host tier, the copy engine, host pool,
controller, storage tier and `HiRadixCache`. The launcher (entrypoints/rank.py), the tour, the exhaustive check
and the tests all build their cache here, so each of them runs the cache that `python -m hicache_lab run` runs.
`one_rank_cache` is that cache in a world of one (the tour, the radix and conformance tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import CacheConfig
from ..distributed.cache_sync import CacheSync
from ..distributed.parallel_state import Groups, RankLayout, build_groups
from ..parallel_config import ParallelConfig
from .base import CopyEngine, StorageBackend
from .cache_controller import HiCacheController
from .copy_engine import make_copy_engine
from .hicache_storage import is_storage_writer
from .hiradix_cache import HiRadixCache
from .memory_pool import DeviceKVPool, PageAllocator, kv_bytes_per_token
from .memory_pool_host import HostKVPool
from .radix_cache import RadixCache
from .storage_tier import StorageTier


@dataclass(frozen=True)
class KVShape:
    """What one rank's pools hold per token: its stage's layers, its shard of the heads, in the model's dtype."""

    num_layers: int
    num_heads: int
    head_dim: int
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_heads, self.head_dim, self.dtype)


def build_cache(
    cfg: CacheConfig,
    kv: KVShape,
    sync: CacheSync,
    *,
    engine: CopyEngine | None = None,
    backend: StorageBackend | None = None,
    check_copies: bool = False,
    seed: int = 0,
) -> tuple[DeviceKVPool, RadixCache]:
    """The device pool the model reads and writes, and the cache that manages it.

    `engine` defaults to the one `cfg.latency` names (seeded by `seed` and the rank); `backend` adds the L3 tier on it;
    `check_copies` compares every consumed copy with its source (`--check-outputs`). Sized in bytes, the host
    pool's token count is agreed across ranks (`CacheSync.agree_host_capacity`): collective, like the sync itself.
    """
    pool = DeviceKVPool(cfg.max_total_tokens, kv.num_layers, kv.num_heads, kv.head_dim, kv.device, kv.dtype)
    device_alloc = PageAllocator(cfg.max_total_tokens, cfg.page_size, "device pool")
    if not cfg.enable_hierarchical_cache:
        return pool, RadixCache(cfg, device_alloc)
    rank = sync.groups.layout.rank
    if engine is None:
        engine = make_copy_engine(
            cfg.latency, kv.device, cfg.max_copy_delay_steps, cfg.injected_delay_ms, seed=seed, rank=rank
        )
    host_tokens = sync.agree_host_capacity(cfg.host_tokens(pool.bytes_per_token))
    host_pool = HostKVPool(host_tokens, pool, cfg.host_layout, cfg.dma_chunk_mib << 20)
    host_alloc = PageAllocator(host_tokens, cfg.page_size, "host pool")
    controller = HiCacheController(
        pool, device_alloc, host_pool, host_alloc, engine, check_copies=check_copies, copy_checksum=cfg.copy_checksum
    )
    tier = None
    if backend is not None:
        writer = is_storage_writer(cfg, sync.groups.layout)
        tier = StorageTier(cfg, backend, host_pool, host_alloc, sync, writer=writer, seed=seed, rank=rank)
    return pool, HiRadixCache(cfg, device_alloc, sync, controller, tier)


def one_rank_cache(
    cfg: CacheConfig, groups: Groups | None = None, *, num_layers: int = 2, check_copies: bool = False, seed: int = 0
) -> tuple[DeviceKVPool, RadixCache]:
    """`build_cache` for a world of one: the agreements run on its size-1 groups (`groups`, or built here on the
    default process group, which must exist), with `--sync fixed`'s fixes, as on many ranks; the pools hold `num_layers`
    layers of one head of 2 dimensions on the CPU."""
    if groups is None:
        groups = build_groups(RankLayout(1, 1, 1, 0), ParallelConfig())
    sync = CacheSync(groups, ParallelConfig())
    kv = KVShape(num_layers, num_heads=1, head_dim=2)
    return build_cache(cfg, kv, sync, check_copies=check_copies, seed=seed)
