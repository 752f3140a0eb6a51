"""How KV bytes cross PCIe between the GPU pool and the pinned host pool (CUDA only).

Two mechanisms, each used where it is fast (`bench/copy_bandwidth.py` measures both against a plain `copy_`):

* **DMA of page runs** (`page_first` with runs of at least `DMA_MIN_RUN_BYTES`): all layers of a host page
  are adjacent, so each contiguous run of pages is one `copy_` per K and V. The device side is gathered into
  page order (or scattered from it) on a helper stream, in chunks, so the gather of chunk c+1 overlaps the
  DMA of chunk c. The whole job is one step: it gives up layer-by-layer overlap for bandwidth.
* **GPU loads and stores through UVA** (everything else): pinned host memory has a device address, so an
  index kernel reads or writes the host pool directly, one kernel per layer and direction, whatever the page
  size or layout. This is what SGLang's `kernel` I/O backend does with its own CUDA kernels.

Each function runs on the current stream, which the copy engine has made its write or load stream.
"""

from __future__ import annotations

import numpy as np
import torch

DMA_MIN_RUN_BYTES = 1 << 20  # below this a run's DMA costs more in calls than UVA loses in bandwidth
DMA_CHUNKS = 4  # gather/DMA pipeline depth

_SAME_SIZE_INT = {1: (torch.uint8, "|u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"), 8: (torch.int64, "<i8")}


class _CudaArray:
    def __init__(self, host: torch.Tensor, typestr: str):
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 2,
        }


def device_alias(host: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the same (contiguous, pinned) host memory: kernels read and write it over PCIe."""
    assert host.is_pinned() and host.is_contiguous(), "only contiguous pinned memory has a device address"
    as_int, typestr = _SAME_SIZE_INT[host.element_size()]  # the interface has no bf16: alias as an int type
    return torch.as_tensor(_CudaArray(host.view(as_int), typestr), device="cuda").view(host.dtype)


def uses_dma(layout: str, bytes_per_token: int, host_idx: torch.Tensor) -> bool:
    """True when a copy of these host slots is best done as DMA of page runs (see the module docstring)."""
    if layout != "page_first" or len(host_idx) == 0:
        return False
    runs = int(np.count_nonzero(np.diff(host_idx.numpy()) != 1)) + 1
    return len(host_idx) * bytes_per_token / (2 * runs) >= DMA_MIN_RUN_BYTES


def runs(dst_idx: torch.Tensor, src_idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split an index pair into (dst_start, src_start, length) runs that are contiguous on both sides."""
    dst, src = dst_idx.numpy(), src_idx.numpy()  # numpy: a tenth of torch's per-call overhead at these sizes
    starts = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1
    starts = np.concatenate(([0], starts))
    lengths = np.diff(np.concatenate((starts, [len(dst)])))
    return list(zip(dst[starts].tolist(), src[starts].tolist(), lengths.tolist(), strict=True))


def _chunks(pieces: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    per = -(-len(pieces) // DMA_CHUNKS)
    return [pieces[i : i + per] for i in range(0, len(pieces), per)]


def dma_to_host(host_kv: torch.Tensor, device_kv: torch.Tensor, host_idx, device_idx, helper) -> None:
    """host_kv [2, tokens, layers, ...] (page_first) <- device_kv [2, layers, tokens, ...], page runs by DMA."""
    copy = torch.cuda.current_stream()
    by_token = device_kv.transpose(1, 2)
    helper.wait_stream(copy)
    for chunk in _chunks(runs(host_idx, torch.arange(len(host_idx)))):
        lo, hi = chunk[0][1], chunk[-1][1] + chunk[-1][2]
        with torch.cuda.stream(helper):
            staged = by_token[:, device_idx[lo:hi]]  # one gather, in page order, in HBM
        copy.wait_stream(helper)
        staged.record_stream(copy)
        for d, s, n in chunk:
            for kind in (0, 1):
                host_kv[kind, d : d + n].copy_(staged[kind, s - lo : s - lo + n], non_blocking=True)


def dma_to_device(host_kv: torch.Tensor, device_kv: torch.Tensor, host_idx, device_idx, helper) -> None:
    """The reverse of `dma_to_host`: page runs by DMA into HBM, scattered into the pool on a helper stream."""
    copy = torch.cuda.current_stream()
    by_token = device_kv.transpose(1, 2)
    for chunk in _chunks(runs(torch.arange(len(host_idx)), host_idx)):
        lo, hi = chunk[0][0], chunk[-1][0] + chunk[-1][2]
        staged = torch.empty((2, hi - lo, *host_kv.shape[2:]), dtype=host_kv.dtype, device=device_kv.device)
        for d, s, n in chunk:
            for kind in (0, 1):
                staged[kind, d - lo : d - lo + n].copy_(host_kv[kind, s : s + n], non_blocking=True)
        helper.wait_stream(copy)
        with torch.cuda.stream(helper):
            by_token[:, device_idx[lo:hi]] = staged
        staged.record_stream(helper)
    copy.wait_stream(helper)
