"""The DMA staging ring (mem_cache/staging_ring.py), checked on the CPU with a chunk of a few tokens: whatever a
backup's size, it stages only in the ring's fixed memory, its bytes arrive exactly, and preflight counts the ring.

On the CPU the ring's streams are `InlineStreams`: every operation runs at once, in order, and a DMA is a `copy_`
that also checks where the device side of it lies. The ring itself (its chunks, its pieces, its buffer) is the
ring a GPU runs; what only a GPU can show (the event waits between streams) is tests/mem_cache/
test_pools_and_copies.py's `test_gpu_copies_round_trip_exactly`.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from hicache_lab.config import CacheConfig, RunConfig
from hicache_lab.entrypoints.preflight import memory_needed
from hicache_lab.mem_cache import pcie
from hicache_lab.mem_cache.memory_pool import DeviceKVPool
from hicache_lab.mem_cache.memory_pool_host import HostKVPool
from hicache_lab.mem_cache.staging_ring import STAGING_CHUNKS, StagingRing, pieces, ring_bytes
from hicache_lab.parallel_config import ParallelConfig

CHUNK = 3  # tokens a chunk holds: a fake, small size, so that every copy below needs the ring many times over


def span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def inside(t: torch.Tensor, outer: torch.Tensor) -> bool:
    (lo, hi), (outer_lo, outer_hi) = span(t), span(outer)
    return outer_lo <= lo and hi <= outer_hi


class InlineStreams:
    """Every stream operation at once, in program order; a DMA checks that its device side lies in the ring's
    buffer (its host side is in the host pool)."""

    helper = "helper"

    def __init__(self, host_kv: torch.Tensor):
        self.host_kv, self.ring, self.dmas = host_kv, None, 0

    def copy(self) -> str:
        return "copy"

    def on(self, stream: str):
        return contextlib.nullcontext()

    def wait_stream(self, stream: str, other: str) -> None:
        pass

    def record(self, slot: int, stream: str) -> None:
        pass

    def wait(self, slot: int, stream: str) -> None:
        pass

    def dma(self, dst: torch.Tensor, src: torch.Tensor, stream: str) -> None:
        staged = dst if inside(src, self.host_kv) else src
        assert inside(staged, self.ring.buffer), "a DMA staged outside the ring"
        dst.copy_(src)
        self.dmas += 1


def pools(tokens=96, layers=3):
    device = DeviceKVPool(tokens, layers, num_heads=2, head_dim=4, device="cpu")
    device.kv.copy_(torch.randn_like(device.kv))
    return device, HostKVPool(2 * tokens, device, "page_first")


def ring_of(device: DeviceKVPool, streams: InlineStreams) -> StagingRing:
    streams.ring = StagingRing(CHUNK * device.bytes_per_token, device.bytes_per_token, device.size, streams)
    return streams.ring


def scattered(pages: int, first_page: int, seed: int, page: int = 4) -> torch.Tensor:
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)) + first_page
    return (order[:, None] * page + torch.arange(page)).flatten()


def test_pieces_cover_the_runs_exactly_and_never_cross_a_chunk():
    host, device = torch.tensor([9, 10, 11, 12, 13, 3, 4, 20]), torch.tensor([0, 1, 2, 3, 4, 7, 8, 5])
    cut = pcie.runs(host, device)
    assert [a.tolist() for a in cut] == [[9, 3, 20], [0, 7, 5], [5, 2, 1]]
    h, d, n, chunk, at = pieces(cut, CHUNK)
    assert n.tolist() == [3, 2, 1, 1, 1] and chunk.tolist() == [0, 1, 1, 2, 2] and at.tolist() == [0, 0, 2, 0, 1]
    assert all(a + k <= CHUNK for a, k in zip(at.tolist(), n.tolist(), strict=True))
    got = np.concatenate(
        [np.stack([np.arange(a, a + k), np.arange(b, b + k)]) for a, b, k in zip(h, d, n, strict=True)], axis=1
    )
    assert got.tolist() == [host.tolist(), device.tolist()]


@pytest.mark.parametrize("pages", [1, 4, 16, 24])
def test_staging_stays_in_the_ring_whatever_the_copy_size_and_the_bytes_arrive(pages):
    """A backup of 4 to 96 tokens, pages of 4 scattered on both sides, through a ring of 4 chunks of 3 tokens: the
    ring's buffer is `ring_bytes` whatever the copy, and every DMA stages inside it; K and V of every layer reach
    the host slots exactly, and nothing else changes there."""
    device, host = pools()
    src, dst = scattered(pages, 0, seed=pages), scattered(pages, 24, pages + 1)
    expected = host.kv.clone()
    expected[:, dst] = device.kv[:, :, src].transpose(1, 2)
    streams = InlineStreams(host.kv)
    ring_of(device, streams).to_host(host.kv, device.kv, pcie.runs(dst, src))
    assert torch.equal(host.kv, expected)
    bound = ring_bytes(CHUNK * device.bytes_per_token, device.bytes_per_token, device.size)
    assert bound == STAGING_CHUNKS * CHUNK * device.bytes_per_token
    assert streams.ring.buffer.numel() * streams.ring.buffer.element_size() == bound
    assert streams.dmas >= 2 * pages * 4 / CHUNK  # K and V of every chunk: the ring went round


def test_a_ring_reused_by_later_copies_allocates_nothing_more():
    device, host = pools()
    ring = ring_of(device, InlineStreams(host.kv))
    ring.to_host(host.kv, device.kv, pcie.runs(scattered(2, 24, 0), scattered(2, 0, 1)))
    buffer = ring.buffer
    ring.to_host(host.kv, device.kv, pcie.runs(scattered(20, 24, 2), scattered(20, 0, 3)))
    assert ring.buffer is buffer


def test_a_ring_never_holds_more_than_the_device_pool():
    bpt = 1024
    assert ring_bytes(1 << 30, bpt, pool_tokens=100) == STAGING_CHUNKS * 25 * bpt  # 100 tokens, not 1 GiB
    assert ring_bytes(10, bpt, pool_tokens=100) == STAGING_CHUNKS * bpt  # a chunk holds a token at least


def test_preflight_counts_one_ring_per_rank_on_cuda_and_none_elsewhere():
    def staging(device, layout="page_first", chunk_mib=32, hierarchical=True):
        cache = CacheConfig(enable_hierarchical_cache=hierarchical, host_layout=layout, dma_chunk_mib=chunk_mib)
        cfg = RunConfig(cache=cache, parallel=ParallelConfig(pp=2), device=device)
        return memory_needed(cfg)["DMA staging ring"]

    n, flags, on_device = staging("cuda", chunk_mib=1)
    kv = RunConfig().model
    per_token = 2 * -(-kv.num_layers // 2) * kv.num_heads * kv.head_dim * 4
    assert (n, flags, on_device) == (
        2 * STAGING_CHUNKS * ((1 << 20) // per_token) * per_token,  # 2 ranks
        "--hicache-dma-chunk-mib",
        True,
    )
    assert staging("cuda", chunk_mib=1 << 10)[0] == 2 * CacheConfig().max_total_tokens * per_token  # capped
    assert staging("cpu")[0] == staging("cuda", layout="layer_first")[0] == staging("cuda", hierarchical=False)[0] == 0
