"""Copy bandwidth of the lab's copy engine against the PCIe ceiling, measured in the same run (GPU only).

For a realistic KV shape (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token) and a batch of at
least 64 MB, it times device->host backup and host->device load of whole pages through the lab's own pools
(`HostKVPool.copy_layers`, as the controller issues them) on the `CudaCopyEngine`'s streams, for page sizes 1, 16
and 64 and both host layouts, by whichever mechanism the pool picks (`hicache_lab/mem_cache/pcie.py`: a backup by DMA of
page runs, or by one UVA index kernel for every layer; a load by one UVA kernel per layer). Pages are
scattered (random page order on both sides), as in a pool after churn. The ceiling is a plain `copy_` of
the same byte count between one contiguous device tensor and one pinned host tensor. Two figures each: one
batch on an idle GPU (its CPU-side preparation shows), and 8 batches back to back (the preparation of one
overlaps the copy of the one before, as when a scheduler writes many nodes through). Targets:
every layout and page size >= 0.90x the ceiling for one batch, >= 0.95x for 8 in a row.

`--kernel-shapes` then times the loads again with the copy kernel launched on other shapes: thread blocks
(`pcie.COPY_PROGRAMS`), rows each block moves at a time (`COPY_TILE`) and warps per block (`COPY_WARPS`), to show
whether a wider kernel reads host memory faster (rows `kernel_shapes` in the JSON).

    PYTHONPATH=. python -m bench.copy_bandwidth                   # on a CUDA machine
    PYTHONPATH=. python -m bench.copy_bandwidth --kernel-shapes   # and the loads on 12 kernel shapes
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.common import save
from hicache_lab.mem_cache import pcie
from hicache_lab.mem_cache.copy_engine import CopyJob, CudaCopyEngine
from hicache_lab.mem_cache.memory_pool import DeviceKVPool
from hicache_lab.mem_cache.memory_pool_host import HostKVPool

LAYERS, HEADS, HEAD_DIM = 32, 8, 128


STREAMED = 8  # batches back to back
SHAPES = [(programs, tile, warps) for programs in (16, 64, 132) for tile in (4, 8) for warps in (4, 8)]


def timed(fn, repeats: int, batches: int = 1) -> float:
    """Median seconds per batch of `fn` called `batches` times (its work left on the GPU), after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batches):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / batches)
    return sorted(times)[len(times) // 2]


def scattered_slots(tokens: int, page_size: int, pool_tokens: int, generator) -> torch.Tensor:
    pages = torch.randperm(pool_tokens // page_size, generator=generator)[: tokens // page_size]
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


def engine_copy(engine: CudaCopyEngine, stream: str, to_host: bool, host, device, host_idx, device_idx):
    layers = host.copy_layers(to_host, device, host_idx, device_idx)
    event = engine.submit(stream, CopyJob(layers, lambda: None))
    torch.cuda.current_stream().wait_event(event.finished)  # so the timing events enclose the side stream


def ratios(copy, nbytes: int, ceiling: dict, direction: str, repeats: int) -> dict:
    """A copy's GB/s and its ratio to the ceiling, for one batch and for `STREAMED` in a row."""
    row = {}
    for label, batches in (("single", 1), ("streamed", STREAMED)):
        gbps = nbytes / timed(copy, repeats, batches) / 1e9
        row[f"{label}_GB_s"] = round(gbps, 2)
        row[f"{label}_ceiling_GB_s"] = round(ceiling[direction, batches], 2)
        row[f"{label}_ratio"] = round(gbps / ceiling[direction, batches], 3)
    return row


def kernel_shapes(copy, nbytes: int, ceiling: dict, repeats: int, label: str) -> list[dict]:
    """The load re-timed with the copy kernel on each of `SHAPES` (the module's own constants restored after)."""
    kept, rows = (pcie.COPY_PROGRAMS, pcie.COPY_TILE, pcie.COPY_WARPS), []
    try:
        for shape in SHAPES:
            pcie.COPY_PROGRAMS, pcie.COPY_TILE, pcie.COPY_WARPS = shape
            programs, tile, warps = shape
            row = {"programs": programs, "tile": tile, "warps": warps}
            rows.append(row | ratios(copy, nbytes, ceiling, "load", repeats))
    finally:
        pcie.COPY_PROGRAMS, pcie.COPY_TILE, pcie.COPY_WARPS = kept
    one, many = (min(r[f"{k}_ratio"] for r in rows) for k in ("single", "streamed"))
    top_one, top_many = (max(r[f"{k}_ratio"] for r in rows) for k in ("single", "streamed"))
    print(
        f"{label} on {len(SHAPES)} kernel shapes: one batch {one:.3f}-{top_one:.3f}, in a row {many:.3f}-{top_many:.3f}"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per batch (1024 x 128 KiB = 128 MiB)")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--kernel-shapes", action="store_true", help=f"time the loads on {len(SHAPES)} kernel shapes too"
    )
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    pool_tokens = 4 * args.tokens
    device = DeviceKVPool(pool_tokens, LAYERS, HEADS, HEAD_DIM, "cuda", dtype=torch.bfloat16)
    nbytes = args.tokens * device.bytes_per_token
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    plain = {
        "backup": lambda: dst.copy_(src, non_blocking=True),
        "load": lambda: src.copy_(dst, non_blocking=True),
    }
    ceiling = {
        (direction, batches): nbytes / timed(copy, args.repeats, batches) / 1e9
        for direction, copy in plain.items()
        for batches in (1, STREAMED)
    }
    print("ceiling (GB/s): " + ", ".join(f"{d} x{b} {v:.1f}" for (d, b), v in ceiling.items()))
    engine = CudaCopyEngine(0.0, seed=0, rank=0)
    rows, gen = [], torch.Generator().manual_seed(0)
    for layout in ("layer_first", "page_first"):
        host = HostKVPool(pool_tokens, device, layout)
        for page_size in args.page_sizes:
            dev_idx = scattered_slots(args.tokens, page_size, pool_tokens, gen)
            host_idx = scattered_slots(args.tokens, page_size, pool_tokens, gen)
            uva = "uva-triton" if pcie.triton is not None else "uva-torch"
            dma = pcie.dma_runs(layout, device.bytes_per_token, host_idx, dev_idx) is not None
            for direction, stream, to_host in (("backup", "write", True), ("load", "load", False)):
                mechanism = "dma" if dma and to_host else uva
                copy = partial(engine_copy, engine, stream, to_host, host, device, host_idx, dev_idx)
                row = {"layout": layout, "page_size": page_size, "mechanism": mechanism, "direction": direction}
                row |= ratios(copy, nbytes, ceiling, direction, args.repeats)
                one = f"{row['single_GB_s']:6.2f} GB/s ({row['single_ratio']:.3f})"
                many = f"{row['streamed_GB_s']:6.2f} GB/s ({row['streamed_ratio']:.3f})"
                label = f"{layout:12} page {page_size:3} {mechanism:10} {direction:6}"
                print(f"{label} one batch {one}, {STREAMED} in a row {many}")
                if args.kernel_shapes and not to_host and pcie.triton is not None:
                    row["kernel_shapes"] = kernel_shapes(copy, nbytes, ceiling, args.repeats, label.rstrip())
                rows.append({**row, "bytes": nbytes})
    save("copy_bandwidth", rows)


if __name__ == "__main__":
    main()
