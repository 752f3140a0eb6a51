"""End to end on a GPU: TTFT per round with and without the hierarchical cache, against its bounds, in one run.

A randomly initialised ~0.9B-parameter model (16 layers, hidden 2048, MLP 5632, 32k vocabulary; fp32, or bf16
with `--dtype bfloat16`) serves long multi-turn conversations whose history outgrows the device pool. The same
workload and seed run four ways (`--repeats` times, in turn; each figure the median over the repeats, each ratio
that of the medians: `e2e_bounds.of_medians` says why):

* **L1 only** - later rounds recompute the history that the device pool had to evict;
* **L1 + L2** - they load it back from host memory instead;
* **L2 on device** - L1 + L2 with the host pool's bytes in device memory: the same cache, schedule and copies, but
  the copies stay inside the GPU. This is the floor of the bounds (bench/e2e_bounds.py says why);
* **all on device** - a device pool that holds every conversation whole (no host tier, no eviction, no copies):
  each round runs as one wave, as it would on a larger GPU. Shown beside the others, it is no bound for this pool.

First the four take one unrecorded turn (`--warmup`): a process's first runs grow CUDA's caching allocator (114
cudaMalloc calls on an H200, against 0-2 in a later run), and CUDA documents a device allocation as synchronizing
implicitly: in the first L1 + L2 run of a process, prefills stood 19-25 ms before their first layer, about as
long as their loads, and 1.1-4.8 ms in the next.

Then, on the same GPU, a plain pinned-host -> device `copy_` of the bytes each round's first tokens waited for
(`e2e_bounds.waited_tokens`: a request waits for the loads started up to its own prefill) is timed: median of
`--copy-repeats`, CUDA events. Two bounds follow per round: the **serial** bound, floor + copy (the load done
before the compute), and the **overlap** bound, max(floor, copy) (the load hidden under it). The figure: L1 + L2's
TTFT cut (L1 only - L1 + L2) as a ratio of each bound's cut (L1 only - bound), per round and for the mean of the
rounds from `--later-from` (1.0 = the bound reached). `--timeline-round` prints one round step by step for each
run: its waves, the MB each loaded, the prefill and decode milliseconds. On CPU there is no copy to time: copy and
bounds are reported as not applicable.

    PYTHONPATH=. python -m bench.e2e_ttft --device cuda --latency real --repeats 3
    PYTHONPATH=. python -m bench.e2e_ttft --device cuda --latency real --repeats 3 --dtype bfloat16 \\
        --out bench/results/e2e_ttft_bf16.json
    PYTHONPATH=. python -m bench.e2e_ttft --smoke --out /tmp/e2e_ttft.json   # CPU, seconds: a tiny model

Writes bench/results/e2e_ttft.json (or `--out`): the machine, the config, each run's rounds, the timeline round's
waves, and the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch

from bench import e2e_bounds as bounds
from bench.common import RESULTS, check, machine_info, write_json
from hicache_lab.args import add_run_flags, config_from_args
from hicache_lab.config import RunConfig
from hicache_lab.entrypoints.binders import Binder, RankParts
from hicache_lab.lab.binders import run
from hicache_lab.managers.step_trace import read_trace
from hicache_lab.mem_cache.memory_pool import kv_bytes_per_token, torch_dtype

REALISTIC = {
    "num_layers": 16,
    "hidden_size": 2048,
    "num_heads": 16,
    "mlp_size": 5632,
    "vocab_size": 32000,
    "num_clients": 16,
    "num_rounds": 6,
    "request_length": 1024,
    "sub_question_input_length": 128,
    "output_length": 8,
    "max_total_tokens": 12288,
    "hicache_ratio": 4.0,
    "page_size": 64,
    "host_layout": "page_first",  # SGLang's default; --hicache-mem-layout layer_first loads layer by layer
}
SMOKE = {  # lab/presets.WORKLOAD's world (the default tiny model, 2 layers, pages of 4): it outgrows the device pool
    "num_layers": 2,
    "num_clients": 4,
    "num_rounds": 4,
    "request_length": 32,
    "sub_question_input_length": 16,
    "output_length": 8,
    "max_total_tokens": 256,
    "hicache_ratio": 3.0,
    "page_size": 4,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The run flags (defaults: REALISTIC, or SMOKE with `--smoke`; a flag given still wins) and the bench's own."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--smoke", action="store_true")
    smoke = pre.parse_known_args(argv)[0].smoke
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and workload: a CPU check in seconds")
    add_run_flags(parser, **(SMOKE if smoke else REALISTIC))
    parser.add_argument(
        "--later-from", type=int, default=2, help="rounds count from 0; the means (the headline) cover this one on"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="times the four configurations run, in turn (at least 1); each figure is the median over repeats, "
        "each ratio that of the medians",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unrecorded turns of the four runs first (a process's first runs grow CUDA's caching allocator, whose "
        "cudaMalloc calls synchronize implicitly while copies are in flight)",
    )
    parser.add_argument(
        "--timeline-round", type=int, default=3, help="the round printed step by step for each run (counts from 0)"
    )
    parser.add_argument("--copy-repeats", type=int, default=5, help="timed copies per round (their median counts)")
    parser.add_argument("--out", type=Path, default=RESULTS / "e2e_ttft.json", help="where the JSON result goes")
    args = parser.parse_args(argv)
    if args.enable_hierarchical_cache:
        parser.error("--enable-hierarchical-cache: the bench runs with and without the host tier itself")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: give 0 or more")
    if not 0 <= args.timeline_round < args.num_rounds:
        parser.error(f"--timeline-round {args.timeline_round}: the workload's rounds are 0 to {args.num_rounds - 1}")
    return args


def holds_everything(cfg: RunConfig) -> int:
    """Device pool tokens for every conversation's whole history at once: page-aligned, a page to spare each."""
    w, ps = cfg.workload, cfg.cache.page_size
    return w.num_clients * (-(-w.longest_sequence() // ps) + 1) * ps


def run_configs(base: RunConfig) -> dict[str, RunConfig]:
    """The four runs of the same workload (`e2e_bounds.RUNS`): device pool alone, with the host tier (twice: the
    second, `L2 on device`, has `HOST_POOL_ON_DEVICE` bound into it), and large enough for all."""
    check(base.lab.cache_impl == "lab", "--cache-impl lab: the floor's run (L2 on device) moves the lab's host pool")
    c = base.cache
    everything = max(c.max_total_tokens, holds_everything(base))
    hierarchical = dataclasses.replace(base, cache=dataclasses.replace(c, enable_hierarchical_cache=True))
    return {
        "L1 only": dataclasses.replace(base, cache=dataclasses.replace(c, enable_hierarchical_cache=False)),
        "L1 + L2": hierarchical,
        "L2 on device": hierarchical,
        "all on device": dataclasses.replace(
            base, cache=dataclasses.replace(c, enable_hierarchical_cache=False, max_total_tokens=everything)
        ),
    }


class HostPoolOnDevice(Binder):
    """The floor's run (`L2 on device`): the host pool's bytes move into device memory before the first step, so
    that every copy between the pools, by DMA or by kernel, stays inside the GPU. Nothing else changes. On CPU the
    host pool is in the device's memory already."""

    def bind(self, cfg, parts: RankParts, out_dir):
        controller = parts.cache.controller
        host, device = controller.host_pool, controller.device_pool.device
        if host.kv.device != device:
            host.move_to(device)
        return None


HOST_POOL_ON_DEVICE = HostPoolOnDevice()


def time_copies(sizes: list[int], device: str, repeats: int) -> list[float | None]:
    """Median ms of a plain pinned-host -> device `copy_` of each byte count (CUDA events, after a warm-up copy);
    None for each on CPU, where there is no such copy."""
    if device != "cuda":
        return [None] * len(sizes)
    torch.cuda.empty_cache()
    biggest = max(sizes, default=0)
    src = torch.empty(biggest, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(biggest, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    times = []
    for n in sizes:
        samples = []
        for _ in range(repeats if n else 0):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst[:n].copy_(src[:n], non_blocking=True)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        times.append(statistics.median(samples) if samples else 0.0)
    return times


def measure_run(label: str, cfg: RunConfig, timeline_round: int) -> tuple[list[dict], list[dict]]:
    """One run's rounds (report.round_rows), each with the tokens it loaded and the mean its first tokens waited
    for (`e2e_bounds.waited_tokens`), and its timeline round's waves, both read from the run's step trace."""
    more = (HOST_POOL_ON_DEVICE,) if label == "L2 on device" else ()
    with tempfile.TemporaryDirectory(prefix="e2e_ttft_") as out:
        summary = run(cfg, Path(out), verbose=True, more=more)
        check(summary["completed"], f"{label}: the run failed: {summary['error']}")
        steps = read_trace(Path(out))
        lines = (Path(out) / "requests.jsonl").read_text().splitlines()
    rids: dict[int, set[int]] = {}
    for request in map(json.loads, lines):
        rids.setdefault(request["round"], set()).add(request["rid"])
    rounds = [r | {"loaded_tokens": bounds.loaded_tokens(r)} for r in summary["rounds"]]
    for row in rounds:
        row["waited_tokens"] = bounds.waited_tokens(steps, rids[row["round"]])
    return rounds, bounds.waves(steps, rids.get(timeline_round, set()))


def device_allocations() -> int:
    """cudaMalloc calls so far in this process (0 on CPU)."""
    return torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else 0


def measure(configs: dict[str, RunConfig], repeats: int, timeline_round: int, warmup: int) -> list[dict]:
    """Each repeat's rounds of every run and its timeline round's waves: the runs take turns, `repeats` times (on
    a GPU the same run varies by tens of percent from one repeat to the next), after `warmup` unrecorded turns. A
    failed run, or an `all on device` pool that evicted, stops the bench."""
    for turn in range(warmup):
        for label, cfg in configs.items():
            before = device_allocations()
            print(f"=== {label}: warm-up {turn + 1} of {warmup} ===")
            measure_run(label, cfg, timeline_round)
            print(f"cudaMalloc calls in the warm-up run: {device_allocations() - before}")
    measured = []
    for repeat in range(repeats):
        rounds, waves = {}, {}
        for label, cfg in configs.items():
            pool = cfg.cache.max_total_tokens
            print(f"=== {label} (device pool {pool} tokens), repeat {repeat + 1} of {repeats} ===")
            before = device_allocations()
            rounds[label], waves[label] = measure_run(label, cfg, timeline_round)
            print(f"cudaMalloc calls in the run: {device_allocations() - before}")
        for row in rounds["all on device"]:
            check(
                math.isclose(row["hit_rate"], row["upper_bound_hit_rate"]),
                f"all on device, round {row['round']}: hit rate {row['hit_rate']:.1%} under its bound "
                f"{row['upper_bound_hit_rate']:.1%}: {configs['all on device'].cache.max_total_tokens} tokens evicted",
            )
        measured.append({"rounds": rounds, "timeline": waves})
    return measured


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    base = config_from_args(args)
    m = base.model
    check(base.parallel.world_size == 1, "one GPU: the copy is timed on one device, so drop --tp, --cp and --pp")
    check(not base.workload.trace_file, "conversations only: the all-on-device pool is sized from their lengths")
    configs = run_configs(base)
    measured = measure(configs, args.repeats, args.timeline_round, args.warmup)
    bytes_per_token = kv_bytes_per_token(m.num_layers, m.num_heads, m.head_dim, torch_dtype(m.dtype))
    waited = [[round(r["waited_tokens"] * bytes_per_token) for r in run["rounds"]["L1 + L2"]] for run in measured]
    sizes = sorted({n for per_round in waited for n in per_round})
    copy_ms = dict(zip(sizes, time_copies(sizes, base.device, args.copy_repeats), strict=True))
    repeats = []
    for run_, per_round in zip(measured, waited, strict=True):  # each repeat against its own copies: no mixing
        rows = bounds.round_table(run_["rounds"], [copy_ms[n] for n in per_round], bytes_per_token)
        repeats.append({"rounds": rows, "later_mean": bounds.later_mean(rows, args.later_from)})
    rows = [bounds.of_medians(row) for row in bounds.median_of([r["rounds"] for r in repeats])]
    mean = bounds.of_medians(bounds.median_of([r["later_mean"] for r in repeats]))
    print(f"\nround {args.timeline_round} step by step, repeat 1 (ms):")
    for label, pieces in measured[0]["timeline"].items():
        print(bounds.format_waves(label, pieces, bytes_per_token))
    print(f"\n{m.dtype}, KV {bytes_per_token:,} bytes per token; TTFT per round and its bounds (median of repeats):")
    print(bounds.format_table(rows, mean))
    if len(repeats) > 1:
        for name in ("serial", "overlap"):
            cuts = [r["later_mean"][f"cut_vs_{name}"] for r in repeats]
            print(f"cut / {name} bound of each repeat: " + ", ".join("n/a" if c is None else f"{c:.2f}" for c in cuts))
    gpu = torch.cuda.get_device_name() if base.device == "cuda" else None
    result = {
        "machine": machine_info(gpu=gpu, device=base.device, dtype=m.dtype),
        "preset": SMOKE if args.smoke else REALISTIC,
        "config": dataclasses.asdict(base),
        "kv_bytes_per_token": bytes_per_token,
        "all_on_device_tokens": configs["all on device"].cache.max_total_tokens,
        "runs": [run_["rounds"] for run_ in measured],
        "timeline_round": args.timeline_round,
        "timelines": [run_["timeline"] for run_ in measured],
        "warmup": args.warmup,
        "repeats": repeats,
        "rounds": rows,
        "later_from": args.later_from,
        "later_mean": mean,
        "later_mean_ttft_ms": {label: mean[bounds.TTFT_KEYS[label]] for label in bounds.RUNS},
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
