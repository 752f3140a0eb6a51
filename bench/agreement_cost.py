"""What the cache's cross-stage agreement costs: whole scheduler steps by sync mode, then a modelled pipeline.

All on CPU with gloo; nothing here passes or fails. Every figure is a median over repeats with its min-max,
per stage. Three parts:

1. Scheduler step time by sync mode. The default demo model and workload (`RunConfig()`, L1 + L2, `--pp 2`,
   `--latency virtual`) run once per mode (`--sync off`, `legacy`, `fixed`); each rank's step times come from
   its trace (`ms` = schedule + forward of one step, hicache_lab/managers/scheduler_pp.py). `off` and `legacy`
   diverge and may crash, so every mode is averaged over the same steps: per rank, the first N steps where N is
   the shortest run's step count (a crashed run's last, aborted step dropped). The mean over the steps in which
   the three runs scheduled identical batches is printed too. Repeated `--repeats` times (mode order rotated
   each repeat): per rank and mode, the median and min-max of the per-run means, and the ratios fixed/legacy
   and fixed/off per repeat. At `--tp 1` `legacy` and `off` run the same code (no collective at all), so their
   difference is a direct reading of the noise.
2. The agreement inside a modelled pipeline, PP = 2, 3, 4 (`--pp-sizes`), in worlds spawned here (gloo,
   TCPStore on 127.0.0.1). Each stage runs `--warmup` + `--steps` steps shaped like the lab's event loop:
   agree; receive the previous stage's activations (blocking); forward, a sleep of `--stage-ms` (a GPU
   stage's CPU waits on its device); send the activations on (async); the last stage sends the tokens back
   to stage 0, which takes step j's at the end of step j + PP - 1. The agreement is one of: `none`; `relay`
   (`CacheSync._pp_sync` verbatim: stage 0 waits for its previous relay send (the bounded drain) and
   isends, later stages wait in a blocking recv and pass it on); `barrier` or `all_reduce` (MIN) over the PP
   group, the symmetric collectives. Two scenarios: `equal` stages, and `slow_last` (the last stage's forward
   `--slow-factor` times longer). Per stage and `--blocks` block (variants interleaved in each block): the
   wall time per step, the time per step in the agreement, and in the activations' receive. The pipeline's
   step time is the last stage's; the agreement's own cost is a variant's step time minus `none`'s, block by
   block.
3. One combined [write, load] agreement vs two, over an attention group of 2 ranks (ranks 0 and 1 of the same
   worlds; the other ranks wait): one `dist.all_reduce(MIN)` of a 2-element int64 tensor vs two of 1-element
   tensors, each including building the tensor and reading it back, as `CacheSync.agree_ack_counts` does;
   `--calls` calls after `--warmup`, per block. SGLang batched its two (PR #33473) and measured +37% input
   throughput.

Run (about 5 minutes on 2 cores with the defaults; every `python -m hicache_lab run` flag applies to part 1,
except `--sync`, replaced by `--sync-modes`; `--plugin MODULE:OBJECT` adds a mode, `plugin`: `fixed` with it):

    python -m bench.agreement_cost
    python -m bench.agreement_cost --skip-step-time --pp-sizes 2 3 --blocks 3     # parts 2-3 only, ~40 s

How to read it. Part 1: at `--tp 1` the attention-TP group has one rank, so `legacy` does no collective (it
only lacks the relay) and fixed/legacy is the whole price of the relay (one per step: write, load and backup
counts travel together); step times include waiting for the other stage, so the price shows wherever the wait
lands. Part 2: a stage's time in the relay (stage 0's drain, a later stage's recv) is waiting, for another
stage or for the message (gloo moves it only once the recv is posted): not the relay's cost, which is the
pipeline's step time over `none` (notebook 05 draws where the waits fall, --timeline). A barrier or an
all-reduce at the same point of every step does not deadlock (every stage calls it once a step), but it holds
every stage there until the slowest arrives: stages in lockstep, and the later stages then wait again for the
activations, so the stages' forwards no longer overlap. (Such a collective deadlocks where stages make
different numbers of calls, e.g. only PP rank 0 calls it.) Part 3: the ratio separate/combined is what
batching the two agreements saves per step. 2 cores shared by up to 4 gloo processes is a noisy, oversubscribed machine:
compare within a run, and read the min-max before a difference.

Writes bench/results/agreement_cost.csv (one row per measurement: a run's mean step time on one rank, or one
block on one stage) and bench/results/agreement_cost.json (machine, code, arguments, medians, min-max, ratios),
then prints the CSV's tables as notebook 05 shows them (bench/agreement_tables.py). `--timeline`: also
agreement_timeline.csv, part 2's every stage and timed step with its marks (notebook 05's Gantt chart).
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

import pandas as pd
import torch.distributed as dist

from bench.agreement_primitives import measure_primitives
from bench.agreement_report import report_primitives, report_step_times
from bench.agreement_tables import HEADER, print_tables
from bench.common import RESULTS, code_state, machine_info, usable_cpus, write_csv
from hicache_lab.args import add_run_flags, config_from_args
from hicache_lab.config import RunConfig
from hicache_lab.lab.binders import run
from hicache_lab.managers.step_trace import read_trace
from hicache_lab.parallel_config import SYNC_MODES

BATCH_FIELDS = ("kind", "requests", "extend_tokens", "prefix_tokens")  # equal in two runs: same batch
CSV_FIELDS = ["part", "pp", "scenario", "variant", "rank", "repeat", "metric", "value", "unit", "n", "note"]


# -- part 1: scheduler step time by sync mode -------------------------------------------------------------


def _run_mode(base: RunConfig, sync: str) -> tuple[dict, list[dict]]:
    """One run of `sync` (a sync mode, without the plug-ins; or `plugin`: `fixed` with `--plugin`'s)."""
    plugins = base.lab.plugins if sync == "plugin" else ()
    cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, sync="fixed" if plugins else sync))
    cfg = cfg.with_lab(plugins=plugins)
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
                            "scenario": "",
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


# -- main ---------------------------------------------------------------------------------------------------


def machine_record() -> dict:
    return machine_info(
        processor=platform.processor() or platform.machine(),
        cpu_affinity=usable_cpus(),
        gloo_available=dist.is_gloo_available(),
        load_average_1_5_15_min=os.getloadavg(),  # other work on the machine skews every number here
    )


def main() -> None:
    args = _parser().parse_args()
    base = config_from_args(args)
    kept = {k: v for k, v in vars(args).items() if k != "results_dir"}  # where the file is; no machine paths
    rows, timeline, report = [], [], {"machine": machine_record(), "code": code_state(), "args": kept}
    started = time.perf_counter()
    if not args.skip_step_time:
        rows += _step_time_part(args, base, report)
    if not args.skip_primitives:
        primitive_rows, timeline = _primitives_parts(args, base, report)
        rows += primitive_rows
    report["elapsed_s"] = time.perf_counter() - started
    report["load_average_at_end"] = os.getloadavg()
    _write_results(Path(args.results_dir), rows, timeline, report)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, pp=2, latency="virtual")
    parser.set_defaults(enable_hierarchical_cache=True)  # the host tier is what needs agreeing on
    parser.add_argument("--sync-modes", nargs="+", default=list(SYNC_MODES), choices=SYNC_MODES, help="part 1 modes")
    parser.add_argument("--repeats", type=int, default=4, help="part 1: runs per sync mode (median, min-max)")
    parser.add_argument("--pp-sizes", type=int, nargs="+", default=[2, 3, 4], help="parts 2-3: world sizes")
    parser.add_argument("--steps", type=int, default=80, help="part 2: timed pipeline steps per variant and block")
    parser.add_argument("--stage-ms", type=float, default=2.0, help="part 2: each stage's modelled forward (ms)")
    parser.add_argument("--slow-factor", type=float, default=2.0, help="part 2, slow_last: the last stage's forward x")
    parser.add_argument("--calls", type=int, default=500, help="part 3: timed calls per op and block")
    parser.add_argument("--warmup", type=int, default=10, help="parts 2-3: untimed steps (calls) before each block")
    parser.add_argument("--blocks", type=int, default=5, help="parts 2-3: interleaved blocks (median, min-max)")
    parser.add_argument("--skip-step-time", action="store_true", help="skip part 1")
    parser.add_argument("--skip-primitives", action="store_true", help="skip parts 2 and 3")
    parser.add_argument("--timeline", action="store_true", help="part 2: write agreement_timeline.csv")
    parser.add_argument("--results-dir", default=str(RESULTS), help="where the CSV and JSON go")
    return parser


def _step_time_part(args: argparse.Namespace, base: RunConfig, report: dict) -> list[dict]:
    """Part 1, measured and printed (its summary into `report`); its CSV rows."""
    modes = list(dict.fromkeys(args.sync_modes)) + ["plugin"] * bool(base.lab.plugins)  # --plugin: one more mode
    w, p, c = base.workload, base.parallel, base.cache
    workload = (
        f"{w.num_clients} clients x {w.num_rounds} rounds, request {w.request_length}, sub-question "
        f"{w.sub_question_input_length}, output {w.output_length}, max running {base.scheduler.max_running_requests}, "
        f"seed {w.seed}; model {base.model.num_layers} layers x {base.model.hidden_size}; "
        f"--pp {p.pp} --tp {p.tp} --cp {p.cp}, hierarchical cache {c.enable_hierarchical_cache}, "
        f"--latency {c.latency}"
    )
    print(f"part 1: scheduler step time by sync mode ({', '.join(modes)}), {args.repeats} repeats\n  {workload}")
    step_rows, means = measure_step_times(base, modes, args.repeats)
    report["step_time"] = {"workload": workload, **report_step_times(means, step_rows, modes, p.world_size)}
    return step_rows


def _primitives_parts(args: argparse.Namespace, base: RunConfig, report: dict) -> tuple[list[dict], list[dict]]:
    """Parts 2 and 3, measured and printed (their summary into `report`); their CSV rows, and the timeline's."""
    print(
        f"\nparts 2-3: worlds of {args.pp_sizes} ranks, {args.blocks} blocks; part 2: {args.steps} pipeline steps "
        f"per variant, forward {args.stage_ms} ms; part 3: {args.calls} calls"
    )
    world_args = {
        "steps": args.steps,
        "stage_ms": args.stage_ms,
        "slow_factor": args.slow_factor,
        "calls": args.calls,
        "warmup": args.warmup,
        "blocks": args.blocks,
        "timeout_s": base.parallel.collective_timeout_s,
        "timeline": args.timeline,
    }
    rows, values, timeline = measure_primitives(args.pp_sizes, world_args)
    report["pipeline_and_attention"] = report_primitives(values, world_args)
    return rows, timeline


def _write_results(out: Path, rows: list[dict], timeline: list[dict], report: dict) -> None:
    """The CSV, the JSON and the timeline's CSV into `out`, then the CSV's tables as notebook 05 shows them."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "agreement_cost.csv", rows, CSV_FIELDS)
    (out / "agreement_cost.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    if timeline:
        write_csv(out / "agreement_timeline.csv", timeline)
    also = ", agreement_timeline.csv" if timeline else ""
    print(f"\nwrote {out}/agreement_cost.csv, agreement_cost.json{also} ({report['elapsed_s']:.0f} s)")
    print(f"\n{HEADER}")
    print_tables(pd.read_csv(out / "agreement_cost.csv"))


if __name__ == "__main__":
    main()
