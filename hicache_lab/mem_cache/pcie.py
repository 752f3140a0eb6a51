"""How KV bytes cross PCIe between the GPU pool and the pinned host pool (CUDA only).

Two mechanisms, each used where it is fast (`bench/copy_bandwidth.py` measures both against a plain `copy_`):

* **DMA of page runs** (`page_first` with runs of at least `DMA_MIN_RUN_BYTES`): all layers of a host page
  are adjacent, so each contiguous run of pages is one `copy_` per K and V. The device side is gathered into
  page order (or scattered from it) on a helper stream, in chunks, so the gather of chunk c+1 overlaps the
  DMA of chunk c. The whole job is one step: it gives up layer-by-layer overlap for bandwidth.
* **GPU loads and stores through UVA** (everything else): pinned host memory has a device address, so a
  kernel reads or writes the host pool directly, one launch per layer, whatever the page size or layout
  (SGLang's `kernel` I/O backend does the same with its own CUDA kernels). Where Triton is installed (it
  comes with CUDA builds of torch) the kernel runs on `COPY_PROGRAMS` thread blocks only, so a prefill can
  compute on the other SMs while its prefix loads layer by layer; otherwise torch's index kernels do the
  copy, and they take the whole GPU (`bench/load_overlap.py` shows the difference).

Each function runs on the current stream, which the copy engine has made its write or load stream.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without it
    triton = None

DMA_MIN_RUN_BYTES = 1 << 20  # below this a run's DMA costs more in calls than UVA loses in bandwidth
DMA_CHUNKS = 4  # gather/DMA pipeline depth
# Thread blocks a UVA copy may occupy (an H200 has 132 SMs). Measured there (BENCHMARKS.md): 16 keeps 0.84x of
# the PCIe ceiling for backups and lets a prefill finish in 1.1-1.2x max(compute, copy); 32 loads faster but
# overlaps less; 8 halves the load bandwidth.
COPY_PROGRAMS = 16

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


if triton is not None:

    @triton.jit
    def _copy_rows_kernel(src, dst, src_rows, dst_rows, n, src_kind, src_row, dst_kind, dst_row, ROW: tl.constexpr):
        """dst[kind, dst_rows[i]] = src[kind, src_rows[i]] for K and V (grid axis 1), rows of ROW elements."""
        cols = tl.arange(0, ROW)
        kind = tl.program_id(1)
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            s = tl.load(src_rows + i).to(tl.int64)
            d = tl.load(dst_rows + i).to(tl.int64)
            row = tl.load(src + kind * src_kind + s * src_row + cols)
            tl.store(dst + kind * dst_kind + d * dst_row + cols, row)


def copy_layer(to_host: bool, host_layer: torch.Tensor, device_layer: torch.Tensor, host_idx, device_idx) -> None:
    """One layer's K and V, `[2, tokens, heads, head_dim]` views of the pools, moved row by row (a row is one
    token's heads): by the bounded Triton kernel where it can run, else by a torch index kernel."""
    src, dst, src_idx, dst_idx = (device_layer, host_layer, device_idx, host_idx)
    if not to_host:
        src, dst, src_idx, dst_idx = dst, src, dst_idx, src_idx
    row = src.shape[2] * src.shape[3]
    if triton is None or not dst.is_cuda or row & (row - 1):  # the kernel moves power-of-two rows
        dst[:, dst_idx] = src[:, src_idx]
        return
    assert src.stride(2) == dst.stride(2) == src.shape[3] and src.stride(3) == dst.stride(3) == 1
    grid = (COPY_PROGRAMS, 2)
    strides = (src.stride(0), src.stride(1), dst.stride(0), dst.stride(1))
    _copy_rows_kernel[grid](src, dst, src_idx, dst_idx, len(src_idx), *strides, ROW=row)
