"""What `bench.agreement_cost` prints and returns for its JSON: of part 1 (`report_step_times`: the scheduler's
step time by sync mode, per rank, and the ratios between modes), and of parts 2 and 3 (`report_primitives`: the
modelled pipeline's step time and each stage's time in the agreement, the lockstep, one agreement against two);
and `spread`, the median, min and max that every figure of the benchmark is."""

from __future__ import annotations

import statistics

from bench.agreement_primitives import PP_VARIANTS, SCENARIOS
from bench.common import ratio


def spread(values: list[float]) -> dict:
    """Median, min and max of the blocks (or repeats)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _cell(values: list[float], digits: int = 0) -> str:
    s = spread(values)
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def report_step_times(means: dict, rows: list[dict], modes: list[str], world: int) -> dict:
    """Part 1, printed: per window and rank, each mode's mean step time, the ratios of fixed to the other modes
    repeat by repeat, and whether the modes' ranges overlap; returns the same for the JSON."""
    summary: dict = {}
    print("\nmean scheduler step time (ms): median [min-max] over repeats of each run's mean")
    ratio_heads = [f"fixed/{m}" for m in modes if m != "fixed"] if "fixed" in modes else []
    print(f"{'window':13} {'rank':>5} {'steps':>6} " + " ".join(f"{m:>20}" for m in modes))
    for window in ("common", "same_batches"):
        for rank in [*range(world), "all"]:
            per_mode = {m: means[rank][window][m] for m in modes}
            steps = [r["n"] for r in rows if r["metric"] == f"mean_step_ms_{window}" and rank in (r["rank"], "all")]
            n = f"{min(steps)}" if steps else "-"
            label = "mean" if rank == "all" else ("last" if rank == world - 1 else str(rank))
            cells = " ".join(
                f"{statistics.median(v):7.2f} [{min(v):5.2f}-{max(v):5.2f}]".rjust(20) for v in per_mode.values()
            )
            print(f"{window:13} {label:>5} {n:>6} {cells}")
            entry = {m: spread(v) for m, v in per_mode.items()}
            per_repeat = {
                h: [ratio(f, o) for f, o in zip(per_mode["fixed"], per_mode[h.split("/")[1]], strict=True)]
                for h in ratio_heads
            }
            summary.setdefault(window, {})[str(rank)] = {
                "mean_step_ms": entry,
                "per_repeat_ratios": per_repeat,
                "ratios": {h: spread(v) for h, v in per_repeat.items()},
            }
    print("per-repeat ratios (window common): median [min-max]")
    for rank in [*range(world), "all"]:
        label = "mean" if rank == "all" else ("last" if rank == world - 1 else str(rank))
        ratios = summary["common"][str(rank)]["ratios"]
        print(
            f"  rank {label:>4}: "
            + "; ".join(f"{h} {v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]" for h, v in ratios.items())
        )
    mean = summary["common"]["all"]["mean_step_ms"]
    ranges = {m: (v["min"], v["max"]) for m, v in mean.items()}
    overlap = max(lo for lo, _ in ranges.values()) <= min(hi for _, hi in ranges.values())
    verdict = "overlap: the modes' differences are within run-to-run noise" if overlap else "do not all overlap"
    print(
        "  mean of ranks, min-max over repeats: "
        + ", ".join(f"{m} {lo:.2f}-{hi:.2f}" for m, (lo, hi) in ranges.items())
        + f" ms: {verdict}"
    )
    summary["common"]["verdict"] = {"ranges_overlap": overlap, "ranges_ms": ranges}
    print(
        "  common: per rank, the first N steps all runs completed (N = the shortest run's count, a crashed run's "
        "aborted last step dropped);\n  same_batches: the first steps in which all runs scheduled identical "
        "batches (before the first divergence). 'mean': the mean over ranks. steps: the smallest N over repeats."
    )
    return summary


def report_primitives(values: dict, args: dict) -> dict:
    """Parts 2 and 3, printed: the modelled pipeline's step time and each stage's time in the agreement, the
    lockstep, one agreement against two; returns the same for the JSON, by world size."""
    summary: dict = {}
    blocks, w, k = args["blocks"], args["stage_ms"], args["slow_factor"]
    print(
        f"\npart 2: modelled pipeline, {args['steps']} steps after {args['warmup']}, forward {w} ms per stage "
        f"(slow_last: the last stage's {w * k:g} ms); median [min-max] of {blocks} blocks"
    )
    for scenario in SCENARIOS:
        _report_scenario(scenario, values, summary)
    print(
        "  step ms: the last stage's wall time per step, the pipeline's throughput; '+ over none': the median over "
        "blocks of (variant - none) in the same block,\n  the agreement's own cost. Relay: a stage before the last "
        "drains (waits until the next stage has received its previous count) and isends; later stages wait in\n  "
        "the recv, for the previous stage to send the count and for gloo to hand it over (it moves the data only "
        "once the recv is posted).\n  Barrier / all-reduce: every stage waits there for the slowest (lockstep)."
    )
    _report_lockstep(values, w, k, summary)
    _report_attention(values, summary)
    return summary


def _report_scenario(scenario: str, values: dict, summary: dict) -> None:
    """One scenario of part 2: per world size and variant, the pipeline's step time, its cost over `none` and
    each stage's time in the agreement."""
    print(f"\n  {scenario}: pipeline step (ms, last stage) and each stage's time in the agreement (us per step)")
    print(f"  {'pp':>3} {'variant':>10} {'step ms':>18} {'+ over none':>12}   agreement us per step, by stage")
    for size, by_key in values.items():
        none = by_key[(scenario, "none", "step_ms")][size - 1]
        for variant in PP_VARIANTS:
            step = by_key[(scenario, variant, "step_ms")][size - 1]
            extra = [s - n for s, n in zip(step, none, strict=True)]  # same block: same machine state
            agree = by_key[(scenario, variant, "agree_us_per_step")]
            drain = by_key[(scenario, variant, "drain_us_per_step")]
            stages = "  ".join(
                f"{r}: {_cell(agree[r])}"
                + (f" (drain {statistics.median(drain[r]):.0f})" if r < size - 1 and variant == "relay" else "")
                for r in range(size)
            )
            print(f"  {size:3} {variant:>10} {_cell(step, 2):>18} {statistics.median(extra):+12.2f}   {stages}")
            summary.setdefault(str(size), {}).setdefault(scenario, {})[variant] = {
                "pipeline_step_ms": spread(step),
                "extra_ms_over_none_same_block": spread(extra),
                "step_ms_by_stage": {str(r): spread(by_key[(scenario, variant, "step_ms")][r]) for r in range(size)},
                "agree_us_by_stage": {str(r): spread(agree[r]) for r in range(size)},
                "drain_us_by_stage": {str(r): spread(drain[r]) for r in range(size)},
                "act_wait_us_by_stage": {
                    str(r): spread(by_key[(scenario, variant, "act_wait_us_per_step")][r]) for r in range(size)
                },
            }


def _report_lockstep(values: dict, w: float, k: float, summary: dict) -> None:
    """slow_last's step time under none, the relay and an all-reduce, beside the slowest forward and the sum of
    all forwards (`w` ms each, the last stage's `w * k`)."""
    print(f"\n  lockstep (slow_last, forwards {w:g} ms and the last stage's {w * k:g} ms): pipeline step, ms")
    for size, by_key in values.items():
        none = spread(by_key[("slow_last", "none", "step_ms")][size - 1])
        relay = spread(by_key[("slow_last", "relay", "step_ms")][size - 1])
        allred = spread(by_key[("slow_last", "all_reduce", "step_ms")][size - 1])
        ideal = {"slowest_stage": w * k, "sum_of_stages": w * (size - 1) + w * k}
        print(
            f"  PP={size}: none {none['median']:.2f} [{none['min']:.2f}-{none['max']:.2f}], relay "
            f"{relay['median']:.2f} [{relay['min']:.2f}-{relay['max']:.2f}], all-reduce {allred['median']:.2f} "
            f"[{allred['min']:.2f}-{allred['max']:.2f}] = {ratio(allred['median'], none['median']):.2f}x none; "
            f"the slowest forward {ideal['slowest_stage']:g}, all forwards in a row {ideal['sum_of_stages']:g}"
        )
        summary.setdefault(str(size), {})["lockstep_slow_last"] = {
            "none_ms": none,
            "relay_ms": relay,
            "all_reduce_ms": allred,
            "all_reduce/none": ratio(allred["median"], none["median"]),
            "forward_ms": ideal,
        }


def _report_attention(values: dict, summary: dict) -> None:
    """Part 3: per world size and attention rank, one 2-element all-reduce against two 1-element ones."""
    print("\npart 3: attention group of 2 (ranks 0, 1): us per step, [write, load] agreed (MIN); median [min-max]")
    print(f"  {'pp world':>8} {'rank':>5} {'one 2-elem':>20} {'two 1-elem':>20} {'two/one':>8}")
    for size, by_key in values.items():
        one_by, two_by = (
            by_key[("attn", "combined_1x2", "us_per_step")],
            by_key[("attn", "separate_2x1", "us_per_step")],
        )
        for rank in sorted(one_by):
            one, two = one_by[rank], two_by[rank]
            r = ratio(statistics.median(two), statistics.median(one))
            print(f"  {size:8} {rank:5} {_cell(one):>20} {_cell(two):>20} {r:8.3f}")
            summary.setdefault(str(size), {})[f"attn_rank_{rank}"] = {
                "combined_us_per_step": spread(one),
                "separate_us_per_step": spread(two),
                "separate/combined": r,
            }
