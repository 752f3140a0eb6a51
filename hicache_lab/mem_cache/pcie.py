"""How KV bytes cross PCIe between the GPU pool and the pinned host pool (CUDA only).

Two mechanisms, each used where it is fast (`bench/copy_bandwidth.py` measures both against a plain `copy_`):

* **DMA of slot runs**, for backups (`page_first` with runs of at least `DMA_MIN_RUN_BYTES`): all layers of a
  host page are adjacent, so each run of slots contiguous on both sides is one DMA per K and V. The runs are cut
  once per copy, by one vector operation (`dma_runs`). The device side of a run is gathered into the host layout
  on a helper stream by a strided copy, through a bounded ring of staging chunks (staging_ring.py), so the gather
  of one chunk overlaps the DMA of the one before. The DMAs go straight to the CUDA runtime (`cudaMemcpyAsync`
  through ctypes): less CPU time per call than `copy_` (BENCHMARKS.md), which matters because the scheduler's
  thread issues them. Where that library is not loaded, UVA does the copy. Nothing waits for a backup's layers
  one by one, so the whole job is one step. Loads do not go by DMA: a DMA moves every layer of a token at once,
  so layer 0's attention would wait for the last layer's bytes (BENCHMARKS.md compares the two end to end).
* **GPU loads and stores through UVA** (every load, and the other backups): pinned host memory has a device
  address, so a kernel reads or writes the host pool directly, one launch per layer for a load (so that a
  prefill can wait for its layers one by one) and one for every layer of a backup, whatever the page size or
  layout (SGLang's `kernel` I/O backend does the same with its own CUDA kernels). Where Triton is installed (it
  comes with CUDA builds of torch) the kernel runs on `COPY_PROGRAMS` thread blocks only, so a prefill can
  compute on the other SMs while its prefix loads layer by layer; each block moves `COPY_TILE` rows at a
  time, which keeps enough reads in flight for loads. Otherwise torch's index kernels do the copy, and they
  take the whole GPU (`bench/load_overlap.py` shows the difference).

Each function runs on the current stream, which the copy engine has made its write or load stream.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without it
    triton = None

# Copies whose runs (contiguous on both sides) average less than this for K (or V) go by UVA. Measured on an
# H200 (BENCHMARKS.md): runs of 1 MiB by DMA reached 0.67-0.70x of the PCIe ceiling where UVA reached
# 0.83-0.90x; runs of 4 MiB by DMA 0.85-0.95x.
DMA_MIN_RUN_BYTES = 4 << 20
# Thread blocks a UVA copy may occupy (an H200 has 132 SMs), and rows each moves at a time. Measured there
# (BENCHMARKS.md): 16 blocks let a prefill finish in 0.81-0.97x of compute + copy while its prefix loads; one
# row at a time they loaded at 0.65x of the PCIe ceiling, 4 rows at a time at 0.86x (8 and 16: no better).
COPY_PROGRAMS = 16
COPY_TILE = 4
COPY_WARPS = 4  # Triton's default; neither more warps, nor more blocks or rows, loads faster (BENCHMARKS.md)
CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyKind: the direction follows from the (unified) addresses

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


Runs = tuple[np.ndarray, np.ndarray, np.ndarray]  # host starts, device starts, lengths of slot runs


def runs(host_idx: torch.Tensor, device_idx: torch.Tensor) -> Runs:
    """The runs of a (non-empty) index pair that are contiguous on both sides, cut by one vector operation."""
    host, device = host_idx.numpy(), device_idx.numpy()  # numpy: a tenth of torch's per-call overhead here
    starts = np.concatenate(([0], np.flatnonzero((np.diff(host) != 1) | (np.diff(device) != 1)) + 1))
    return host[starts], device[starts], np.diff(starts, append=len(host))


def dma_runs(layout: str, bytes_per_token: int, host_idx: torch.Tensor, device_idx: torch.Tensor) -> Runs | None:
    """The runs of a copy between these slots when it is best done by DMA (see the module docstring): their runs
    contiguous on both sides are, on average, `DMA_MIN_RUN_BYTES` or longer for K (or V) alone. Else None."""
    if layout != "page_first" or len(host_idx) == 0 or _cuda_runtime() is None:
        return None
    cut = runs(host_idx, device_idx)
    return cut if len(host_idx) * bytes_per_token / (2 * len(cut[2])) >= DMA_MIN_RUN_BYTES else None


@cache
def _cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (found in this process's memory map), or None."""
    try:
        with open("/proc/self/maps") as maps:  # address perms offset dev inode path (which may hold spaces)
            fields = next((line.split(maxsplit=5) for line in maps if "libcudart" in line), None)
        if fields is None or len(fields) < 6:
            return None
        runtime = ctypes.CDLL(fields[5].strip())
    except OSError:  # no maps file, or a library that will not load: UVA does the copies
        return None
    runtime.cudaMemcpyAsync.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    runtime.cudaMemcpyAsync.restype = ctypes.c_int
    return runtime


def dma(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """dst <- src (contiguous, one on the device and one in pinned host memory) by DMA on `stream`."""
    nbytes = src.numel() * src.element_size()
    err = _cuda_runtime().cudaMemcpyAsync(
        dst.data_ptr(), src.data_ptr(), nbytes, CUDA_MEMCPY_DEFAULT, stream.cuda_stream
    )
    if err:
        raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes failed with CUDA error {err}")


if triton is not None:

    @triton.jit
    def _copy_rows_kernel(
        src,
        dst,
        src_rows,
        dst_rows,
        n,
        layers,
        src_kind,
        src_layer,
        src_row,
        dst_kind,
        dst_layer,
        dst_row,
        ROW: tl.constexpr,
        TILE: tl.constexpr,
    ):
        """dst[kind, layer, dst_rows[i]] = src[kind, layer, src_rows[i]] for K and V (grid axis 1) and every layer,
        rows of ROW elements, TILE rows per block at a time."""
        cols = tl.arange(0, ROW)
        kind = tl.program_id(1)
        for layer in range(layers):
            src_base = src + kind * src_kind + layer * src_layer
            dst_base = dst + kind * dst_kind + layer * dst_layer
            for start in range(tl.program_id(0) * TILE, n, tl.num_programs(0) * TILE):
                i = start + tl.arange(0, TILE)
                inside = i < n
                s = tl.load(src_rows + i, mask=inside, other=0).to(tl.int64)
                d = tl.load(dst_rows + i, mask=inside, other=0).to(tl.int64)
                rows = tl.load(src_base + s[:, None] * src_row + cols[None, :], mask=inside[:, None])
                tl.store(dst_base + d[:, None] * dst_row + cols[None, :], rows, mask=inside[:, None])


def copy_rows(to_host: bool, host_layers: torch.Tensor, device_layers: torch.Tensor, host_idx, device_idx) -> None:
    """K and V of a range of layers, `[2, layers, tokens, heads, head_dim]` views of the pools, moved row by row
    (a row is one token's heads in one layer) in one launch: by the bounded Triton kernel where it can run, else
    by a torch index kernel. Indices must be on the pools' device."""
    src, dst, src_idx, dst_idx = (device_layers, host_layers, device_idx, host_idx)
    if not to_host:
        src, dst, src_idx, dst_idx = dst, src, dst_idx, src_idx
    row = src.shape[3] * src.shape[4]
    if triton is None or not dst.is_cuda or row & (row - 1):  # the kernel moves power-of-two rows
        dst[:, :, dst_idx] = src[:, :, src_idx]
        return
    assert src.stride(3) == dst.stride(3) == src.shape[4] and src.stride(4) == dst.stride(4) == 1
    grid, strides = (COPY_PROGRAMS, 2), (*src.stride()[:3], *dst.stride()[:3])
    args = (src, dst, src_idx, dst_idx, len(src_idx), src.shape[1], *strides)
    _copy_rows_kernel[grid](*args, ROW=row, TILE=COPY_TILE, num_warps=COPY_WARPS)
