"""What the cache's cross-rank agreement costs: whole scheduler steps by sync mode, then the primitives alone.

All on CPU with gloo, every number a ratio of two things measured in the same run (nothing here passes or
fails). Three parts:

1. Scheduler step time by sync mode. The default demo model and workload (`RunConfig()`, L1 + L2, `--pp 2`,
   `--latency virtual`) run once per mode (`--sync off`, `legacy`, `fixed`); each rank's step times come from
   its trace (`ms` = schedule + forward of one step, hicache_lab/managers/scheduler_pp.py). `off` and `legacy`
   diverge and may crash, so every mode is averaged over the same steps: per rank, the first N steps where N is
   the shortest run's step count (a crashed run's last, aborted step dropped). Virtual latency makes the three
   runs schedule identical batches until the first divergence; the mean over those identical-batch steps is
   printed too. Repeated `--repeats` times (mode order rotated each repeat); the tables show the median of the
   per-run means and the ratios fixed/legacy and fixed/off.
2. The relay vs a barrier vs an all-reduce over the PP group, PP = 2, 3, 4 (`--pp-sizes`), in worlds spawned
   here (gloo, TCPStore on 127.0.0.1). The relay is `CacheSync._pp_sync` verbatim: blocking `dist.recv` from
   the previous stage, `dist.isend` of a clone to the next, handles kept and waited once at the end (the
   once-a-round drain, timed apart). Each op runs `--calls` times after `--warmup` calls, in `--blocks`
   interleaved blocks; the tables give the median block's microseconds per call on rank 0 (first stage) and
   on the last rank.
3. One combined [write, load] agreement vs two, over an attention group of 2 ranks (ranks 0 and 1 of the same
   worlds; the other ranks wait): one `dist.all_reduce(MIN)` of a 2-element int64 tensor vs two of 1-element
   tensors, each including building the tensor and reading it back, as `CacheSync.agree_ack_counts` does.
   SGLang batched its two (PR #33473) and measured +37% input throughput.

Run (about 3 minutes on 2 cores with the defaults; every `python -m hicache_lab run` flag applies to part 1,
except `--sync`, replaced by `--sync-modes`):

    python -m bench.agreement_cost
    python -m bench.agreement_cost --num-clients 8 --num-rounds 4 --repeats 5 --pp-sizes 2 4 --calls 5000

How to read it. Part 1: at `--tp 1` the attention-TP group has one rank, so `legacy` does no collective at all
(it only lacks the relay): `legacy` and `off` run the same scheduler path, and fixed/legacy is the whole price
of the relay (one per step: write, load and backup counts travel together). Step times include waiting for the
previous stage, so the relay's cost shows on the later stage. Part 2: in a tight loop the first stage never
waits (isend only; its relay cost is the isend) while the last stage pays the recv; the pipeline pays the last
stage's number. A barrier or an all-reduce makes every stage wait for the slowest, which is also why neither
may appear in the scheduler loop (stages are not in lockstep: hicache_lab/distributed/cache_sync.py). Part 3:
the ratio separate/combined is what batching the two agreements saves per step. 2 cores shared by up to 4 gloo
processes is a noisy, oversubscribed machine: compare ratios, not absolute microseconds, and read the per-repeat
rows in the CSV for the spread.

Writes bench/results/agreement_cost.csv (one row per measurement: a run's mean step time on one rank, or one
block of calls on one rank) and bench/results/agreement_cost.json (machine, arguments, medians and ratios).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from bench.agreement_primitives import measure_primitives, report_primitives
from bench.common import RESULTS, machine_info, ratio, usable_cpus, write_csv
from hicache_lab.config import SYNC_MODES, RunConfig
from hicache_lab.entrypoints.args import add_run_flags, config_from_args
from hicache_lab.entrypoints.launch import run
from hicache_lab.managers.step_trace import read_trace

BATCH_FIELDS = ("kind", "requests", "extend_tokens", "prefix_tokens")  # equal in two runs: same batch
CSV_FIELDS = ["part", "pp", "variant", "rank", "repeat", "metric", "value", "unit", "n", "note"]


# -- part 1: scheduler step time by sync mode -------------------------------------------------------------


def _run_mode(base: RunConfig, sync: str) -> tuple[dict, list[dict]]:
    cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, sync=sync))
    with tempfile.TemporaryDirectory() as scratch:
        summary = run(cfg, Path(scratch), verbose=False)
        rows = read_trace(Path(scratch))
    return summary, rows


def _steps_by_rank(rows: list[dict]) -> dict[int, list[dict]]:
    by_rank: dict[int, list[dict]] = {}
    for row in sorted(rows, key=lambda r: (r["rank"], r["step"])):
        by_rank.setdefault(row["rank"], []).append(row)
    return by_rank


def _first_batch_difference(runs: list[list[dict]]) -> int:
    """First step index at which the runs scheduled different batches (len of the shortest if never)."""
    n = min(len(r) for r in runs)
    for i in range(n):
        if len({tuple(str(r[i][f]) for f in BATCH_FIELDS) for r in runs}) > 1:
            return i
    return n


def measure_step_times(base: RunConfig, modes: list[str], repeats: int) -> tuple[list[dict], dict]:
    """CSV rows (one per run, rank and window) and {rank or 'all': {window: {mode: [mean per repeat]}}}."""
    rows, means = [], {}
    for repeat in range(repeats):
        order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]
        results = {}
        for sync in order:
            started = time.perf_counter()
            summary, trace = _run_mode(base, sync)
            results[sync] = (summary, _steps_by_rank(trace))
            status = "crashed" if summary["crashed"] else "completed"
            div = summary["first_divergence"]
            status += f", ranks diverged at step {div['step']} on {div['quantity']}" if div else ", ranks agree"
            steps = {rank: len(s) for rank, s in results[sync][1].items()}
            elapsed = time.perf_counter() - started
            print(f"  repeat {repeat}, --sync {sync:6}: {status}; steps per rank {steps} ({elapsed:.1f} s)")
        world = base.parallel.world_size
        window_means: dict[str, dict[str, list[float]]] = {"common": {}, "same_batches": {}}
        for rank in range(world):
            usable = {}
            for sync in modes:
                summary, by_rank = results[sync]
                steps = by_rank.get(rank, [])
                usable[sync] = steps[:-1] if summary["crashed"] and steps else steps
            n_common = min(len(s) for s in usable.values())
            n_same = _first_batch_difference([usable[s] for s in modes])
            for window, n in (("common", n_common), ("same_batches", n_same)):
                for sync in modes:
                    summary = results[sync][0]
                    mean_ms = statistics.fmean(r["ms"] for r in usable[sync][:n]) if n else float("nan")
                    means.setdefault(rank, {}).setdefault(window, {}).setdefault(sync, []).append(mean_ms)
                    window_means[window].setdefault(sync, []).append(mean_ms)
                    rows.append(
                        {
                            "part": "step_time",
                            "pp": base.parallel.pp,
                            "variant": f"sync={sync}",
                            "rank": rank,
                            "repeat": repeat,
                            "metric": f"mean_step_ms_{window}",
                            "value": mean_ms,
                            "unit": "ms",
                            "n": n,
                            "note": f"steps in run {len(usable[sync])}; crashed={summary['crashed']}; "
                            f"first_divergence_step={(summary['first_divergence'] or {}).get('step')}",
                        }
                    )
        for window, per_mode in window_means.items():  # the mean over ranks of this repeat
            for sync, values in per_mode.items():
                means.setdefault("all", {}).setdefault(window, {}).setdefault(sync, []).append(statistics.fmean(values))
    return rows, means


def report_step_times(means: dict, rows: list[dict], modes: list[str], world: int) -> dict:
    summary = {}
    print("\nmedian over repeats of the mean scheduler step time (ms); ratios of those medians")
    ratio_heads = [f"fixed/{m}" for m in modes if m != "fixed"] if "fixed" in modes else []
    header = f"{'window':13} {'rank':>5} {'steps':>6} " + " ".join(f"{m:>8}" for m in modes)
    print(header + " " + " ".join(f"{h:>13}" for h in ratio_heads))
    for window in ("common", "same_batches"):
        for rank in [*range(world), "all"]:
            med = {m: statistics.median(means[rank][window][m]) for m in modes}
            steps = [r["n"] for r in rows if r["metric"] == f"mean_step_ms_{window}" and rank in (r["rank"], "all")]
            n = f"{min(steps)}" if steps else "-"
            ratios = {h: ratio(med["fixed"], med[h.split("/")[1]]) for h in ratio_heads}
            label = "last" if rank == world - 1 else rank
            cells = " ".join(f"{med[m]:8.3f}" for m in modes)
            print(
                f"{window:13} {label if rank != 'all' else 'mean':>5} {n:>6} {cells} "
                + " ".join(f"{r:13.3f}" for r in ratios.values())
            )
            summary.setdefault(window, {})[str(rank)] = {"median_mean_step_ms": med, "ratios": ratios}
    print("per-repeat ratios (window common; the spread between repeats bounds what the medians can resolve):")
    for rank in [*range(world), "all"]:
        label = "mean" if rank == "all" else ("last" if rank == world - 1 else str(rank))
        per_repeat = means[rank]["common"]
        spread = {
            h: [ratio(f, o) for f, o in zip(per_repeat["fixed"], per_repeat[h.split("/")[1]], strict=True)]
            for h in ratio_heads
        }
        print(f"  rank {label:>4}: " + "; ".join(f"{h} " + ", ".join(f"{r:.3f}" for r in v) for h, v in spread.items()))
        summary["common"][str(rank)]["per_repeat_ratios"] = spread
    print(
        "  common: per rank, the first N steps all runs completed (N = the shortest run's count, a crashed run's "
        "aborted last step dropped);\n  same_batches: the first steps in which all runs scheduled identical "
        "batches (before the first divergence). 'mean': the mean over ranks. steps: the smallest N over repeats."
    )
    return summary


# -- main ---------------------------------------------------------------------------------------------------


def machine_record() -> dict:
    return machine_info(
        processor=platform.processor() or platform.machine(),
        cpu_affinity=usable_cpus(),
        gloo_available=dist.is_gloo_available(),
        load_average_1_5_15_min=os.getloadavg(),  # other work on the machine skews every number here
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, pp=2, latency="virtual")
    parser.set_defaults(enable_hierarchical_cache=True)  # the host tier is what needs agreeing on
    parser.add_argument("--sync-modes", nargs="+", default=list(SYNC_MODES), choices=SYNC_MODES, help="part 1 modes")
    parser.add_argument("--repeats", type=int, default=3, help="part 1: runs per sync mode (median reported)")
    parser.add_argument("--pp-sizes", type=int, nargs="+", default=[2, 3, 4], help="parts 2-3: world sizes")
    parser.add_argument("--calls", type=int, default=2000, help="parts 2-3: timed calls per op and block")
    parser.add_argument("--warmup", type=int, default=200, help="parts 2-3: untimed calls before each block")
    parser.add_argument("--blocks", type=int, default=3, help="parts 2-3: interleaved blocks per op (median)")
    parser.add_argument("--skip-step-time", action="store_true", help="skip part 1")
    parser.add_argument("--skip-primitives", action="store_true", help="skip parts 2 and 3")
    parser.add_argument("--results-dir", default=str(RESULTS), help="where the CSV and JSON go")
    args = parser.parse_args()
    base = config_from_args(args)
    modes = list(dict.fromkeys(args.sync_modes))
    kept = {k: v for k, v in vars(args).items() if k != "results_dir"}  # where the file is; no machine paths
    rows, report = [], {"machine": machine_record(), "args": kept}
    started = time.perf_counter()
    if not args.skip_step_time:
        w, p, c = base.workload, base.parallel, base.cache
        workload = (
            f"{w.num_clients} clients x {w.num_rounds} rounds, request {w.request_length}, sub-question "
            f"{w.sub_question_input_length}, output {w.output_length}, max running {w.max_running_requests}, "
            f"seed {w.seed}; model {base.model.num_layers} layers x {base.model.hidden_size}; "
            f"--pp {p.pp} --tp {p.tp} --cp {p.cp}, hierarchical cache {c.enable_hierarchical_cache}, "
            f"--latency {c.latency}"
        )
        print(f"part 1: scheduler step time by sync mode ({', '.join(modes)}), {args.repeats} repeats\n  {workload}")
        step_rows, means = measure_step_times(base, modes, args.repeats)
        rows += step_rows
        report["step_time"] = {"workload": workload, **report_step_times(means, step_rows, modes, p.world_size)}
    if not args.skip_primitives:
        print(f"\nparts 2-3: agreement primitives, worlds of {args.pp_sizes} ranks, {args.calls} calls x {args.blocks}")
        world_args = {
            "calls": args.calls,
            "warmup": args.warmup,
            "blocks": args.blocks,
            "timeout_s": base.parallel.collective_timeout_s,
        }
        prim_rows, medians = measure_primitives(args.pp_sizes, world_args)
        rows += prim_rows
        report["primitives"] = report_primitives(medians)
    report["elapsed_s"] = time.perf_counter() - started
    report["load_average_at_end"] = os.getloadavg()
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "agreement_cost.csv", rows, CSV_FIELDS)
    (out / "agreement_cost.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\nwrote {out}/agreement_cost.csv and agreement_cost.json ({report['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
