"""The lockstep as a Gantt chart (`plot_lockstep`): every stage's steps of one modelled pipeline on one time axis,
one panel per agreement (none, the relay, the all-reduce), from the per-step marks that
`python -m bench.agreement_cost --timeline` writes (agreement_timeline.csv: when each stage started a step,
ended the relay's drain and the agreement, had its activations, ended its forward and ended the step; one clock
for every process). Under the relay the stages' forwards overlap as without any agreement; under the all-reduce
they run one after another. `lockstep_table` gives the numbers the chart shows."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import Patch

from .style import OTHER_COLORS, save_figure
from .sync_cost import SYNC_VARIANT_COLORS

LOCKSTEP_VARIANTS = ("none", "relay", "all_reduce")
FORWARD_COLORS = (OTHER_COLORS[5], "#e6dcaa")  # alternate steps, so that neighbours read apart
WAIT_COLOR = OTHER_COLORS[3]


def _stage(rank: int, pp: int) -> str:
    return "stage 0" if rank == 0 else ("last stage" if rank == pp - 1 else f"stage {rank}")


def _step_ms(run: pd.DataFrame, pp: int) -> float:
    """The pipeline's step: the last stage's time from its first timed step's start to its last one's end, per
    step (as the benchmark's step_ms)."""
    last = run[run["rank"] == pp - 1]
    return (last["end"].max() - last["start"].min()) / len(last)


def _overlap(run: pd.DataFrame) -> float:
    """Share of the time from the first forward's start to the last one's end in which two or more stages run a
    forward (a sweep over the forwards' starts and ends)."""
    edges = sorted([(t, 1) for t in run["received"]] + [(t, -1) for t in run["forwarded"]])
    running, since, both = 0, 0.0, 0.0
    for t, change in edges:
        if running >= 2:
            both += t - since
        running, since = running + change, t
    span = run["forwarded"].max() - run["received"].min()
    return both / span if span > 0 else 0.0


def _runs(timeline: pd.DataFrame, pp: int, scenario: str) -> dict[str, pd.DataFrame]:
    """Per variant, the block whose pipeline step is the median of its blocks (the one drawn and tabled)."""
    mine = timeline[(timeline["pp"] == pp) & (timeline["scenario"] == scenario)]
    chosen = {}
    for variant in LOCKSTEP_VARIANTS:
        blocks = {b: run for b, run in mine[mine["variant"] == variant].groupby("block")}
        if not blocks:
            raise ValueError(f"no timeline of {variant} at PP={pp}, {scenario}: run the benchmark with --timeline")
        by_step = sorted(blocks, key=lambda b: _step_ms(blocks[b], pp))
        chosen[variant] = blocks[by_step[len(by_step) // 2]]
    return chosen


def _sent_before(run: pd.DataFrame, pp: int) -> float:
    """Relay: the share of steps whose count the stage before the last had sent (its agreement ended: drain,
    recv, isend) before the last stage asked for it (posted its recv); NaN for the other variants."""
    if run["variant"].iloc[0] != "relay":
        return float("nan")
    sender = run[run["rank"] == pp - 2].set_index("step")["agreed"]
    asked = run[run["rank"] == pp - 1].set_index("step")["drained"]
    return float((sender.reindex(asked.index) < asked).mean())


def lockstep_table(timeline: pd.DataFrame, pp: int = 3, scenario: str = "slow_last") -> pd.DataFrame:
    """One row per variant (its median block): the pipeline's step, how much of the time two or more forwards
    overlap, and the last stage's step in its parts (ms per step, means over the block's steps); for the relay,
    how often the last stage's count had been sent before it asked for it (`_sent_before`)."""
    rows = {}
    for variant, run in _runs(timeline, pp, scenario).items():
        last = run[run["rank"] == pp - 1]
        rows[variant] = {
            "pipeline step (ms)": _step_ms(run, pp),
            "forwards overlap (% of time)": 100 * _overlap(run),
            "last stage: in the agreement (ms)": (last["agreed"] - last["start"]).mean(),
            "its count sent before it asked (% of steps)": 100 * _sent_before(run, pp),
            "last stage: waiting for activations (ms)": (last["received"] - last["agreed"]).mean(),
            "last stage: forward (ms)": (last["forwarded"] - last["received"]).mean(),
        }
    return pd.DataFrame(rows).T.rename_axis(f"PP={pp}, {scenario}")


def _panel(ax, run: pd.DataFrame, pp: int, variant: str, window: tuple[float, float]) -> None:
    """One variant: a row per stage (stage 0 on top); per step its agreement, its wait for the activations and
    its forward (numbered by step), on a time axis from the window's start."""
    t0, t1 = window
    color = SYNC_VARIANT_COLORS[variant]
    for rank in range(pp):
        y = pp - 1 - rank
        for step in run[run["rank"] == rank].itertuples():
            if step.end < t0 or step.start > t1:
                continue
            parts = [
                (step.start, step.drained, dict(color=color, alpha=0.45, hatch="///", lw=0)),  # the relay's drain
                (step.drained, step.agreed, dict(color=color)),
                (step.agreed, step.received, dict(color=WAIT_COLOR, alpha=0.45)),
                (step.received, step.forwarded, dict(color=FORWARD_COLORS[step.step % 2], ec="black", lw=0.5)),
            ]
            for a, b, style in parts:
                if b > a:
                    ax.barh(y, b - a, left=a - t0, height=0.62, **style)
            mid = (max(step.received, t0) + min(step.forwarded, t1)) / 2 - t0
            if step.forwarded - step.received > 0.9 and t0 < mid + t0 < t1:
                ax.text(mid, y, str(step.step), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(pp), [_stage(r, pp) for r in reversed(range(pp))], fontsize=8)
    ax.set_xlim(0, t1 - t0)
    ax.set_ylim(-0.6, pp - 0.4)
    ax.grid(alpha=0.3, axis="x")


def plot_lockstep(
    timeline: pd.DataFrame,
    path: Path,
    caption: str,
    pp: int = 3,
    scenario: str = "slow_last",
    first_step: int = 3,
    span_ms: float = 40.0,
) -> pd.DataFrame:
    """A panel per variant of `LOCKSTEP_VARIANTS` (its median block), every stage's steps on a time axis: the
    same `span_ms` from the moment stage 0 starts timed step `first_step` (the steps are numbered as in the
    timeline: step j of every stage carries the same micro-batch), with the caption line `caption` (the
    benchmark's: `sync_cost.agreement_caption`). Returns `lockstep_table`, the numbers in the panels' titles."""
    runs, table = _runs(timeline, pp, scenario), lockstep_table(timeline, pp, scenario)
    fig, axes = plt.subplots(
        len(runs), 1, figsize=(12.4, 1.4 + 0.55 * pp * len(runs)), sharex=True, layout="constrained"
    )
    for ax, (variant, run) in zip(axes, runs.items(), strict=True):
        start = run[(run["rank"] == 0) & (run["step"] == first_step)]["start"]
        if start.empty:
            raise ValueError(f"{variant}: fewer than {first_step + 1} timed steps in the timeline")
        _panel(ax, run, pp, variant, (float(start.iloc[0]), float(start.iloc[0]) + span_ms))
        row = table.loc[variant]
        ax.set_title(
            f"{variant}: the pipeline's step {row['pipeline step (ms)']:.2f} ms; two or more forwards overlap "
            f"{row['forwards overlap (% of time)']:.0f}% of the time (its median block)",
            fontsize=9,
            loc="left",
        )
    what = "a slow last stage" if scenario == "slow_last" else "equal stages"
    axes[-1].set_xlabel(f"ms from stage 0's start of step {first_step} (PP={pp}, {what})")
    handles = [
        Patch(color=FORWARD_COLORS[0], ec="black", lw=0.5, label="forward (its step number)"),
        Patch(color=WAIT_COLOR, alpha=0.45, label="waiting for the activations"),
        Patch(color=SYNC_VARIANT_COLORS["relay"], label="in the relay"),
        Patch(color=SYNC_VARIANT_COLORS["relay"], alpha=0.45, hatch="///", lw=0, label="of which the drain"),
        Patch(color=SYNC_VARIANT_COLORS["all_reduce"], label="in the all-reduce"),
        Patch(facecolor="white", ec="#bbbbbb", label="blank: ending the step (stage 0: waiting for the tokens)"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    save_figure(fig, path, caption, layout=False)  # laid out by matplotlib's constrained layout: the legend's room
    return table
