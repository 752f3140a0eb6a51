"""Layer-wise load overlap on a GPU: a prefill whose cached prefix comes back from host memory as it runs.

The model has the shape of `bench/e2e_ttft.py` (16 layers, hidden 2048, 16 heads, fp32: 256 KiB of KV per
token). A request has a prefix of P tokens in the host pool (`layer_first`) and S new tokens. Four timings,
each the median wall time from launch to `torch.cuda.synchronize()`:

* compute: the prefill of S tokens with the prefix already on the device;
* copy: the load of P tokens' KV through the lab's copy engine, nothing else running;
* overlapped: the load on the load stream while the prefill runs, layer l's attention waiting only for layer
  l's copy (`wait_layer`, as `TinyModel.forward_layers` does in the lab);
* serial: the load, a full wait, then the prefill.

Perfect overlap gives overlapped = max(compute, copy); no overlap gives compute + copy. Where Triton is
installed, each timing is taken twice: with the lab's copy kernel on `pcie.COPY_PROGRAMS` thread blocks, and
with torch's index kernels (which take the whole GPU).

    PYTHONPATH=. python -m bench.load_overlap          # on a CUDA machine
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import save
from hicache_lab.config import ModelConfig
from hicache_lab.mem_cache import pcie
from hicache_lab.mem_cache.copy_engine import CopyJob, CudaCopyEngine
from hicache_lab.mem_cache.memory_pool import DeviceKVPool
from hicache_lab.mem_cache.memory_pool_host import HostKVPool
from hicache_lab.model import ForwardBatch, TinyModel

MODEL = ModelConfig(num_layers=16, hidden_size=2048, num_heads=16, mlp_size=5632, vocab_size=32000)


def wall(fn, repeats: int) -> float:
    """Median seconds from calling `fn` to the GPU being idle, after one warm-up."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeats // 2]


def measure(model: TinyModel, device: DeviceKVPool, host: HostKVPool, prefix: int, new: int, repeats: int) -> dict:
    engine = CudaCopyEngine(0.0, seed=0, rank=0)
    host_idx, device_idx = torch.arange(prefix), torch.arange(prefix)
    tokens = torch.randint(MODEL.vocab_size, (new,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(prefix, prefix + new, device="cuda")

    def load():
        return engine.submit("load", CopyJob(host.copy_layers(False, device, host_idx, device_idx), lambda: None))

    def prefill(load_event=None):
        batch = ForwardBatch(
            tokens, positions, torch.arange(prefix, prefix + new), [torch.arange(prefix + new)], [new], load_event
        )
        model.forward_layers(model.embed(tokens), batch, device)

    def serial():
        load().synchronize()
        prefill()

    seconds = {
        "compute": wall(prefill, repeats),
        "copy": wall(load, repeats),
        "overlapped": wall(lambda: prefill(load()), repeats),
        "serial": wall(serial, repeats),
    }
    ms = {k: round(v * 1e3, 2) for k, v in seconds.items()}
    best, worst = max(seconds["compute"], seconds["copy"]), seconds["compute"] + seconds["copy"]
    return {
        "prefix_tokens": prefix,
        "new_tokens": new,
        "prefix_GB": round(prefix * device.bytes_per_token / 1e9, 3),
        **{f"{k}_ms": v for k, v in ms.items()},
        "overlapped_over_max": round(seconds["overlapped"] / best, 3),
        "overlapped_over_sum": round(seconds["overlapped"] / worst, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="tokens")
    parser.add_argument("--new-tokens", type=int, default=512, help="tokens the prefill computes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    size = max(args.prefixes) + args.new_tokens
    model = TinyModel(MODEL, "cuda")
    device = DeviceKVPool(size, MODEL.num_layers, MODEL.num_heads, MODEL.head_dim, "cuda")
    host = HostKVPool(max(args.prefixes), device, "layer_first")
    host.kv.normal_()
    kernels = {f"triton, {pcie.COPY_PROGRAMS} blocks": pcie.triton, "torch index": None}
    if pcie.triton is None:
        kernels = {"torch index": None}
    rows = []
    for kernel, triton in kernels.items():
        pcie.triton = triton
        for prefix in args.prefixes:
            row = {"kernel": kernel, **measure(model, device, host, prefix, args.new_tokens, args.repeats)}
            rows.append(row)
            print(
                f"{kernel:18} prefix {prefix:5} ({row['prefix_GB']:.2f} GB): compute {row['compute_ms']:6.2f} ms  "
                f"copy {row['copy_ms']:6.2f}  overlapped {row['overlapped_ms']:6.2f}  serial {row['serial_ms']:6.2f}  "
                f"overlapped/max {row['overlapped_over_max']:.2f}  overlapped/sum {row['overlapped_over_sum']:.2f}"
            )
    save("load_overlap", rows)


if __name__ == "__main__":
    main()
