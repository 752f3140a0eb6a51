"""End to end on a GPU: TTFT per round with and without the hierarchical cache, against its bounds, in one run.

A randomly initialised ~0.9B-parameter model (16 layers, hidden 2048, MLP 5632, 32k vocabulary; fp32, or bf16
with `--dtype bfloat16`) serves long multi-turn conversations whose history outgrows the device pool. The same
workload and seed run three ways (`--repeats` times, in turn; ratios within a repeat, then the median):

* **L1 only** - later rounds recompute the history that the device pool had to evict;
* **L1 + L2** - they load it back from host memory instead;
* **all on device** - a device pool that holds every conversation whole (no host tier, no eviction, no copies):
  its TTFT is the floor.

Then, on the same GPU, a plain pinned-host -> device `copy_` of the bytes each round of L1 + L2 loaded (the
tokens its requests found on the host, or that a prefetch brought there from storage, times the KV bytes per
token of the model's shape and dtype) is timed: median of `--copy-repeats`, CUDA events. Two bounds follow per
round, as issue 17 defines them: the **serial** bound, floor + copy (the load done before the compute), and the
**overlap** bound, max(floor, copy) (the load hidden under it). The figure: L1 + L2's TTFT cut (L1 only - L1 + L2)
as a ratio of each bound's cut (L1 only - bound), per round and for the mean of the rounds from `--later-from`
(1.0 = the bound reached). On CPU there is no copy to time: copy and bounds are reported as not applicable.

    PYTHONPATH=. python -m bench.e2e_ttft --device cuda --latency real --repeats 3
    PYTHONPATH=. python -m bench.e2e_ttft --device cuda --latency real --repeats 3 --dtype bfloat16 \\
        --out bench/results/e2e_ttft_bf16.json
    PYTHONPATH=. python -m bench.e2e_ttft --smoke --out /tmp/e2e_ttft.json   # CPU, seconds: a tiny model

Writes bench/results/e2e_ttft.json (or `--out`): the machine, the config, each run's rounds, and the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path

import torch

from bench.common import RESULTS, check, machine_info, ratio
from hicache_lab.config import RunConfig
from hicache_lab.entrypoints.args import add_run_flags, config_from_args
from hicache_lab.lab.binders import run
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
RUNS = ("L1 only", "L1 + L2", "all on device")
TTFT_KEYS = {"L1 only": "l1_only_ttft_ms", "L1 + L2": "l1_l2_ttft_ms", "all on device": "all_on_device_ttft_ms"}


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
        help="times the three configurations run, in turn (at least 1); each figure is the median over repeats, "
        "every ratio computed within one repeat",
    )
    parser.add_argument("--copy-repeats", type=int, default=5, help="timed copies per round (their median counts)")
    parser.add_argument("--out", type=Path, default=RESULTS / "e2e_ttft.json", help="where the JSON result goes")
    args = parser.parse_args(argv)
    if args.enable_hierarchical_cache:
        parser.error("--enable-hierarchical-cache: the bench runs with and without the host tier itself")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give at least 1")
    return args


def holds_everything(cfg: RunConfig) -> int:
    """Device pool tokens for every conversation's whole history at once: page-aligned, a page to spare each."""
    w, ps = cfg.workload, cfg.cache.page_size
    return w.num_clients * (-(-w.longest_sequence() // ps) + 1) * ps


def run_configs(base: RunConfig) -> dict[str, RunConfig]:
    """The three runs of the same workload: device pool alone, with the host tier, and large enough for all."""
    c = base.cache
    everything = max(c.max_total_tokens, holds_everything(base))
    return {
        "L1 only": dataclasses.replace(base, cache=dataclasses.replace(c, enable_hierarchical_cache=False)),
        "L1 + L2": dataclasses.replace(base, cache=dataclasses.replace(c, enable_hierarchical_cache=True)),
        "all on device": dataclasses.replace(
            base, cache=dataclasses.replace(c, enable_hierarchical_cache=False, max_total_tokens=everything)
        ),
    }


def loaded_tokens(row: dict) -> int:
    """Tokens a round's requests had copied host -> device: those found on the host and those a prefetch brought
    to the host from storage (report.round_rows; a retracted request's second load is not counted again)."""
    return row["cached_host"] + row["cached_storage"]


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


def bound_ms(floor: float, copy: float | None) -> dict:
    """A round's bounds: serial, the copy before the compute (floor + copy); overlap, the copy hidden under it
    (max of the two). None where the copy was not timed."""
    if copy is None:
        return {"serial_bound_ms": None, "overlap_bound_ms": None}
    return {"serial_bound_ms": floor + copy, "overlap_bound_ms": max(floor, copy)}


def cut_ratios(row: dict) -> dict:
    """L1 + L2's TTFT cut (L1 only - L1 + L2) as a ratio of each bound's cut (L1 only - bound): 1.0 = the bound
    reached. None where there is no bound, or it cuts nothing."""
    l1, got, ratios = row["l1_only_ttft_ms"], row["l1_l2_ttft_ms"], {}
    for name in ("serial", "overlap"):
        bound = row[f"{name}_bound_ms"]
        cut = None if bound is None else ratio(l1 - got, l1 - bound)
        ratios[f"cut_vs_{name}"] = cut if cut is not None and math.isfinite(cut) else None
    return ratios


def round_table(rounds: dict[str, list[dict]], copy_ms: list[float | None], bytes_per_token: int) -> list[dict]:
    """One row per round: the three TTFTs, what L1 + L2 loaded and its copy time, the bounds and the ratios."""
    rows = []
    for i, l12 in enumerate(rounds["L1 + L2"]):
        row = {"round": l12["round"], **{TTFT_KEYS[k]: rounds[k][i]["ttft_ms"] for k in RUNS}}
        tokens = loaded_tokens(l12)
        row |= {"loaded_tokens": tokens, "loaded_bytes": tokens * bytes_per_token, "copy_ms": copy_ms[i]}
        row |= bound_ms(row["all_on_device_ttft_ms"], copy_ms[i])
        rows.append(row | cut_ratios(row))
    return rows


def later_mean(rows: list[dict], later_from: int) -> dict:
    """The rounds from `later_from` on: mean TTFTs, copy time and bounds (a round's bound holds for that round,
    so the mean of the bounds bounds the mean TTFT), and the ratios of those means."""
    later = [r for r in rows if r["round"] >= later_from]
    check(bool(later), f"--later-from {later_from}: no round that late (the workload has {len(rows)})")
    mean = {"rounds": [r["round"] for r in later]}
    for key in (*TTFT_KEYS.values(), "loaded_tokens", "loaded_bytes", "copy_ms", "serial_bound_ms", "overlap_bound_ms"):
        values = [r[key] for r in later]
        mean[key] = None if None in values else statistics.fmean(values)
    return mean | cut_ratios(mean)


def _cell(value: float | None, decimals: int) -> str:
    return f"{'n/a':>8}" if value is None else f"{value:>8.{decimals}f}"


def format_table(rows: list[dict], mean: dict) -> str:
    """The per-round table and the mean of the later rounds, in ms (ratios: 1.0 = the bound reached)."""
    head = (
        f"{'round':>6} {'L1 only':>8} {'L1+L2':>8} {'device':>8} {'loaded':>9} {'copy':>8} {'serial':>8} "
        f"{'overlap':>8} {'cut/ser':>8} {'cut/ovl':>8}"
    )
    lines = [head, f"{'':>6} {'ms':>8} {'ms':>8} {'ms':>8} {'MB':>9} {'ms':>8} {'ms':>8} {'ms':>8}"]
    labelled = [(str(r["round"]), r) for r in rows] + [(f">={mean['rounds'][0]}", mean)]
    for label, r in labelled:
        ratios = r["loaded_tokens"] > 0  # a round that loads nothing cuts nothing: its ratios are noise over noise
        lines.append(
            f"{label:>6} {r['l1_only_ttft_ms']:>8.1f} {r['l1_l2_ttft_ms']:>8.1f} {r['all_on_device_ttft_ms']:>8.1f} "
            f"{r['loaded_bytes'] / 1e6:>9.1f} {_cell(r['copy_ms'], 1)} {_cell(r['serial_bound_ms'], 1)} "
            f"{_cell(r['overlap_bound_ms'], 1)} {_cell(r['cut_vs_serial'] if ratios else None, 2)} "
            f"{_cell(r['cut_vs_overlap'] if ratios else None, 2)}"
        )
    return "\n".join(lines)


def measure(configs: dict[str, RunConfig], repeats: int) -> list[dict[str, list[dict]]]:
    """Each repeat's rounds of every run (report.round_rows): the runs take turns, `repeats` times (on a GPU
    the same run varies by tens of percent from one repeat to the next). A failed run, or a floor that missed,
    stops the bench."""
    measured = []
    for repeat in range(repeats):
        rounds = {}
        for label, cfg in configs.items():
            pool = cfg.cache.max_total_tokens
            print(f"=== {label} (device pool {pool} tokens), repeat {repeat + 1} of {repeats} ===")
            summary = run(cfg, verbose=True)
            check(summary["completed"], f"{label}: the run failed: {summary['error']}")
            rounds[label] = summary["rounds"]
        for row in rounds["all on device"]:  # the floor holds everything, or it is no floor
            check(
                math.isclose(row["hit_rate"], row["upper_bound_hit_rate"]),
                f"all on device, round {row['round']}: hit rate {row['hit_rate']:.1%} under its bound "
                f"{row['upper_bound_hit_rate']:.1%}: {configs['all on device'].cache.max_total_tokens} tokens evicted",
            )
        measured.append(rounds)
    return measured


def median_of(tables: list):
    """The median, field by field, of equally shaped rows (or row lists) from each repeat; None stays None."""
    if isinstance(tables[0], list):
        return [median_of([t[i] for t in tables]) for i in range(len(tables[0]))]
    merged = {}
    for field, first in tables[0].items():
        values = [t[field] for t in tables]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        merged[field] = statistics.median(values) if numeric else first
    return merged


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    base = config_from_args(args)
    m, p = base.model, base.parallel
    check(p.world_size == 1, "one GPU: the copy is timed on one device, so drop --tp, --cp and --pp")
    check(not base.workload.trace_file, "conversations only: the all-on-device pool is sized from their lengths")
    configs = run_configs(base)
    measured = measure(configs, args.repeats)
    bytes_per_token = kv_bytes_per_token(m.num_layers, m.num_heads, m.head_dim, torch_dtype(m.dtype))
    sizes = sorted({loaded_tokens(r) * bytes_per_token for rounds in measured for r in rounds["L1 + L2"]})
    copy_ms = dict(zip(sizes, time_copies(sizes, p.device, args.copy_repeats), strict=True))
    repeats = []
    for rounds in measured:  # each repeat against the copy of what it loaded: ratios never mix repeats
        times = [copy_ms[loaded_tokens(r) * bytes_per_token] for r in rounds["L1 + L2"]]
        rows = round_table(rounds, times, bytes_per_token)
        repeats.append({"rounds": rows, "later_mean": later_mean(rows, args.later_from)})
    rows, mean = median_of([r["rounds"] for r in repeats]), median_of([r["later_mean"] for r in repeats])
    print(f"\n{m.dtype}, KV {bytes_per_token:,} bytes per token; TTFT per round and its bounds (median of repeats):")
    print(format_table(rows, mean))
    if len(repeats) > 1:
        cuts = [r["later_mean"]["cut_vs_serial"] for r in repeats]
        print("cut / serial bound of each repeat: " + ", ".join("n/a" if c is None else f"{c:.2f}" for c in cuts))
    gpu = torch.cuda.get_device_name() if p.device == "cuda" else None
    result = {
        "machine": machine_info(gpu=gpu, device=p.device, dtype=m.dtype),
        "preset": SMOKE if args.smoke else REALISTIC,
        "config": dataclasses.asdict(base),
        "kv_bytes_per_token": bytes_per_token,
        "all_on_device_tokens": configs["all on device"].cache.max_total_tokens,
        "runs": measured,
        "repeats": repeats,
        "rounds": rows,
        "later_from": args.later_from,
        "later_mean": mean,
        "later_mean_ttft_ms": {label: mean[TTFT_KEYS[label]] for label in RUNS},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
