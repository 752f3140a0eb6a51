"""The lab beside SGLang: a run's hit rates beside bench_multiturn logs (`plot_against_sglang`, and
`compare_with_sglang` for `run --compare-sglang`, which prints them too), and the lab's cache beside SGLang's own
answering the same recorded operations (`plot_against_sglang_cache`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from ..sglang.replay import Replay
from .style import OTHER_COLORS, rate_by_round, runs_caption, save_figure

# The lab against SGLang: not tiers, so OTHER_COLORS (OTHER_COLORS[0] is too close to the black bound line)
LAB_COLOR, SGLANG_COLORS = OTHER_COLORS[1], (OTHER_COLORS[2], OTHER_COLORS[4], OTHER_COLORS[5], OTHER_COLORS[3])


def plot_against_sglang(summary: dict, sglang_rows: list[dict], path: Path) -> None:
    """Hit rate by round: this lab run (and its infinite-cache bound) beside SGLang bench_multiturn runs."""
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = summary["rounds"]
    rounds = [r["round"] for r in rows]
    ax.plot(rounds, [100 * r["hit_rate"] for r in rows], "o-", label="hicache_lab", ms=8, color=LAB_COLOR)
    ax.plot(rounds, [100 * r["upper_bound_hit_rate"] for r in rows], "k:", label="lab bound")
    for i, tag in enumerate(dict.fromkeys(r["tag"] for r in sglang_rows)):
        color = SGLANG_COLORS[i % len(SGLANG_COLORS)]
        mine = [r for r in sglang_rows if r["tag"] == tag and r["round"] is not None]
        if mine:
            rates = [100 * r["hit_rate"] for r in mine]
            ax.plot([r["round"] for r in mine], rates, "s--", label=f"SGLang: {tag}", color=color)
        else:  # a run without --enable-round-barrier reports one overall rate
            (overall,) = (r for r in sglang_rows if r["tag"] == tag)
            ax.axhline(100 * overall["hit_rate"], ls="--", lw=1, color=color, label=f"SGLang: {tag} (overall)")
    rate_by_round(ax, "prefix cache hit rate (%)")
    ax.legend(fontsize=8)
    save_figure(fig, path, runs_caption([summary]))


def plot_against_sglang_cache(runs: dict[str, tuple[dict, Replay]], path: Path) -> None:
    """One panel per configuration: hit rate by round as the lab's cache answered (solid line) and as
    SGLang's cache answered the same recorded operations (`replay.replay`: large hollow markers, dashed),
    with the infinite-cache bound. `runs` maps a title to (the run's summary, its replay)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.8), sharey=True, squeeze=False)
    for ax, (title, (summary, result)) in zip(axes[0], runs.items(), strict=True):
        rows = summary["rounds"]
        rounds = [r["round"] for r in rows]
        for name, hits, style in (
            ("lab", result.lab, {"ls": "-", "lw": 2.5, "color": LAB_COLOR}),
            ("SGLang", result.sglang, {"ls": "--", "lw": 1, "color": SGLANG_COLORS[0], "marker": "o", "ms": 11}),
        ):
            rates = [100 * (h.device + h.host) / r["prompt_tokens"] for h, r in zip(hits, rows, strict=False)]
            ax.plot(rounds[: len(rates)], rates, label=name, mfc="none", mew=1.8, clip_on=False, **style)
        ax.plot(rounds, [100 * r["upper_bound_hit_rate"] for r in rows], "k:", label="infinite cache")
        status = "every answer equal" if result.equal else f"{len(result.differences)} answers differ"
        status += "; the replay stopped" if result.stopped else ""
        replayed = f"{result.replayed} of {result.operations} cache operations replayed"
        ax.set_title(f"{title}: {status}\n({replayed})", fontsize=9)
        rate_by_round(ax, bottom=-3)  # a rate of 0 stays visible above the axis
    axes[0][0].set_ylabel("prefix cache hit rate (%)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    save_figure(fig, path, runs_caption(summary for summary, _ in runs.values()))


def compare_with_sglang(summary: dict, sglang: list[dict], log: str, figure: Path) -> None:
    """Print this run's hit rate per round beside a bench_multiturn log's rows, and plot them."""
    print(f"\nhit rate per round: this run vs {log}")
    tags = list(dict.fromkeys(r["tag"] for r in sglang))
    print("round    lab  " + "  ".join(f"{t[:14]:>14}" for t in tags))
    for row in summary["rounds"]:
        theirs = {r["tag"]: r["hit_rate"] for r in sglang if r["round"] == row["round"]}
        cells = "  ".join(f"{theirs[t]:14.1%}" if t in theirs else f"{'-':>14}" for t in tags)
        print(f"{row['round']:5} {row['hit_rate']:6.1%}  {cells}")
    plot_against_sglang(summary, sglang, figure)
    print(f"figure: {figure}")
