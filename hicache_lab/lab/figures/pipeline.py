"""A pipeline run's stages, step by step: the acks each consumed (`plot_queue_divergence`) and whether its tree
is rank 0's (`plot_digest_agreement`), with the first divergence and the crash marked."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ...managers.step_trace import read_trace
from .chain import crash_what
from .style import OTHER_COLORS, runs_caption, save_figure

RANK_STYLES = (  # ranks' lines often coincide: each drawn narrower than the one before, on top of it
    {"color": OTHER_COLORS[3], "lw": 5.0, "alpha": 0.55},
    {"color": OTHER_COLORS[0], "lw": 1.6},
    {"color": OTHER_COLORS[4], "lw": 1.0},
)
DIFFER_SHADE = {"color": OTHER_COLORS[1], "alpha": 0.22, "lw": 0}  # steps at which the ranks' trees differ


def _cumulative(rows: list[dict], quantity: str) -> dict[int, list[int]]:
    """Per rank: the running total of `quantity` at each step."""
    totals: dict[int, list[int]] = {}
    for r in sorted(rows, key=lambda r: (r["rank"], r["step"])):
        series = totals.setdefault(r["rank"], [])
        series.append((series[-1] if series else 0) + r[quantity])
    return totals


def crash_label(summary: dict) -> str:
    """A run's crash for a title: the rank, the step it last recorded (`crash_step`, where known) and
    `crash_what`. The full error belongs in the text beside the figure."""
    step = summary.get("crash_step")
    where = f"rank {summary.get('failing_rank')}" + (f" at step {step}" if step is not None else "")
    return f"crashed ({where}): {crash_what(summary.get('error'))}"


def _with_crash_step(summary: dict, rows: list[dict]) -> dict:
    """The summary with `crash_step`: the last step the failing rank recorded (a crashing step is traced)."""
    failing = summary.get("failing_rank")
    steps = [r["step"] for r in rows if r["rank"] == failing]
    return {**summary, "crash_step": max(steps) if summary.get("crashed") and steps else None}


def _rank_style(rank: int) -> dict:
    return RANK_STYLES[min(rank, len(RANK_STYLES) - 1)]


def _shade_differing_trees(axes: tuple, rows: list[dict]) -> None:
    """Shade, on every axis, the steps at which the ranks' tree digests differ."""
    digests: dict[int, set[str]] = {}
    for r in rows:
        digests.setdefault(r["step"], set()).add(r["digest"])
    for step, seen in digests.items():
        if len(seen) > 1:
            for ax in axes:
                ax.axvspan(step, step + 1, **DIFFER_SHADE)


def _draw_acks(top, bottom, rows: list[dict]) -> set[int]:
    """Top: each rank's write (solid) and load (dashed) acks, cumulative; bottom: each later rank's count minus
    rank 0's. Returns the ranks drawn."""
    ranks = set()
    for quantity, style in (("acks_write", "-"), ("acks_load", "--")):
        totals = _cumulative(rows, quantity)
        for rank, series in sorted(totals.items()):
            ranks.add(rank)
            look = {**_rank_style(rank), "ls": style}
            top.step(range(len(series)), series, where="post", **look)
            if rank:
                gap = [a - b for a, b in zip(series, totals[0], strict=False)]
                bottom.step(range(len(gap)), gap, where="post", **look)
    return ranks


def _write_gap(rows: list[dict], summary: dict) -> int:
    """The failing rank's write acks minus rank 0's, cumulative, at its crash step."""
    totals = _cumulative(rows, "acks_write")
    series, base, step = totals.get(summary["failing_rank"], []), totals.get(0, []), summary["crash_step"]
    return series[min(step, len(series) - 1)] - base[min(step, len(base) - 1)] if series and base else 0


def _mark_outcome(top, bottom, title: str, summary: dict, rows: list[dict]) -> None:
    """The first divergence (a red line and its step), the crash (a red X) and the run's outcome in the title."""
    first = summary["first_divergence"]
    if first:
        for ax in (top, bottom):
            ax.axvline(first["step"], color=OTHER_COLORS[1], lw=1)
        top.annotate(
            f"first divergence: step {first['step']} ({first['quantity']})",
            (first["step"], 1),
            xycoords=("data", "axes fraction"),
            xytext=(4, -12),
            textcoords="offset points",
            color=OTHER_COLORS[1],
            fontsize=8,
        )
    if summary["crash_step"] is not None:  # on the failing rank's write-ack line (rank 0's gap is 0 by definition)
        bottom.plot([summary["crash_step"]], [_write_gap(rows, summary)], "X", color=OTHER_COLORS[1], ms=9)
    status = crash_label(summary) if summary["crashed"] else "completed; all ranks agree"
    top.set_title(f"{title}\n{status}", fontsize=9)
    bottom.set_xlabel("scheduler step (iteration)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _ack_legend(fig, ranks: set[int]) -> None:
    handles = [Line2D([], [], **_rank_style(rank), label=f"rank {rank}") for rank in sorted(ranks)]
    handles += [
        Line2D([], [], color="0.3", lw=1.2, ls="-", label="write acks"),
        Line2D([], [], color="0.3", lw=1.2, ls="--", label="load acks"),
        Patch(**DIFFER_SHADE, label="trees differ"),
        Line2D([], [], color=OTHER_COLORS[1], lw=1, label="first divergence"),
        Line2D([], [], color=OTHER_COLORS[1], marker="X", ls="", ms=8, label="crash"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.text(
        0.5,
        0.065,
        "rank 0 is drawn wide and pale, rank 1 narrow on top of it: where a single line shows, the ranks coincide",
        ha="center",
        fontsize=8,
        color="0.3",
    )


def plot_queue_divergence(runs: dict[str, tuple[Path, dict]], path: Path) -> None:
    """One column per run (e.g. legacy, fixed). Top: write (solid) and load (dashed) acks each rank consumed,
    cumulative. Bottom: each rank's count minus rank 0's; shaded: the steps at which the ranks' trees differ.
    Rank 0 is drawn wide and pale, each later rank narrower on top of it: where one line shows, they coincide.

    `runs` maps a title to (output directory, summary). The first divergent step is marked in red.
    """
    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 6.2), sharex="col", sharey="row", squeeze=False)
    ranks_seen: set[int] = set()
    for col, (title, (out_dir, summary)) in enumerate(runs.items()):
        rows = read_trace(out_dir)
        top, bottom = axes[0][col], axes[1][col]
        _shade_differing_trees((top, bottom), rows)
        ranks_seen |= _draw_acks(top, bottom, rows)
        _mark_outcome(top, bottom, title, _with_crash_step(summary, rows), rows)
    axes[0][0].set_ylabel("acks consumed (cumulative)")
    axes[1][0].set_ylabel("rank's count − rank 0's")
    _ack_legend(fig, ranks_seen)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    save_figure(fig, path, runs_caption(summary for _, summary in runs.values()), layout=False)


def digest_agreement(rows: list[dict]) -> tuple[list[int], list[int], list[list[float]]]:
    """(ranks, steps, matrix): 1 where the rank's tree digest equals rank 0's at that step, 0 where it
    differs, NaN where the rank has no record (it had crashed or was stopped)."""
    ranks = sorted({r["rank"] for r in rows})
    steps = list(range(max(r["step"] for r in rows) + 1)) if rows else []
    digest = {(r["rank"], r["step"]): r["digest"] for r in rows}
    matrix = [
        [
            float(digest[(rank, s)] == digest[(0, s)]) if (rank, s) in digest and (0, s) in digest else float("nan")
            for s in steps
        ]
        for rank in ranks
    ]
    return ranks, steps, matrix


def plot_digest_agreement(runs: dict[str, tuple[Path, dict]], path: Path) -> None:
    """One heat map per run: rank (rows) by scheduler step (columns), grey where the rank's tree equals rank
    0's, red where it differs, white where it has stopped (an X: the crash). `runs` maps a title to (output
    dir, summary)."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 0.9 + 1.5 * len(runs)), squeeze=False)
    same, differs = "#d9d9d9", OTHER_COLORS[1]
    cmap = ListedColormap([differs, same])
    cmap.set_bad("white")
    for ax, (title, (out_dir, summary)) in zip(axes[:, 0], runs.items(), strict=True):
        rows = read_trace(out_dir)
        summary = _with_crash_step(summary, rows)
        ranks, steps, matrix = digest_agreement(rows)
        ax.imshow(matrix, aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        first = summary["first_divergence"]
        status = f"first divergence: step {first['step']} ({first['quantity']})" if first else "ranks agree"
        if summary["crashed"]:
            status += f"; {crash_label(summary)}"
            if summary["crash_step"] is not None:
                ax.plot(summary["crash_step"], ranks.index(summary["failing_rank"]), "X", color="black", ms=8)
        ax.set_title(f"{title} — {status}", fontsize=9)
        ax.set_xlabel("scheduler step")
    handles = [
        Patch(color=same, label="same tree as rank 0"),
        Patch(color=differs, label="differs"),
        Patch(fc="white", ec="0.5", label="no record (stopped)"),
        Line2D([], [], color="black", marker="X", ls="", ms=8, label="crash"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(fig, path, runs_caption(summary for _, summary in runs.values()), layout=False)
