"""Where a scheduler step's time goes, for the demo's workload: cache, agreement, model, communication between
stages, the scheduler's own work, the lab's bookkeeping, and what none of them claims.

Each run is the demo's (`python -m hicache_lab demo`: the default workload, model and `--latency virtual`,
`--sync fixed`) at each of `--pp-sizes` with each of `--tiers` (L1 only; L1 + L2), launched as the lab always
launches a world (`entrypoints/launch.run_world`: spawned gloo ranks, one process per rank; one rank runs in this
process). `step_timer.TIMER`, given to the run, makes every rank time its steps (bench/step_timer.py, which
says what each category holds): exclusive time of the calls the event loop makes, accumulated over the whole
`StageLoop.run`, so the categories sum to the loop's time exactly and `unattributed` is the loop's own code (and
part of the timers' cost). A step here is one iteration of the loop: requests in, schedule, forward, results
back; ms per step = the loop's time / its iterations. The trace's `ms` (schedule to record, the figure
bench/agreement_cost.py uses) is printed beside it.

How to read it. Stages are not in lockstep: a stage's `comm` (a blocking receive of hidden states, requests or
sampled tokens) and `agreement` (the relay's receive on a later stage; on stage 0, the wait for the previous
step's relay send to be taken) include waiting for the other stage, so at `--pp 2` they measure the pipeline's
imbalance as much as the transfer. `--pp 1` has neither: its shares are the serving work alone. On 2 shared
cores every number moves by several percent between runs; the shares within one run are what to compare.

Run (about 20 s on 2 cores with the defaults; every `python -m hicache_lab run` flag applies, except `--pp`
and `--enable-hierarchical-cache`, replaced by `--pp-sizes` and `--tiers`):

    python -m bench.step_profile
    python -m bench.step_profile --device cuda --pp-sizes 1 2

Writes bench/results/step_profile.json (machine, code state, per run and rank: ms per step and share of each
category and of each timed call) and step_profile.csv (one row per run, rank or mean of ranks, and category).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, check, code_state, machine_info, ratio, usable_cpus, write_csv
from bench.step_timer import CATEGORIES, TIMER
from hicache_lab.args import add_run_flags, config_from_args
from hicache_lab.config import RunConfig
from hicache_lab.entrypoints.report import WorldEnd, read_results
from hicache_lab.lab.binders import run

HOST_TIER = {"L1": False, "L1+L2": True}  # --tiers name -> enable_hierarchical_cache
CSV_FIELDS = ["pp", "tiers", "rank", "category", "ms_per_step", "share", "steps", "loop_s", "wall_s"]
TOP_CALLS = 6  # the costliest timed calls printed per category


def profile_run(cfg: RunConfig) -> dict:
    """One run of `cfg` with its steps timed: the launcher's wall time, each rank's `StepTimer.report()` and
    their mean (`mean_of_ranks`). A run that does not complete is an error: its steps are not the workload's."""
    with tempfile.TemporaryDirectory() as scratch:
        summary = run(cfg, Path(scratch), verbose=False, more=(TIMER,))
        results = read_results(Path(scratch), WorldEnd(summary["run_id"]), cfg.parallel.world_size)
    check(summary["completed"], f"the run did not complete: {summary['error']}")
    ranks = [r["step_time"] for r in results]
    for rank, report in enumerate(ranks):
        summed = sum(report["categories_s"].values())
        check(
            abs(summed - report["total_s"]) <= 1e-9 * max(1.0, report["total_s"]),
            f"rank {rank}: categories sum to {summed} s, the loop took {report['total_s']} s",
        )  # exclusive times partition the loop
    return {"wall_s": summary["elapsed_s"], "ranks": ranks, "mean": mean_of_ranks(ranks)}


def mean_of_ranks(ranks: list[dict]) -> dict:
    """Mean over ranks of ms per step, by category and by timed call (a call a rank never made counts 0)."""
    labels = {label: entry["category"] for r in ranks for label, entry in r["labels"].items()}
    return {
        "steps": min(r["steps"] for r in ranks),
        "ms_per_step": sum(r["ms_per_step"] for r in ranks) / len(ranks),
        "categories_ms_per_step": {
            c: sum(r["categories_ms_per_step"][c] for r in ranks) / len(ranks) for c in CATEGORIES
        },
        "trace_step_ms_mean": sum(r["trace_step_ms_mean"] for r in ranks) / len(ranks),
        "labels": {
            label: {
                "category": category,
                "ms_per_step": sum(r["labels"].get(label, {"ms_per_step": 0.0})["ms_per_step"] for r in ranks)
                / len(ranks),
            }
            for label, category in labels.items()
        },
    }


def shares(entry: dict) -> dict[str, float]:
    """Each category's share of the step."""
    return {c: ratio(ms, entry["ms_per_step"]) for c, ms in entry["categories_ms_per_step"].items()}


def print_run(pp: int, tiers: str, result: dict) -> None:
    """The run's table (ms per step and share, per rank and their mean) and its costliest calls."""
    mean = result["mean"]
    loop_s = ", ".join(f"{r['total_s']:.2f}" for r in result["ranks"])
    print(f"\n--pp {pp}, {tiers}: {mean['steps']} steps; wall {result['wall_s']:.1f} s (the loop: {loop_s} s per rank)")
    print(f"{'rank':>5} {'step ms':>8} {'trace ms':>8} " + " ".join(f"{c:>15}" for c in CATEGORIES))
    for label, entry in [*enumerate(result["ranks"]), ("mean", mean)]:
        cells = " ".join(
            f"{entry['categories_ms_per_step'][c]:8.3f} {share:6.1%}" for c, share in shares(entry).items()
        )
        print(f"{label:>5} {entry['ms_per_step']:8.3f} {entry['trace_step_ms_mean']:8.3f} {cells}")
    for category in CATEGORIES[:-1]:
        calls = sorted(
            ((label, e["ms_per_step"]) for label, e in mean["labels"].items() if e["category"] == category),
            key=lambda kv: -kv[1],
        )
        words = ", ".join(f"{label} {ms:.3f}" for label, ms in calls[:TOP_CALLS] if ms >= 0.0005)
        print(f"  {category:<12} (ms per step, mean of ranks): {words or '-'}")


def csv_rows(pp: int, tiers: str, result: dict) -> list[dict]:
    rows = []
    for label, entry in [*enumerate(result["ranks"]), ("mean", result["mean"])]:
        for category, share in shares(entry).items():
            rows.append(
                {
                    "pp": pp,
                    "tiers": tiers,
                    "rank": label,
                    "category": category,
                    "ms_per_step": entry["categories_ms_per_step"][category],
                    "share": share,
                    "steps": entry["steps"],
                    "loop_s": entry["total_s"] if label != "mean" else "",
                    "wall_s": result["wall_s"],
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser)
    parser.add_argument("--pp-sizes", type=int, nargs="+", default=[1, 2], help="pipeline stages of each run")
    parser.add_argument(
        "--tiers", nargs="+", default=list(HOST_TIER), choices=HOST_TIER, help="cache tiers of each run"
    )
    parser.add_argument("--results-dir", default=str(RESULTS), help="where the CSV and JSON go")
    args = parser.parse_args()
    if args.pp != 1 or args.enable_hierarchical_cache:
        parser.error("--pp and --enable-hierarchical-cache are set per run here: give --pp-sizes and --tiers instead")
    base = config_from_args(args)
    started = time.perf_counter()
    report = {
        "machine": machine_info(
            processor=platform.processor() or platform.machine(),
            cpu_affinity=usable_cpus(),
            load_average_1_5_15_min=os.getloadavg(),
        ),
        "code": code_state(),
        "args": {k: v for k, v in vars(args).items() if k != "results_dir"},
        "runs": [],
    }
    rows = []
    for pp in args.pp_sizes:
        for tiers in args.tiers:
            cfg = dataclasses.replace(
                base,
                cache=dataclasses.replace(base.cache, enable_hierarchical_cache=HOST_TIER[tiers]),
                parallel=dataclasses.replace(base.parallel, pp=pp),
            )
            result = profile_run(cfg)
            print_run(pp, tiers, result)
            rows += csv_rows(pp, tiers, result)
            report["runs"].append({"pp": pp, "tiers": tiers, **result})
    report["elapsed_s"] = time.perf_counter() - started
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "step_profile.csv", rows, CSV_FIELDS)
    (out / "step_profile.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {out}/step_profile.csv and step_profile.json ({report['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
