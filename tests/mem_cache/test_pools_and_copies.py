"""Pools, allocators and the copy engine under each latency model."""

from __future__ import annotations

import pytest
import torch

from hicache_lab.config import ModelConfig
from hicache_lab.mem_cache import pcie
from hicache_lab.mem_cache.copy_engine import CopyJob, CudaCopyEngine, ThreadCopyEngine, VirtualCopyEngine
from hicache_lab.mem_cache.memory_pool import DeviceKVPool, PageAllocator
from hicache_lab.mem_cache.memory_pool_host import HostKVPool
from hicache_lab.model import ForwardBatch, TinyModel

NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run the suite on a machine with one)"
)


def filled_device_pool(size=32, layers=2):
    pool = DeviceKVPool(size, layers, num_heads=2, head_dim=4, device="cpu")
    for layer in range(layers):
        pool.k[layer].copy_(torch.randn_like(pool.k[layer]))
        pool.v[layer].copy_(torch.randn_like(pool.v[layer]))
    return pool


def copy_job(host: HostKVPool, device: DeviceKVPool, host_idx, device_idx) -> CopyJob:
    return CopyJob(host.copy_layers(True, device, host_idx, device_idx), lambda: host.poison(host_idx))


def test_allocator_hands_out_whole_pages_and_reports_exhaustion():
    alloc = PageAllocator(16, page_size=4, name="device pool")
    slots = alloc.alloc(5)
    assert slots.tolist() == list(range(8))
    assert alloc.alloc(9) is None  # 3 pages asked, 2 left
    alloc.free(slots)
    assert alloc.available_size() == 16
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free(slots[:4])


def test_allocator_hands_out_the_longest_free_pages_first_in_the_order_freed():
    """First in, first out, through the ring's wrap: the order every rank's identical frees must reproduce."""
    alloc = PageAllocator(12, page_size=2, name="device pool")  # pages 0-5
    a, b, c = alloc.alloc(4), alloc.alloc(2), alloc.alloc(4)  # pages 0 1 | 2 | 3 4
    alloc.free(torch.cat([c[2:], a]))  # queued behind page 5, in the order given: 4, 0, 1
    alloc.free(b)  # then 2
    assert alloc.alloc(8).tolist() == [10, 11, 8, 9, 0, 1, 2, 3]  # pages 5, 4, 0, 1
    assert alloc.alloc(2).tolist() == [4, 5]  # page 2
    assert alloc.alloc(1) is None  # page 3 is still c's
    alloc.free(c[:2])
    assert alloc.alloc(1).tolist() == [6, 7]
    assert alloc.available_size() == 0


def test_allocator_refuses_a_page_listed_twice_in_one_free_and_changes_nothing():
    alloc = PageAllocator(16, page_size=4, name="host pool")
    slots = alloc.alloc(16)
    with pytest.raises(AssertionError, match="host pool: page 2 freed twice"):
        alloc.free(torch.cat([slots[8:12], slots[12:16], slots[8:12]]))
    assert alloc.available_size() == 0
    alloc.free(slots[8:])
    assert alloc.alloc(8).tolist() == list(range(8, 16))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_round_trip_is_exact_in_both_layouts(layout):
    device = filled_device_pool()
    host = HostKVPool(64, device, layout)
    src, dst, back = torch.tensor([3, 4, 9, 10]), torch.tensor([40, 41, 7, 8]), torch.tensor([20, 21, 22, 23])
    for layer in range(2):
        host.copy_layer(True, device, dst, src, layer)
        host.copy_layer(False, device, dst, back, layer)
        assert torch.equal(device.k[layer][back], device.k[layer][src])
        assert torch.equal(device.v[layer][back], device.v[layer][src])


@NEEDS_CUDA
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("mechanism", ["uva", "uva-torch", "dma"])
def test_gpu_copies_round_trip_exactly(layout, mechanism, monkeypatch):
    """Both ways across PCIe (UVA kernels, Triton's or torch's; a backup by DMA of page runs with `page_first`,
    through a staging ring of 4 chunks of 3 tokens, so that a copy of 80 tokens goes round the ring 7 times, each
    chunk waiting for its slot's last reader), scattered pages."""
    dma = mechanism == "dma"
    monkeypatch.setattr(pcie, "DMA_MIN_RUN_BYTES", 1 if dma else 1 << 40)
    if mechanism == "uva-torch":
        monkeypatch.setattr(pcie, "triton", None)
    device = DeviceKVPool(256, 3, num_heads=2, head_dim=8, device="cuda", dtype=torch.bfloat16)
    device.kv.copy_(torch.randn_like(device.kv))
    host = HostKVPool(512, device, layout, dma_chunk_bytes=3 * device.bytes_per_token)
    engine = CudaCopyEngine(0.0, seed=0, rank=0)
    pages = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    src = (pages[:10, None] * 8 + torch.arange(8)).flatten()
    dst = (pages[10:20, None] * 16 + torch.arange(8)).flatten()
    back = (pages[20:30, None] * 8 + torch.arange(8)).flatten()
    assert (pcie.dma_runs(layout, device.bytes_per_token, dst, src) is not None) == (dma and layout == "page_first")
    engine.submit("write", CopyJob(host.copy_layers(True, device, dst, src), lambda: None)).synchronize()
    engine.submit("load", CopyJob(host.copy_layers(False, device, dst, back), lambda: None)).synchronize()
    assert torch.equal(device.kv[:, :, back], device.kv[:, :, src])
    assert torch.equal(torch.stack(host.buffers(2))[:, dst].cuda(), device.kv[:, 2, src])


@NEEDS_CUDA
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_gpu_load_moves_one_layer_per_step_even_where_a_backup_goes_by_dma(layout, monkeypatch):
    """Layer i's attention waits for layer i's load alone: a load's first step has moved layer 0 and no other,
    in both layouts, even with runs long enough for DMA."""
    monkeypatch.setattr(pcie, "DMA_MIN_RUN_BYTES", 1)
    device = DeviceKVPool(64, 3, num_heads=2, head_dim=8, device="cuda")
    device.kv.copy_(torch.randn_like(device.kv))
    host = HostKVPool(64, device, layout)
    src, back = torch.arange(0, 16), torch.arange(32, 48)
    host.copy_layers(True, device, src, src)[0]()
    device.kv[:, :, back] = 0
    steps = host.copy_layers(False, device, src, back)
    steps[0]()
    torch.cuda.synchronize()
    assert torch.equal(device.kv[:, 0, back], device.kv[:, 0, src])
    assert not device.kv[:, 1:, back].any(), "the first step moved a later layer too"
    for step in steps[1:]:
        step()
    torch.cuda.synchronize()
    assert torch.equal(device.kv[:, :, back], device.kv[:, :, src])


def test_virtual_copy_poisons_until_due_then_moves_bytes():
    device = filled_device_pool()
    host = HostKVPool(64, device, "layer_first")
    engine = VirtualCopyEngine(max_delay_steps=3, seed=0, rank=0)
    events = [engine.submit("write", copy_job(host, device, torch.tensor([i]), torch.tensor([i]))) for i in range(8)]
    assert host.kv[:, :, :8].isnan().all()  # every destination holds poison before completion
    dues = [e.due for e in events]
    assert dues == sorted(dues), "a stream completes in order"
    engine.advance(dues[3])
    done = [e.query() for e in events]
    assert done == [d <= dues[3] for d in dues]
    events[-1].synchronize()  # forces completion of it and everything before it
    assert all(e.query() for e in events)
    assert torch.equal(host.kv[0, 0, :8], device.k[0][:8])


def test_virtual_completion_steps_are_seeded_per_rank():
    def dues(seed, rank):
        engine = VirtualCopyEngine(max_delay_steps=3, seed=seed, rank=rank)
        return [engine.submit("load", CopyJob([], lambda: None)).due for _ in range(20)]

    assert dues(1, 0) == dues(1, 0)
    assert dues(1, 0) != dues(1, 1)


def test_thread_engine_copies_for_real_and_signals_per_layer():
    device = filled_device_pool()
    host = HostKVPool(64, device, "page_first")
    engine = ThreadCopyEngine(injected_delay_ms=2.0, seed=0, rank=0)
    try:
        idx = torch.arange(8)
        event = engine.submit("write", copy_job(host, device, idx, idx))
        event.wait_layer(0)
        event.synchronize()
        assert event.query()
        assert torch.equal(host.buffers(1)[1][:8], device.v[1][:8])
    finally:
        engine.close()


def test_thread_engine_surfaces_a_failed_copy():
    engine = ThreadCopyEngine(injected_delay_ms=0.0, seed=0, rank=0)
    try:
        event = engine.submit("load", CopyJob([lambda: 1 / 0], lambda: None))
        with pytest.raises(RuntimeError, match="worker thread failed"):
            event.synchronize()
    finally:
        engine.close()


@NEEDS_CUDA
def test_a_prefill_launches_every_layer_while_its_load_is_still_in_flight():
    """The forward waits for a layer's load on the GPU (an event its stream waits on), never on the CPU: with the
    load's first layer a second late, the CPU has launched every layer before the load is done. A blocking copy
    in the forward (the positions, once per layer, until issue 32) waits for the stream and so for the load. The
    forward runs once before, so that the caching allocator has its memory: a cudaMalloc waits for the GPU too."""
    cfg = ModelConfig(num_layers=3)
    model, device = TinyModel(cfg, "cuda"), DeviceKVPool(64, 3, cfg.num_heads, cfg.head_dim, device="cuda")
    slots = torch.arange(8)
    batch = ForwardBatch(torch.arange(8), torch.arange(8), slots, [slots], [8])
    model.forward_layers(model.embed(batch.tokens), batch, device)
    torch.cuda.synchronize()
    late = [lambda: torch.cuda._sleep(1000 * CudaCopyEngine.CYCLES_PER_MS)] + [lambda: None] * 2
    batch.load_event = CudaCopyEngine(0.0, seed=0, rank=0).submit("load", CopyJob(late, lambda: None))
    hidden = model.forward_layers(model.embed(batch.tokens), batch, device)
    assert not batch.load_event.query(), "the CPU waited for the load before launching the last layer"
    torch.cuda.synchronize()
    assert batch.load_event.query() and hidden.isfinite().all()
