"""The figures: what each stage consumed, step by step, before and after the fix; hit rate by round."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..managers.step_trace import read_trace  # noqa: E402
from .conformance import Replay  # noqa: E402

# One colour per tier in every figure: the tier's share of a hit, a run whose deepest tier it is, a tree node
# that lives there. Nothing else is drawn in these three colours; other series take OTHER_COLORS.
TIER_COLORS = {"device": "#4c72b0", "host": "#dd8452", "storage": "#55a868"}
BOTH_TIERS_COLOR = "#8172b3"  # a tree node on the device with a host copy
OTHER_COLORS = ("#333333", "#c44e52", "#937860", "#8c8c8c", "#da8bc3", "#ccb974")


def _short(text: str, length: int) -> str:
    """`text`, cut to `length` characters with an ellipsis where it is longer."""
    return text if len(text) <= length else text[: length - 1] + "…"


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
        status = f"crashed: {_short(summary['error'], 70)}" if summary["crashed"] else "completed; all ranks agree"
        top.set_title(f"{title}\n{status}", fontsize=9)
        bottom.set_xlabel("scheduler step (iteration)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("acks consumed (cumulative)")
    axes[1][0].set_ylabel("difference from rank 0\n(shaded: trees differ)")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    axes[1][0].legend(fontsize=7, loc="lower left")
    save_figure(fig, path)


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
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    """One heat map per run: rank (rows) by scheduler step (columns), green where the rank's tree equals rank
    0's, red where it differs, blank where it has stopped. `runs` maps a title to (output dir, summary)."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 0.6 + 1.5 * len(runs)), squeeze=False)
    cmap = ListedColormap(["#d62728", "#2ca02c"])
    cmap.set_bad("white")
    for ax, (title, (out_dir, summary)) in zip(axes[:, 0], runs.items(), strict=True):
        ranks, steps, matrix = digest_agreement(read_trace(out_dir))
        ax.imshow(matrix, aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        first = summary["first_divergence"]
        status = f"first divergence: step {first['step']} ({first['quantity']})" if first else "ranks agree"
        if summary["crashed"]:
            status += f"; crashed: {_short(summary['error'], 60)}"
        ax.set_title(f"{title} — {status}", fontsize=9)
        ax.set_xlabel("scheduler step")
    handles = [Patch(color="#2ca02c", label="same tree as rank 0"), Patch(color="#d62728", label="differs")]
    axes[0][0].legend(handles=handles, fontsize=7, loc="upper right")
    save_figure(fig, path)


TIERS = (
    ("cached_device", "device (L1)", TIER_COLORS["device"]),
    ("cached_host", "host (L2)", TIER_COLORS["host"]),
    ("cached_storage", "storage (L3)", TIER_COLORS["storage"]),
)


def plot_hit_rate_by_tier(summaries: dict[str, dict], path: Path) -> None:
    """One panel per run: per round, the share of prompt tokens found on each tier (stacked), and the
    infinite-cache bound."""
    fig, axes = plt.subplots(1, len(summaries), figsize=(4 * len(summaries), 3.6), sharey=True, squeeze=False)
    for ax, (label, summary) in zip(axes[0], summaries.items(), strict=True):
        rows = summary["rounds"]
        rounds = [r["round"] for r in rows]
        bottom = [0.0] * len(rows)
        for key, name, color in TIERS:
            share = [100 * r[key] / r["prompt_tokens"] for r in rows]
            ax.bar(rounds, share, bottom=bottom, color=color, label=name)
            bottom = [b + s for b, s in zip(bottom, share, strict=True)]
        ax.plot(rounds, [100 * r["upper_bound_hit_rate"] for r in rows], "k:", marker=".", label="infinite cache")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("prompt tokens found in cache (%)")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    save_figure(fig, path)


NODE_COLORS = {"device": TIER_COLORS["device"], "device+host": BOTH_TIERS_COLOR, "host": TIER_COLORS["host"]}


def draw_tree(ax, tree, title: str = "", legend: bool = True) -> None:
    """The radix tree, root at the top: one box per node, coloured by tier; its first tokens, its length, and
    its lock count (a bold edge while locked)."""
    positions, leaves = {}, [0]

    def place(node, depth: int) -> float:
        children = sorted(node.children.values(), key=lambda n: n.key)
        if children:
            x = sum(place(c, depth + 1) for c in children) / len(children)
        else:
            x, leaves[0] = leaves[0], leaves[0] + 1
        positions[node.id] = (x, -depth)
        return x

    place(tree.root, 0)
    for node in tree.nodes():
        (x, y), (px, py) = positions[node.id], positions[node.parent.id]
        ax.plot([px, x], [py, y], color="0.6", lw=1, zorder=1)
    ax.annotate("root", positions[tree.root.id], ha="center", va="center", fontsize=8)
    for node in tree.nodes():
        state = "host" if node.evicted else ("device+host" if node.backuped else "device")
        label = f"{node.key[0]}…  {len(node.key)} tok" + (f"\nlock {node.lock_ref}" if node.lock_ref else "")
        box = {"boxstyle": "round", "fc": NODE_COLORS[state], "ec": "black", "lw": 2.5 if node.lock_ref else 0.5}
        ax.annotate(label, positions[node.id], ha="center", va="center", fontsize=7, color="white", bbox=box)
    xs = [x for x, _ in positions.values()]
    ax.set_xlim(min(xs) - 0.8, max(xs) + 0.8)
    ax.set_ylim(min(y for _, y in positions.values()) - 0.6, 0.5)
    ax.set_title(title, fontsize=9)
    ax.axis("off")
    if legend:
        ax.legend(handles=[Patch(color=c, label=s) for s, c in NODE_COLORS.items()], fontsize=7, loc="upper left")


def plot_sync_cost(results, path: Path) -> None:
    """From bench/agreement_cost.py's long table (part, pp, variant, metric, value, ...): left, scheduler step
    time by sync mode; right, microseconds per call of the relay, a barrier and an all-reduce as PP grows."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = results[(results["part"] == "step_time") & (results["metric"] == "mean_step_ms_common")]
    if len(steps):
        by_mode = steps.groupby("variant")["value"].median()
        left.bar(by_mode.index, by_mode.values, color=["#4c72b0", "#dd8452", "#55a868"][: len(by_mode)])
        left.set_ylabel("mean scheduler step (ms), median of runs")
        left.set_title("what the agreement costs per step (PP=2, same steps)", fontsize=9)
    prims = results[(results["part"] == "pp_agreement") & (results["metric"] == "us_per_call")]
    if len(prims):
        first = prims[prims["rank"] == 0].groupby(["variant", "pp"])["value"].median()
        for variant in first.index.get_level_values(0).unique():
            series = first[variant]
            right.plot(series.index, series.values, "o-", label=f"{variant} (rank 0)")
        right.set_xlabel("pipeline stages (PP)")
        right.set_ylabel("µs per call, median")
        right.set_xticks(sorted(prims["pp"].unique()))
        right.set_title("relay vs barrier vs all-reduce over the PP group", fontsize=9)
        right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


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
    save_figure(fig, path)


def plot_against_sglang_cache(runs: dict[str, tuple[dict, Replay]], path: Path) -> None:
    """One panel per configuration: hit rate by round as the lab's cache answered (solid line) and as
    SGLang's cache answered the same recorded operations (`conformance.replay`: large hollow markers, dashed),
    with the infinite-cache bound. `runs` maps a title to (the run's summary, its replay)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.8), sharey=True, squeeze=False)
    for ax, (title, (summary, result)) in zip(axes[0], runs.items(), strict=True):
        rows = summary["rounds"]
        rounds = [r["round"] for r in rows]
        for name, hits, style in (
            ("lab", result.lab, {"ls": "-", "lw": 2.5, "color": "#4c72b0"}),
            ("SGLang", result.sglang, {"ls": "--", "lw": 1, "color": "#dd8452", "marker": "o", "ms": 11}),
        ):
            rates = [100 * (h.device + h.host) / r["prompt_tokens"] for h, r in zip(hits, rows, strict=False)]
            ax.plot(rounds[: len(rates)], rates, label=name, mfc="none", mew=1.8, clip_on=False, **style)
        ax.plot(rounds, [100 * r["upper_bound_hit_rate"] for r in rows], "k:", label="infinite cache")
        status = "every answer equal" if result.equal else f"{len(result.differences)} answers differ"
        status += "; the replay stopped" if result.stopped else ""
        replayed = f"{result.replayed} of {result.operations} cache operations replayed"
        ax.set_title(f"{title}: {status}\n({replayed})", fontsize=9)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-3, 100)  # a rate of 0 stays visible above the axis
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("prefix cache hit rate (%)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    save_figure(fig, path)
