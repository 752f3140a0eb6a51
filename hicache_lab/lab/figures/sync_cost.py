"""What the cache's agreement costs, from bench/agreement_cost.py's long table (`plot_sync_cost`): the lab
scheduler's step time by sync mode (part 1), and a modelled pipeline's (part 2): each stage's time in the
agreement, and the pipeline's step time by PP with equal stages and with a slow last stage."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from .style import OTHER_COLORS, caption_line, save_figure

SYNC_VARIANT_COLORS = {
    "none": OTHER_COLORS[0],
    "relay": OTHER_COLORS[1],
    "barrier": OTHER_COLORS[2],
    "all_reduce": OTHER_COLORS[4],
}
SYNC_STAGE_COLORS = (OTHER_COLORS[3], OTHER_COLORS[5])  # part 1: stage 0, the last stage


def _spread(frame, keys: list[str]):
    """Median, min and max of `value` per `keys` (over repeats or blocks)."""
    return frame.groupby(keys)["value"].agg(["median", "min", "max"])


CLIP = 3.0  # part 2's whiskers stop at CLIP x the panel's largest median, their value written there


def _errorbar(ax, xs, stats, ceiling: float | None = None, **style) -> None:
    """Medians with min-max bars; a max above `ceiling` is drawn up to it, with its value written above."""
    top = stats["max"] if ceiling is None else stats["max"].clip(upper=ceiling)
    ax.errorbar(xs, stats["median"], yerr=[stats["median"] - stats["min"], top - stats["median"]], capsize=3, **style)
    for x, value in zip(xs, stats["max"], strict=True):
        if ceiling is not None and value > ceiling:
            color = style.get("color", style.get("ecolor", "black"))
            ax.annotate(f"↑{value:,.0f}", (x, ceiling), ha="center", va="bottom", fontsize=7, color=color)


def _ceiling(stats) -> float:
    """Where part 2's whiskers stop: CLIP x the largest median (a slow block then stretches no axis)."""
    return float(min(stats["max"].max(), CLIP * stats["median"].max()))


def _clip_note(stats, ceiling: float) -> str:
    """The title's word on clipped whiskers, where any is."""
    return f"\nwhiskers stop at {CLIP:g}x the largest median (↑: the max)" if (stats["max"] > ceiling).any() else ""


def _log_y(ax, low: float, high: float, room: float, subs: tuple = (1, 2, 5)) -> None:
    """A log y axis from `low` to `high` (medians, whiskers up to `_ceiling`): one slow block stretches it by
    a factor, not the rest flat onto the floor; `room` of its height on top for the legend; ticks at `subs` of
    each decade, written as plain numbers."""
    low, high = max(low, 1e-3) / 1.25, high * 1.3
    top = high * math.exp(math.log(high / low) * room / (1 - room))
    ax.set_yscale("log")
    ax.set_ylim(low, top)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.10g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _panel_axes(fig, panels: list[str]) -> dict:
    """One axis per panel: one alone; three as one wide on top and two below; four in a 2 x 2 grid."""
    if len(panels) == 1:
        return {panels[0]: fig.add_subplot(fig.add_gridspec(1, 1)[0, 0])}
    grid = fig.add_gridspec(2, 2)
    cells = (
        [grid[0, 0], grid[0, 1], grid[1, 0], grid[1, 1]] if len(panels) == 4 else [grid[0, :], grid[1, 0], grid[1, 1]]
    )
    return {name: fig.add_subplot(cell) for name, cell in zip(panels, cells, strict=True)}


def _step_time_panel(ax, steps) -> None:
    """Part 1: each stage's mean scheduler step by sync mode: median bars, min-max, and every repeat's dot."""
    world = int(steps["rank"].max()) + 1
    modes = [m for m in ("sync=off", "sync=legacy", "sync=fixed") if m in set(steps["variant"])]
    stats = _spread(steps, ["variant", "rank"])
    width = 0.8 / world
    for rank in range(world):
        label = "stage 0" if rank == 0 else ("last stage" if rank == world - 1 else f"stage {rank}")
        xs = [i + (rank - (world - 1) / 2) * width for i in range(len(modes))]
        rows = stats.loc[[(m, rank) for m in modes]]
        color = SYNC_STAGE_COLORS[min(rank, 1)]
        ax.bar(xs, rows["median"], width * 0.9, color=color, label=f"{label}, median")
        _errorbar(ax, xs, rows, fmt="none", ecolor="black", lw=1)
        for x, mode in zip(xs, modes, strict=True):  # every repeat
            mine = steps[(steps["variant"] == mode) & (steps["rank"] == rank)]["value"]
            ax.plot([x] * len(mine), mine, "o", ms=3, color="black", alpha=0.6)
    repeats = steps["repeat"].nunique()
    ax.set_xticks(range(len(modes)), [m.replace("sync=", "--sync ") for m in modes])
    ax.set_ylabel("mean scheduler step (ms)")
    ax.set_title(
        f"lab scheduler, PP={int(steps['pp'].iloc[0])}, same steps: median, min-max and every one of {repeats} repeats",
        fontsize=9,
    )
    ax.set_ylim(0, 1.25 * ax.get_ylim()[1])  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=2)


def _stages_panel(ax, pipe) -> None:
    """Part 2, equal stages: each stage's time in the agreement per step, by PP and variant."""
    agree = pipe[(pipe["scenario"] == "equal") & (pipe["metric"] == "agree_us_per_step")]
    variants = [v for v in ("relay", "barrier", "all_reduce") if v in set(agree["variant"])]
    stats = _spread(agree, ["pp", "rank", "variant"])
    ceiling = _ceiling(stats.loc[stats.index.get_level_values("variant").isin(variants)])
    positions, labels, x = [], [], 0.0
    for pp in sorted(agree["pp"].unique()):
        for rank in range(int(pp)):
            positions.append((pp, rank, x))
            labels.append(f"{rank}")
            x += 1
        x += 0.6
    width = 0.8 / len(variants)
    for j, variant in enumerate(variants):
        xs = [p + (j - (len(variants) - 1) / 2) * width for _, _, p in positions]
        rows = stats.loc[[(pp, rank, variant) for pp, rank, _ in positions]]
        ax.bar(xs, rows["median"], width * 0.9, color=SYNC_VARIANT_COLORS[variant], label=variant)
        _errorbar(ax, xs, rows, ceiling, fmt="none", ecolor="black", lw=0.8)
    ax.set_xticks([p for _, _, p in positions], labels, fontsize=8)
    for pp in sorted(agree["pp"].unique()):
        xs = [p for q, _, p in positions if q == pp]
        mid = sum(xs) / len(xs)
        ax.annotate(
            f"PP={pp}",
            (mid, 0),
            xytext=(0, -24),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            xycoords=("data", "axes fraction"),
        )
    ax.set_xlabel("stage", labelpad=14)
    ax.set_ylabel("µs per step in the agreement (log scale)")
    chosen = stats.loc[[(pp, rank, v) for pp, rank, _ in positions for v in variants]]
    _log_y(ax, chosen["min"].min(), ceiling, room=0.22)
    ax.set_title(
        "equal stages: each stage's time in the agreement (mostly waiting)\n"
        "relay: stage 0 drains + isends, later stages wait in the recv; median and min-max"
        + _clip_note(chosen, ceiling),
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")


def _pipeline_panel(ax, pipe, scenario: str) -> None:
    """Part 2, one scenario: the pipeline's step time (the last stage's) by PP and variant, with the slowest
    stage's forward and every stage's forward in a row as reference lines."""
    mine = pipe[(pipe["scenario"] == scenario) & (pipe["metric"] == "step_ms")]
    last = mine[mine["rank"] == mine["pp"] - 1]
    stats = _spread(last, ["variant", "pp"])
    pps, ceiling = sorted(last["pp"].unique()), _ceiling(stats)
    for j, variant in enumerate(v for v in SYNC_VARIANT_COLORS if v in set(last["variant"])):
        rows = stats.loc[variant].loc[pps]
        xs = [p + (j - 1.5) * 0.06 for p in pps]  # side by side, so the bars do not hide each other
        style = {"fmt": "o-", "color": SYNC_VARIANT_COLORS[variant], "label": variant, "ms": 4, "lw": 1.5}
        _errorbar(ax, xs, rows, ceiling, **style)
    forward = pipe[(pipe["scenario"] == scenario) & (pipe["metric"] == "forward_ms")].groupby("pp")["value"]
    low, high = stats["min"].min(), ceiling
    if len(forward.groups):
        ax.plot(pps, forward.max().loc[pps], ":", color="black", lw=1, label="the slowest stage's forward")
        ax.plot(pps, forward.sum().loc[pps], "--", color="black", lw=1, label="every stage's forward in a row")
        low, high = min(low, forward.max().min()), max(high, forward.sum().max())
    ax.set_xticks(pps)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("pipeline stages (PP)")
    ax.set_ylabel("pipeline step (ms, last stage; log scale)")
    _log_y(ax, low, high, room=0.3, subs=(1, 2, 4, 6, 8))  # room for the legend above the lines
    blocks = last["repeat"].nunique()
    what = "equal stages" if scenario == "equal" else "a slow last stage"
    title = f"modelled pipeline, {what}: step time, median and min-max of {blocks} blocks"
    ax.set_title(title + _clip_note(stats, ceiling), fontsize=9)
    ax.legend(fontsize=8, loc="upper left", ncol=2)


def plot_sync_cost(results, path: Path, caption: str) -> list[str]:
    """From bench/agreement_cost.py's long table (part, pp, scenario, variant, rank, repeat, metric, value, ...),
    one panel per part it holds (a part the table lacks is left out, not drawn empty); medians with min-max bars.
    Part 1, the scheduler's mean step time by sync mode, per stage; part 2, the modelled pipeline: each stage's
    time in the agreement per step (equal stages), then the pipeline's step time by PP with equal stages and
    with a slow last stage (the lockstep a symmetric collective causes). Part 2's y axes are logarithmic and its
    whiskers stop at CLIP x a panel's largest median (`_ceiling`; the title says so where one does). `caption`:
    the caption line (`agreement_caption` of the benchmark's JSON). Returns the panels drawn."""
    steps = results[(results["part"] == "step_time") & (results["metric"] == "mean_step_ms_common")]
    pipe = results[results["part"] == "pipeline"] if "scenario" in results.columns else results.iloc[:0]
    panels = (["step_time"] if len(steps) else []) + (["stages", "equal", "slow_last"] if len(pipe) else [])
    if not panels:
        raise ValueError("no step_time or pipeline rows: nothing to plot")
    fig = plt.figure(figsize=(12.4, 8.6) if len(panels) > 1 else (6.2, 4.3))
    axes = _panel_axes(fig, panels)
    if "step_time" in axes:
        _step_time_panel(axes["step_time"], steps)
    if "stages" in axes:
        _stages_panel(axes["stages"], pipe)
    for scenario in ("equal", "slow_last"):
        if scenario in axes:
            _pipeline_panel(axes[scenario], pipe, scenario)
    for ax in axes.values():
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path, caption)
    return panels


def agreement_caption(report: dict) -> str:
    """The caption line of bench/agreement_cost.py's figures, from its JSON report (agreement_cost.json)."""
    a, m = report.get("args", {}), report.get("machine", {})
    return caption_line(
        f"part 1: {a.get('num_clients')} clients × {a.get('num_rounds')} rounds, {a.get('repeats')} repeats; part 2: "
        f"a modelled pipeline, {a.get('steps')} steps of {a.get('stage_ms')} ms a stage, {a.get('blocks')} blocks",
        f"part 1 --pp {a.get('pp')} --sync {'/'.join(a.get('sync_modes', []))}; part 2 PP "
        + ",".join(map(str, a.get("pp_sizes", []))),
        f"{m.get('processor', 'not recorded')}, {m.get('cpu_count')} CPUs, gloo, torch {m.get('torch')}",
    )
