"""The figures: what each stage consumed, step by step, before and after the fix; hit rate by round."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from .trace import read_trace  # noqa: E402


def _cumulative(rows: list[dict], quantity: str) -> dict[int, list[int]]:
    """Per rank: the running total of `quantity` at each step."""
    totals: dict[int, list[int]] = {}
    for r in sorted(rows, key=lambda r: (r["rank"], r["step"])):
        series = totals.setdefault(r["rank"], [])
        series.append((series[-1] if series else 0) + r[quantity])
    return totals


def plot_queue_divergence(runs: dict[str, tuple[Path, dict]], path: Path) -> None:
    """One column per run (e.g. legacy, fixed). Top: write and load acks each rank consumed, cumulative.
    Bottom: how far each rank is from rank 0, with the steps at which the trees differ shaded.

    `runs` maps a title to (output directory, summary). The first divergent step is marked in red.
    """
    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 6), sharex="col", sharey="row", squeeze=False)
    for col, (title, (out_dir, summary)) in enumerate(runs.items()):
        rows = read_trace(out_dir)
        top, bottom = axes[0][col], axes[1][col]
        for quantity, style in (("acks_write", "-"), ("acks_load", "--")):
            totals = _cumulative(rows, quantity)
            for rank, series in totals.items():
                label = f"rank {rank} {quantity.split('_')[1]} acks"
                top.step(range(len(series)), series, style, where="post", label=label)
                if rank:
                    gap = [a - b for a, b in zip(series, totals[0], strict=False)]
                    bottom.step(range(len(gap)), gap, style, where="post", label=f"rank {rank} − rank 0, {quantity}")
        digests: dict[int, set[str]] = {}
        for r in rows:
            digests.setdefault(r["step"], set()).add(r["digest"])
        for step, seen in digests.items():
            if len(seen) > 1:
                bottom.axvspan(step, step + 1, color="red", alpha=0.08, lw=0)
        first = summary["first_divergence"]
        if first:
            for ax in (top, bottom):
                ax.axvline(first["step"], color="red", lw=1)
            top.annotate(
                f"first divergence: step {first['step']} ({first['quantity']})",
                (first["step"], 0),
                xytext=(5, 10),
                textcoords="offset points",
                color="red",
                fontsize=8,
            )
        status = f"crashed: {summary['error'][:70]}" if summary["crashed"] else "completed; all ranks agree"
        top.set_title(f"{title}\n{status}", fontsize=9)
        bottom.set_xlabel("scheduler step (iteration)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("acks consumed (cumulative)")
    axes[1][0].set_ylabel("difference from rank 0\n(shaded: trees differ)")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    axes[1][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hit_rates(summaries: dict[str, dict], path: Path) -> None:
    """Hit rate by round for each run (a crashed run ends where it crashed), with the infinite-cache bound."""
    fig, ax = plt.subplots(figsize=(7, 4))
    bound = None
    for label, summary in summaries.items():
        rows = summary["rounds"]
        style = "o-"
        if summary["crashed"]:
            label, style = f"{label} (crashed in round {rows[-1]['round'] if rows else 0})", "x--"
        ax.plot([r["round"] for r in rows], [100 * r["hit_rate"] for r in rows], style, label=label, ms=8)
        bound = bound or rows
    if bound:
        rounds = [r["round"] for r in bound]
        ax.plot(rounds, [100 * r["upper_bound_hit_rate"] for r in bound], "k:", label="infinite cache (bound)")
    ax.set_xlabel("round")
    ax.set_ylabel("prefix cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_against_sglang(summary: dict, sglang_rows: list[dict], path: Path) -> None:
    """Hit rate by round: this lab run (and its infinite-cache bound) beside SGLang bench_multiturn runs."""
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = summary["rounds"]
    ax.plot([r["round"] for r in rows], [100 * r["hit_rate"] for r in rows], "o-", label="hicache_lab", ms=8)
    ax.plot([r["round"] for r in rows], [100 * r["upper_bound_hit_rate"] for r in rows], "k:", label="lab bound")
    for tag in dict.fromkeys(r["tag"] for r in sglang_rows):
        mine = [r for r in sglang_rows if r["tag"] == tag and r["round"] is not None]
        if mine:
            ax.plot([r["round"] for r in mine], [100 * r["hit_rate"] for r in mine], "s--", label=f"SGLang: {tag}")
        else:  # a run without --enable-round-barrier reports one overall rate
            (overall,) = (r for r in sglang_rows if r["tag"] == tag)
            ax.axhline(100 * overall["hit_rate"], ls="--", lw=1, color="gray", label=f"SGLang: {tag} (overall)")
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("prefix cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
