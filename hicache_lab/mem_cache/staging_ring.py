"""The staging ring: how a backup by DMA from the device pool to a `page_first` host pool stays within a fixed
amount of device memory (pcie.py says which copies go by DMA: backups only).

A run of slots contiguous on both sides is one DMA for K and one for V, but a DMA moves contiguous bytes, and the
pools lay a token out differently: the host pool `[2, tokens, layers, heads, head_dim]`, the device pool `[2, layers,
tokens, ...]`. So the device side of a run is gathered into staging memory in the host layout by a strided copy on a
helper stream, then moved to the host by DMA. A copy used to stage all its runs at once: 2 GiB of device memory for
an 8,192-token fp32 copy, which preflight did not count.

A host pool now stages through one `StagingRing`: `STAGING_CHUNKS` chunks of `chunk_tokens` slots
(`--hicache-dma-chunk-mib`, fewer where the device pool is smaller), allocated on first use. A copy of any size
stages in those `ring_bytes`, and preflight counts one ring per rank (`entrypoints/preflight.memory_needed`).
`pieces` lays a copy's runs end to end and cuts them at chunk boundaries, in one vector operation; the copy's k-th
chunk goes to slot k mod `STAGING_CHUNKS`. Before a slot is gathered into again, the helper stream waits for the
event recorded when the slot's DMAs were issued, in this copy or an earlier one. So gathers and DMAs of consecutive
chunks overlap, and no chunk is overwritten before it has been read.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch

from . import pcie

STAGING_CHUNKS = 4  # up to 3 chunks are gathered while a fourth crosses PCIe


def chunk_tokens(chunk_bytes: int, bytes_per_token: int, pool_tokens: int) -> int:
    """Slots of one chunk: as many tokens as `chunk_bytes` holds (at least one), but no more than a ring of them
    needs to stage the whole device pool of `pool_tokens` at once (no copy is larger)."""
    return max(1, min(chunk_bytes // bytes_per_token, -(-pool_tokens // STAGING_CHUNKS)))


def ring_bytes(chunk_bytes: int, bytes_per_token: int, pool_tokens: int) -> int:
    """Device memory of one ring: what staging takes in one direction, whatever the copies."""
    return STAGING_CHUNKS * chunk_tokens(chunk_bytes, bytes_per_token, pool_tokens) * bytes_per_token


def pieces(runs: pcie.Runs, tokens_per_chunk: int) -> tuple[np.ndarray, ...]:
    """The runs laid end to end in staging and cut where a chunk ends: each piece's host start, device start,
    length, chunk (counted from the copy's first) and start inside its chunk."""
    host, device, lengths = runs
    ends = np.cumsum(lengths)
    starts = ends - lengths
    cuts = np.union1d(starts, np.arange(0, ends[-1], tokens_per_chunk))  # where each piece starts in staging
    run = np.searchsorted(starts, cuts, side="right") - 1
    into = cuts - starts[run]
    length = np.diff(cuts, append=ends[-1])
    return host[run] + into, device[run] + into, length, cuts // tokens_per_chunk, cuts % tokens_per_chunk


class CudaStreams:
    """How a ring's work is ordered on a GPU: the copy stream (current while a copy job runs), the ring's helper
    stream, one event per ring slot, and DMAs by `cudaMemcpyAsync`."""

    def __init__(self, helper: torch.cuda.Stream):
        self.helper = helper
        self.events = [torch.cuda.Event() for _ in range(STAGING_CHUNKS)]

    def copy(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def on(self, stream: torch.cuda.Stream):
        return torch.cuda.stream(stream)

    def wait_stream(self, stream: torch.cuda.Stream, other: torch.cuda.Stream) -> None:
        stream.wait_stream(other)

    def record(self, slot: int, stream: torch.cuda.Stream) -> None:
        self.events[slot].record(stream)

    def wait(self, slot: int, stream: torch.cuda.Stream) -> None:
        stream.wait_event(self.events[slot])  # a slot never recorded: no wait

    def dma(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
        pcie.dma(dst, src, stream)


class StagingRing:
    """`STAGING_CHUNKS` chunks of `chunk_tokens` slots in the host layout on the device pool's device, and the
    backups by DMA that stage through them (those of one host pool)."""

    def __init__(self, chunk_bytes: int, bytes_per_token: int, pool_tokens: int, streams: CudaStreams):
        self.chunk_tokens, self.streams = chunk_tokens(chunk_bytes, bytes_per_token, pool_tokens), streams
        self.buffer: torch.Tensor | None = None  # [STAGING_CHUNKS, 2, chunk_tokens, layers, heads, head_dim]

    def _chunks(self, host_kv: torch.Tensor, device_kv: torch.Tensor, runs: pcie.Runs):
        """(slot, [(host start, device start, length, start in the slot)]) of each chunk of a copy, in order."""
        if self.buffer is None:
            shape = (STAGING_CHUNKS, 2, self.chunk_tokens, *host_kv.shape[2:])
            self.buffer = torch.empty(shape, dtype=host_kv.dtype, device=device_kv.device)
        host, device, length, chunk, at = pieces(runs, self.chunk_tokens)
        bounds = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), len(chunk)]
        host, device, length, slot, at = (a.tolist() for a in (host, device, length, chunk % STAGING_CHUNKS, at))
        for a, b in pairwise(bounds):
            yield slot[a], list(zip(host[a:b], device[a:b], length[a:b], at[a:b], strict=True))

    def to_host(self, host_kv: torch.Tensor, device_kv: torch.Tensor, runs: pcie.Runs) -> None:
        """host_kv [2, tokens, layers, ...] (page_first) <- device_kv [2, layers, tokens, ...] over `runs`, a chunk at
        a time: gathered into a slot on the helper stream (a strided copy, no index), then K and V of each piece
        by one DMA each on the copy stream."""
        s, by_token = self.streams, device_kv.transpose(1, 2)  # [2, tokens, layers, heads, head_dim], as the host's
        copy, helper = s.copy(), s.helper
        s.wait_stream(helper, copy)  # the KV being backed up is ready on the copy stream
        for slot, chunk in self._chunks(host_kv, device_kv, runs):
            staged = self.buffer[slot]
            s.wait(slot, helper)  # the slot's last DMAs have read it
            with s.on(helper):
                for _, d, n, at in chunk:
                    staged[:, at : at + n].copy_(by_token[:, d : d + n])
            s.wait_stream(copy, helper)
            for h, _, n, at in chunk:
                for kind in (0, 1):
                    s.dma(host_kv[kind, h : h + n], staged[kind, at : at + n], copy)
            s.record(slot, copy)
