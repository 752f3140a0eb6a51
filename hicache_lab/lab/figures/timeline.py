"""One host copy's life on each stage, legacy against fixed (notebook 02's first figure): when the copy started,
when each stage's own poll first saw it finished, when each stage consumed its ack (unlocking its nodes), and,
with the fix, the counts stage 0 relayed at every step. All from the runs' step traces."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ...managers.step_trace import read_trace
from .style import OTHER_COLORS, TIER_COLORS, runs_caption, save_figure


@dataclass(frozen=True)
class CopyLife:
    """The first host write of one stage (its first rank), in scheduler steps."""

    started: int  # the step whose write-through started it (host_write_tokens > 0)
    seen: int  # the first step at which this stage's own poll found it finished (ready_write > 0)
    consumed: int  # the step at which this stage consumed its ack (acks_write > 0): its nodes unlocked
    relayed: dict[int, int]  # step -> the write-ack count stage 0 relayed at that step (fixed runs only)


def first_copy(run_dir: Path, pp: int) -> dict[int, CopyLife]:
    """Each stage's life of the run's first host write (one rank per stage: --tp 1 --cp 1)."""
    rows = read_trace(run_dir)
    by_rank = {rank: sorted((r for r in rows if r["rank"] == rank), key=lambda r: r["step"]) for rank in range(pp)}
    stage0 = {r["step"]: r for r in by_rank[0]}
    lives = {}
    for stage, steps in by_rank.items():
        started = next(r["step"] for r in steps if r["host_write_tokens"] > 0)
        seen = next(r["step"] for r in steps if r["step"] > started and r["ready_write"] > 0)
        consumed = next(r["step"] for r in steps if r["step"] > started and r["acks_write"] > 0)
        relayed = {s: r["acks_write"] for s, r in stage0.items() if r["relay_sent"] and s <= consumed}
        lives[stage] = CopyLife(started, seen, consumed, relayed)
    return lives


def plot_copy_timeline(runs: dict[str, Path], path: Path, pp: int = 2) -> dict[str, dict[int, CopyLife]]:
    """One panel per run (label -> its directory): a lane per stage, the copy in flight (a bar from its start to
    the step the stage's poll saw it finished), locked until its ack is consumed (the hatched span), the step it
    was consumed (the dot), and in a fixed run the relay (an arrow from stage 0 to each later stage per step,
    labelled with the count it carried). Returns the lives drawn."""
    lives = {label: first_copy(run_dir, pp) for label, run_dir in runs.items()}
    last = max(life.consumed for stages in lives.values() for life in stages.values()) + 1
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.35 * pp * len(runs) + 0.6), sharex=True, squeeze=False)
    for ax, (label, stages) in zip(axes[:, 0], lives.items(), strict=True):
        for stage, life in stages.items():
            _draw_lane(ax, stage, life, pp)
        _finish_panel(ax, label, stages, pp)
    axes[-1, 0].set_xticks(range(last + 1))
    axes[-1, 0].set_xlim(-0.5, last + 0.5)
    axes[-1, 0].set_xlabel("scheduler step (each stage counts its own)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    handles += [
        Patch(facecolor="none", hatch="///", edgecolor=OTHER_COLORS[3]),
        Line2D([], [], color=OTHER_COLORS[0], marker=r"$\downarrow$", linestyle="none", markersize=10),
    ]
    names += ["nodes locked", "relay: the write-ack count stage 0 passed on"]
    axes[-1, 0].legend(
        handles, names, loc="upper center", ncol=2, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.35)
    )
    save_figure(
        fig, path, runs_caption(json.loads((run_dir / "summary.json").read_text()) for run_dir in runs.values())
    )
    return lives


def _draw_lane(ax, stage: int, life: CopyLife, pp: int) -> None:
    """One stage's lane: the copy in flight, its nodes locked, the ack consumed, and the relay that reached it."""
    y = pp - 1 - stage
    ax.barh(
        y,
        life.consumed - life.started,
        left=life.started,
        height=0.5,
        color="none",
        hatch="///",
        edgecolor=OTHER_COLORS[3],
        linewidth=0,
    )
    ax.barh(
        y,
        life.seen - life.started,
        left=life.started,
        height=0.5,
        color=TIER_COLORS["host"],
        alpha=0.8,
        label="copy in flight (own poll: not finished)" if stage == 0 else None,
    )
    ax.plot(
        life.consumed,
        y,
        "o",
        color=OTHER_COLORS[1],
        markersize=10,
        label="ack consumed: nodes unlocked" if stage == 0 else None,
    )
    ax.annotate(f"step {life.consumed}", (life.consumed, y), xytext=(8, 8), textcoords="offset points")
    for step, count in life.relayed.items() if stage > 0 else ():
        ax.annotate(
            "",
            xy=(step, y + 0.28),
            xytext=(step, pp - 1 - 0.28),
            arrowprops={"arrowstyle": "->", "color": OTHER_COLORS[0], "lw": 1},
        )
        ax.text(step + 0.08, (y + pp - 1) / 2, str(count), fontsize=8, color=OTHER_COLORS[0])


def _finish_panel(ax, label: str, stages: dict[int, CopyLife], pp: int) -> None:
    """A run's panel: where the stages' trees differ (one has unlocked the nodes, another not), its title, lanes
    and grid."""
    consumed = sorted({life.consumed for life in stages.values()})
    if len(consumed) > 1:  # one stage has unlocked the nodes, another still holds them locked
        ax.axvspan(consumed[0] - 0.1, consumed[-1] - 0.1, color=OTHER_COLORS[1], alpha=0.12)
        ax.text(consumed[0], pp - 0.55, " the stages' trees differ", color=OTHER_COLORS[1], fontsize=8)
    verdict = "the same step" if len(consumed) == 1 else "different steps"
    ax.set_title(f"{label}: the stages consume its ack at {verdict}", loc="left", fontsize=10)
    ax.set_yticks(range(pp), [f"stage {pp - 1 - y}" for y in range(pp)])
    ax.set_ylim(-0.6, pp - 0.4)
    ax.grid(axis="x", alpha=0.3)
