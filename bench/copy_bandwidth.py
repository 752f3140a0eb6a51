"""Copy bandwidth of the lab's copy engine against the PCIe ceiling, measured in the same run (GPU only).

For a realistic KV shape (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token) and a batch of at
least 64 MB, it times device->host backup and host->device load of whole pages through the lab's own pools
(`HostKVPool.copy_layers`, as the controller issues them) on the `CudaCopyEngine`'s streams, for page sizes 1, 16
and 64 and both host layouts. Pages are scattered (random page order on both sides), as in a pool after
churn. The ceiling is a plain `copy_` of the same byte count between one contiguous device tensor and one
pinned host tensor. Target: backup and load at page size 64 >= 0.9x the ceiling.

    PYTHONPATH=. python -m bench.copy_bandwidth          # on a CUDA machine
"""

from __future__ import annotations

import argparse
import json
import platform
from functools import partial
from pathlib import Path

import torch

from hicache_lab.memory import DeviceKVPool, HostKVPool
from hicache_lab.transfer import CopyJob, CudaCopyEngine

RESULTS = Path(__file__).parent / "results"
LAYERS, HEADS, HEAD_DIM = 32, 8, 128


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn` (which must leave its work on the GPU), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def scattered_slots(tokens: int, page_size: int, pool_tokens: int, generator) -> torch.Tensor:
    pages = torch.randperm(pool_tokens // page_size, generator=generator)[: tokens // page_size]
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


def engine_copy(engine: CudaCopyEngine, stream: str, to_host: bool, host, device, host_idx, device_idx):
    layers = host.copy_layers(to_host, device, host_idx, device_idx)
    event = engine.submit(stream, CopyJob(layers, lambda: None))
    torch.cuda.current_stream().wait_event(event.finished)  # so the timing events enclose the side stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per batch (1024 x 128 KiB = 128 MiB)")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    pool_tokens = 4 * args.tokens
    device = DeviceKVPool(pool_tokens, LAYERS, HEADS, HEAD_DIM, "cuda", dtype=torch.bfloat16)
    nbytes = args.tokens * device.bytes_per_token
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    ceiling = {
        "backup": nbytes / timed(lambda: dst.copy_(src, non_blocking=True), args.repeats) / 1e9,
        "load": nbytes / timed(lambda: src.copy_(dst, non_blocking=True), args.repeats) / 1e9,
    }
    engine = CudaCopyEngine(0.0, seed=0, rank=0)
    rows, gen = [], torch.Generator().manual_seed(0)
    for layout in ("layer_first", "page_first"):
        host = HostKVPool(pool_tokens, device, layout)
        for page_size in args.page_sizes:
            dev_idx = scattered_slots(args.tokens, page_size, pool_tokens, gen)
            host_idx = scattered_slots(args.tokens, page_size, pool_tokens, gen)
            for direction, stream, to_host in (("backup", "write", True), ("load", "load", False)):
                copy = partial(engine_copy, engine, stream, to_host, host, device, host_idx, dev_idx)
                seconds = timed(copy, args.repeats)
                gbps = nbytes / seconds / 1e9
                rows.append(
                    {
                        "layout": layout,
                        "page_size": page_size,
                        "direction": direction,
                        "bytes": nbytes,
                        "GB_s": round(gbps, 2),
                        "ceiling_GB_s": round(ceiling[direction], 2),
                        "ratio": round(gbps / ceiling[direction], 3),
                    }
                )
                print(
                    f"{layout:12} page {page_size:3} {direction:6} {gbps:7.2f} GB/s   "
                    f"ceiling {ceiling[direction]:6.2f}   ratio {gbps / ceiling[direction]:.3f}"
                )
    RESULTS.mkdir(exist_ok=True)
    machine = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "platform": platform.platform()}
    (RESULTS / "copy_bandwidth.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS / 'copy_bandwidth.json'}")


if __name__ == "__main__":
    main()
