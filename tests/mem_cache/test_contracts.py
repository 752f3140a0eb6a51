"""The written contracts of mem_cache/base.py hold for the parts that claim them: every copy engine and its events,
every storage backend, both caches. A part that leaves out an operation is caught."""

from __future__ import annotations

import inspect

import pytest
import torch

from hicache_lab.config import CacheConfig
from hicache_lab.mem_cache.base import BaseHiCache, BasePrefixCache, CopyEngine, CopyEvent, StorageBackend
from hicache_lab.mem_cache.copy_engine import CopyJob, ThreadCopyEngine, VirtualCopyEngine
from hicache_lab.mem_cache.hicache_storage import FileStorage
from hicache_lab.mem_cache.hiradix_cache import HiRadixCache
from hicache_lab.mem_cache.memory_pool import PageAllocator
from hicache_lab.mem_cache.mooncake_store import MooncakeStorage
from hicache_lab.mem_cache.radix_cache import RadixCache


@pytest.mark.parametrize("make", [lambda: VirtualCopyEngine(2, seed=0, rank=0), lambda: ThreadCopyEngine(0, 0, 0)])
def test_every_engine_and_its_events_keep_the_copy_contract(make):
    engine = make()
    moved = []
    event = engine.submit("write", CopyJob([lambda: moved.append(0), lambda: moved.append(1)], lambda: None))
    assert isinstance(engine, CopyEngine) and isinstance(event, CopyEvent)
    event.synchronize()
    assert event.query() and moved == [0, 1]
    engine.close()


def test_every_storage_backend_keeps_the_storage_contract(tmp_path):
    assert isinstance(FileStorage(tmp_path, "m0"), StorageBackend)
    # MooncakeStorage needs a running store to construct: its class must hold every operation, and set `stats`
    assert all(callable(getattr(MooncakeStorage, name)) for name in ("batch_exists", "batch_get", "batch_set"))
    assert all(callable(getattr(MooncakeStorage, name)) for name in ("clear", "close"))
    assert "self.stats" in inspect.getsource(MooncakeStorage.__init__)


def test_both_caches_implement_their_contracts():
    assert issubclass(RadixCache, BasePrefixCache) and issubclass(HiRadixCache, BaseHiCache)
    assert not RadixCache.__abstractmethods__ and not HiRadixCache.__abstractmethods__


def test_a_host_tier_that_leaves_out_an_operation_is_caught():
    """HiRadixCache's bases, in its order: the device-only cache's empty `check_hicache_events` must not stand in
    for the agreement a host tier owes."""

    class NoAgreement(BaseHiCache, RadixCache):
        evict_host = init_load_back = writing_check = loading_check = HiRadixCache.evict_host

    with pytest.raises(TypeError, match="check_hicache_events"):
        NoAgreement(CacheConfig(max_total_tokens=8), PageAllocator(8, 1, "device pool"))

    class NoQuery:
        def synchronize(self) -> None: ...

        def wait_layer(self, layer: int) -> None: ...

    assert not isinstance(NoQuery(), CopyEvent)


def test_evicting_nothing_is_always_safe():
    cache = RadixCache(CacheConfig(max_total_tokens=8), PageAllocator(8, 1, "device pool"))
    cache.insert((1, 2, 3), cache.alloc_device(3))
    assert cache.evict(0) == 0 and cache.tree.device_size() == 3
    cache.check_integrity()
    assert torch.equal(cache.match_prefix((1, 2, 3)).device_indices, torch.tensor([0, 1, 2]))
