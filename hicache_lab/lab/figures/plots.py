"""The figures: what each stage consumed, step by step, before and after the fix; hit rate by round."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ...managers.step_trace import read_trace  # noqa: E402
from ..sglang.conformance import Replay  # noqa: E402

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


RANK_STYLES = (  # ranks' lines often coincide: each drawn narrower than the one before, on top of it
    {"color": OTHER_COLORS[3], "lw": 5.0, "alpha": 0.55},
    {"color": OTHER_COLORS[0], "lw": 1.6},
    {"color": OTHER_COLORS[4], "lw": 1.0},
)
DIFFER_SHADE = {"color": OTHER_COLORS[1], "alpha": 0.22, "lw": 0}  # steps at which the ranks' trees differ


def crash_what(error: str) -> str:
    """A short name for a forward-pass crash: the failing view of the received hidden states, or the first
    matmul on them; anything else: the exception's first words."""
    if m := re.search(r"shape '(\[[^\]]*\])' is invalid for input of size (\d+)", error or ""):
        return f"view as {m.group(1)} of {m.group(2)} values"
    if m := re.search(r"mat1 and mat2 shapes cannot be multiplied \((\w+) and (\w+)\)", error or ""):
        return f"matmul {m.group(1)} by {m.group(2)}"
    return _short(error or "crashed", 40)


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
        summary = _with_crash_step(summary, rows)
        top, bottom = axes[0][col], axes[1][col]
        digests: dict[int, set[str]] = {}
        for r in rows:
            digests.setdefault(r["step"], set()).add(r["digest"])
        for step, seen in digests.items():
            if len(seen) > 1:
                for ax in (top, bottom):
                    ax.axvspan(step, step + 1, **DIFFER_SHADE)
        for quantity, style in (("acks_write", "-"), ("acks_load", "--")):
            totals = _cumulative(rows, quantity)
            for rank, series in sorted(totals.items()):
                ranks_seen.add(rank)
                look = {**RANK_STYLES[min(rank, len(RANK_STYLES) - 1)], "ls": style}
                top.step(range(len(series)), series, where="post", **look)
                if rank:
                    gap = [a - b for a, b in zip(series, totals[0], strict=False)]
                    bottom.step(range(len(gap)), gap, where="post", **look)
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
        if summary["crash_step"] is not None:
            bottom.plot([summary["crash_step"]], [0], "X", color=OTHER_COLORS[1], ms=9, label="crash")
        status = crash_label(summary) if summary["crashed"] else "completed; all ranks agree"
        top.set_title(f"{title}\n{status}", fontsize=9)
        bottom.set_xlabel("scheduler step (iteration)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].set_ylabel("acks consumed (cumulative)")
    axes[1][0].set_ylabel("rank's count − rank 0's")
    handles = [
        Line2D([], [], **RANK_STYLES[min(rank, len(RANK_STYLES) - 1)], label=f"rank {rank}")
        for rank in sorted(ranks_seen)
    ]
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
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def deepest_tier(label: str, summary: dict | None = None) -> str | None:
    """A run's deepest cache tier ("device", "host" or "storage"): from its summary's config where it has one,
    else from a label that names the tiers ("L1 only", "L1 + L2, fixed sync", "L1 + L2 + L3"); None if neither
    says."""
    cache = (summary or {}).get("config", {}).get("cache")
    if cache:
        if cache.get("storage_backend", "none") != "none":
            return "storage"
        return "host" if cache.get("enable_hierarchical_cache") else "device"
    for tier, name in (("storage", "L3"), ("host", "L2"), ("device", "L1")):
        if re.search(rf"\b{name}\b", label):
            return tier
    return None


RUN_STYLES = (("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"))  # (marker, line) of the runs sharing a colour


def plot_hit_rates(summaries: dict[str, dict], path: Path) -> None:
    """Hit rate by round for each run, in the colour of its deepest tier (runs of the same tier differ in marker
    and line style; a run whose tiers are not known takes OTHER_COLORS), with the infinite-cache bound. A
    crashed run ends where it crashed, with a red x there."""
    fig, ax = plt.subplots(figsize=(7, 4))
    bound, used, others = None, {}, iter(OTHER_COLORS[2:])
    for i, (label, summary) in enumerate(summaries.items()):  # each narrower than the one before: lines coincide
        rows = summary["rounds"]
        tier = deepest_tier(label, summary)
        color = TIER_COLORS[tier] if tier else next(others)
        marker, line = RUN_STYLES[used.get(color, 0) % len(RUN_STYLES)]
        used[color] = used.get(color, 0) + 1
        if summary["crashed"]:
            label = f"{label} (crashed in round {rows[-1]['round'] if rows else 0})"
        rounds, rates = [r["round"] for r in rows], [100 * r["hit_rate"] for r in rows]
        ax.plot(
            rounds,
            rates,
            marker=marker,
            ls=line,
            color=color,
            label=label,
            ms=max(9 - 2 * i, 4),
            lw=max(2.6 - 0.6 * i, 1),
        )
        if summary["crashed"] and rows:
            ax.plot(rounds[-1], rates[-1], "x", color=OTHER_COLORS[1], ms=13, mew=2.5)
        bound = bound or rows
    if bound:
        rounds = [r["round"] for r in bound]
        ax.plot(
            rounds,
            [100 * r["upper_bound_hit_rate"] for r in bound],
            ":",
            color=OTHER_COLORS[0],
            label="infinite cache (bound)",
        )
    ax.set_title("prefix cache hit rate by round", fontsize=10)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("prompt tokens found in cache (%)")
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


TIERS = (
    ("cached_device", "device (L1)", TIER_COLORS["device"]),
    ("cached_host", "host (L2)", TIER_COLORS["host"]),
    ("cached_storage", "storage (L3)", TIER_COLORS["storage"]),
)


def _run_tiers(label: str, summary: dict) -> tuple:
    """The rows of TIERS a run has: down to its deepest tier (all three where that is not known)."""
    depth = {"device": 1, "host": 2, "storage": 3}.get(deepest_tier(label, summary), 3)
    return TIERS[:depth]


def plot_hit_rate_by_tier(summaries: dict[str, dict], path: Path) -> None:
    """One panel per run, titled in the colour of its deepest tier: per round, the share of prompt tokens found
    on each tier it has (stacked; the total above each bar), and the infinite-cache bound. A tier the run has
    but that found nothing in any round is not drawn: a note in the panel says so."""
    fig, axes = plt.subplots(1, len(summaries), figsize=(4.2 * len(summaries), 3.9), sharey=True, squeeze=False)
    drawn = {}
    for ax, (label, summary) in zip(axes[0], summaries.items(), strict=True):
        rows = summary["rounds"]
        rounds = [r["round"] for r in rows]
        bottom = [0.0] * len(rows)
        notes = []
        for key, name, color in _run_tiers(label, summary):
            share = [100 * r[key] / r["prompt_tokens"] for r in rows]
            if not any(share):
                notes.append(f"{name}: 0 tokens in every round")
                continue
            drawn[name] = ax.bar(rounds, share, bottom=bottom, color=color, label=name)
            bottom = [b + s for b, s in zip(bottom, share, strict=True)]
        for x, total in zip(rounds, bottom, strict=True):
            ax.annotate(f"{total:.0f}%", (x, total), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
        (drawn["infinite cache (bound)"],) = ax.plot(
            rounds, [100 * r["upper_bound_hit_rate"] for r in rows], ":", color=OTHER_COLORS[0], marker="."
        )
        if notes:
            ax.text(0.02, 0.97, "\n".join(notes), transform=ax.transAxes, va="top", fontsize=7, color=OTHER_COLORS[0])
        tier = deepest_tier(label, summary)
        ax.set_title(label, fontsize=10, color=TIER_COLORS[tier] if tier else OTHER_COLORS[0], fontweight="bold")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("prompt tokens found in cache (%)")
    order = [name for _, name, _ in TIERS if name in drawn] + ["infinite cache (bound)"]
    axes[0][0].legend([drawn[n] for n in order], order, fontsize=7, loc="center right")
    save_figure(fig, path)


PREFETCH_COUNTERS = (  # (StorageTier.summary() key, what it counts)
    ("prefetches", "issued"),
    ("revoked", "revoked:\nstorage had\n< threshold"),
    ("rate_limited", "rate-limited:\nnever issued"),
    ("no_host_room", "no host room"),
    ("cut_short", "cut short\n(timeout)"),
)


def plot_prefetch_rate_limit(runs: dict[str, tuple[dict, dict]], path: Path) -> None:
    """The same L1 + L2 + L3 workload under different prefetch rate limits. `runs` maps a label to (summary,
    storage counters: rank 0's `storage` record). Left: per round, the share of prompt tokens found on storage;
    middle: what became of the prefetches (counts); right: tokens read from storage and tokens of those a
    request used. Every bar is labelled with its value; the runs are all storage runs, told apart by hatching."""
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1.1, 1.5, 0.8]})
    width = 0.8 / len(runs)
    hatches = ("", "//", "..", "xx")

    def bars(ax, xs, values, i, label=None, fmt="{:.0f}"):
        offset = [x + (i - (len(runs) - 1) / 2) * width for x in xs]
        style = {"color": TIER_COLORS["storage"], "alpha": 1.0 - 0.35 * i, "hatch": hatches[i % 4], "ec": "white"}
        drawn = ax.bar(offset, values, width, label=label, **style)
        for x, v in zip(offset, values, strict=True):
            ax.annotate(fmt.format(v), (x, v), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
        return drawn

    for i, (label, (summary, counters)) in enumerate(runs.items()):
        rows = summary["rounds"]
        rounds = [r["round"] for r in rows]
        bars(left, rounds, [100 * r["cached_storage"] / r["prompt_tokens"] for r in rows], i, label, "{:.1f}")
        bars(middle, range(len(PREFETCH_COUNTERS)), [counters.get(k, 0) for k, _ in PREFETCH_COUNTERS], i)
        page = summary["config"]["cache"]["page_size"]
        used = sum(r["cached_storage"] for r in rows)
        bars(right, (0, 1), [page * counters.get("pages_read", 0), used], i)
    left.set_title("prompt tokens found on storage, per round", fontsize=9)
    left.set_xlabel("round")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_ylabel("share of the round's prompt tokens (%)")
    left.legend(fontsize=8, loc="upper left")
    middle.set_title("what became of the prefetches (whole run)", fontsize=9)
    middle.set_xticks(range(len(PREFETCH_COUNTERS)), [name for _, name in PREFETCH_COUNTERS], fontsize=7)
    middle.set_ylabel("prefetches")
    right.set_title("tokens read from storage,\nand used by a request", fontsize=9)
    right.set_xticks((0, 1), ["read into\nthe host", "found by a\nrequest (hits)"], fontsize=7)
    right.set_ylabel("tokens")
    for ax in (left, middle, right):
        ax.margins(y=0.15)
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


NODE_COLORS = {"device": TIER_COLORS["device"], "device+host": BOTH_TIERS_COLOR, "host": TIER_COLORS["host"]}
NODE_LEGEND = {
    "device": "device only (L1): evicting deletes it",
    "device+host": "device + host copy (L1 + L2): evicting keeps the host copy",
    "host": "host only (L2): loaded back before use",
}
TREE_LEAF_WIDTH, TREE_LEVEL_HEIGHT = 2.3, 1.05  # inches per leaf and per level of a tree drawing


@dataclass(frozen=True)
class TreeDrawing:
    """What `draw_tree` draws, taken from a tree at one moment (the tree itself keeps changing): per node its
    position (x in leaves, y = -depth), label, tier state and lock count."""

    nodes: tuple[tuple[float, float, str, str, int], ...]  # x, y, label, state, lock_ref
    edges: tuple[tuple[float, float, float, float], ...]  # parent x, y, child x, y
    leaves: int
    depth: int
    root_x: float


def tree_drawing(tree, first_tokens: int = 3) -> TreeDrawing:
    """The tree as it is now: one box per node with its first tokens, its length, its tier and its lock."""
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
    nodes, edges = [], []
    for node in tree.nodes():
        (x, y), (px, py) = positions[node.id], positions[node.parent.id]
        edges.append((px, py, x, y))
        state = "host" if node.evicted else ("device+host" if node.backuped else "device")
        head = " ".join(map(str, node.key[:first_tokens])) + (" …" if len(node.key) > first_tokens else "")
        label = f"{head}\n{len(node.key)} tokens · {state}"
        label += f"\nlocked (lock_ref {node.lock_ref})" if node.lock_ref else ""
        nodes.append((x, y, label, state, node.lock_ref))
    depth = -min((y for _, y in positions.values()), default=0)
    return TreeDrawing(tuple(nodes), tuple(edges), max(leaves[0], 1), int(depth), positions[tree.root.id][0])


def tree_figsize(drawing: TreeDrawing, legend: bool = True) -> tuple[float, float]:
    """A canvas sized to the tree: TREE_LEAF_WIDTH per leaf, TREE_LEVEL_HEIGHT per level, room for the title
    and the legend."""
    return max(TREE_LEAF_WIDTH * drawing.leaves, 4.2 if legend else 2.5), TREE_LEVEL_HEIGHT * (drawing.depth + 1) + (
        1.9 if legend else 0.8
    )


def draw_tree(ax, tree, title: str = "", legend: bool = True) -> None:
    """The radix tree (or a `tree_drawing` of it), root at the top: one box per node, coloured by tier
    (NODE_COLORS); its first tokens, its length, its tier, and its lock count (a bold edge while locked)."""
    drawing = tree if isinstance(tree, TreeDrawing) else tree_drawing(tree)
    for px, py, x, y in drawing.edges:
        ax.plot([px, x], [py, y], color="0.6", lw=1.2, zorder=1)
    ax.annotate("root", (drawing.root_x, 0), ha="center", va="center", fontsize=10)
    for x, y, label, state, lock_ref in drawing.nodes:
        text = "black" if state == "host" else "white"  # white on orange is hard to read
        box = {"boxstyle": "round,pad=0.35", "fc": NODE_COLORS[state], "ec": "black", "lw": 3 if lock_ref else 0.6}
        ax.annotate(label, (x, y), ha="center", va="center", fontsize=9.5, color=text, bbox=box, zorder=2)
    ax.set_xlim(-0.55, drawing.leaves - 0.45)
    ax.set_ylim(-drawing.depth - 0.5, 0.35)
    ax.set_title(title, fontsize=10.5)
    ax.axis("off")
    if legend:
        ax.legend(handles=tree_legend(), fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, 0), frameon=False)


def tree_legend() -> list[Patch]:
    """The tree drawings' legend: the three tier states and the bold edge of a locked node."""
    handles = [Patch(fc=NODE_COLORS[state], ec="none", label=text) for state, text in NODE_LEGEND.items()]
    return [*handles, Patch(fc="white", ec="black", lw=3, label="bold edge: locked (lock_ref > 0), not evictable")]


def plot_tree(tree, title: str = "", legend: bool = True):
    """A figure sized to the tree with `draw_tree` in it (for a notebook: show it, or save_figure it)."""
    drawing = tree if isinstance(tree, TreeDrawing) else tree_drawing(tree)
    fig, ax = plt.subplots(figsize=tree_figsize(drawing, legend))
    draw_tree(ax, drawing, title, legend)
    fig.tight_layout()
    return fig


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


def _errorbar(ax, xs, stats, **style) -> None:
    """Medians with min-max bars."""
    low, high = stats["median"] - stats["min"], stats["max"] - stats["median"]
    ax.errorbar(xs, stats["median"], yerr=[low, high], capsize=3, **style)


def plot_sync_cost(results, path: Path) -> list[str]:
    """From bench/agreement_cost.py's long table (part, pp, scenario, variant, rank, repeat, metric, value, ...),
    one panel per part it holds (a part the table lacks is left out, not drawn empty); medians with min-max bars.
    Part 1, the scheduler's mean step time by sync mode, per stage; part 2, the modelled pipeline: each stage's
    time in the agreement per step (equal stages), then the pipeline's step time by PP with equal stages and
    with a slow last stage (the lockstep a symmetric collective causes). Returns the panels drawn."""
    steps = results[(results["part"] == "step_time") & (results["metric"] == "mean_step_ms_common")]
    pipe = results[results["part"] == "pipeline"] if "scenario" in results.columns else results.iloc[:0]
    panels = (["step_time"] if len(steps) else []) + (["stages", "equal", "slow_last"] if len(pipe) else [])
    if not panels:
        raise ValueError("no step_time or pipeline rows: nothing to plot")
    fig = plt.figure(figsize=(12.4, 8.6) if len(panels) > 1 else (6.2, 4.3))
    grid = fig.add_gridspec(2 if len(panels) > 1 else 1, 2 if len(panels) > 1 else 1)
    cells = {
        4: [grid[0, 0], grid[0, 1], grid[1, 0], grid[1, 1]],
        3: [grid[0, :], grid[1, 0], grid[1, 1]],
        1: [grid[0, 0]],
    }
    axes = {name: fig.add_subplot(cell) for name, cell in zip(panels, cells[len(panels)], strict=True)}
    if "step_time" in axes:
        ax, world = axes["step_time"], int(steps["rank"].max()) + 1
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
            f"lab scheduler, PP={int(steps['pp'].iloc[0])}, same steps: median, min-max and every one of "
            f"{repeats} repeats",
            fontsize=9,
        )
        ax.set_ylim(0, 1.25 * ax.get_ylim()[1])  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    if "stages" in axes:
        ax = axes["stages"]
        agree = pipe[(pipe["scenario"] == "equal") & (pipe["metric"] == "agree_us_per_step")]
        variants = [v for v in ("relay", "barrier", "all_reduce") if v in set(agree["variant"])]
        stats = _spread(agree, ["pp", "rank", "variant"])
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
            _errorbar(ax, xs, rows, fmt="none", ecolor="black", lw=0.8)
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
        ax.set_ylabel("µs per step in the agreement")
        ax.set_title(
            "equal stages: each stage's time in the agreement (mostly waiting)\n"
            "relay: stage 0 drains + isends, later stages wait in the recv",
            fontsize=9,
        )
        ax.legend(fontsize=8, loc="upper left")
    for scenario in ("equal", "slow_last"):
        if scenario not in axes:
            continue
        ax = axes[scenario]
        mine = pipe[(pipe["scenario"] == scenario) & (pipe["metric"] == "step_ms")]
        last = mine[mine["rank"] == mine["pp"] - 1]
        stats = _spread(last, ["variant", "pp"])
        pps = sorted(last["pp"].unique())
        for j, variant in enumerate(v for v in SYNC_VARIANT_COLORS if v in set(last["variant"])):
            rows = stats.loc[variant].loc[pps]
            xs = [p + (j - 1.5) * 0.06 for p in pps]  # side by side, so the bars do not hide each other
            _errorbar(ax, xs, rows, fmt="o-", color=SYNC_VARIANT_COLORS[variant], label=variant, ms=4, lw=1.5)
        forward = pipe[(pipe["scenario"] == scenario) & (pipe["metric"] == "forward_ms")].groupby("pp")["value"]
        if len(forward.groups):
            ax.plot(pps, forward.max().loc[pps], ":", color="black", lw=1, label="the slowest stage's forward")
            ax.plot(pps, forward.sum().loc[pps], "--", color="black", lw=1, label="every stage's forward in a row")
        ax.set_xticks(pps)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("pipeline stages (PP)")
        ax.set_ylabel("pipeline step (ms, last stage)")
        ax.set_ylim(0, 1.4 * ax.get_ylim()[1])  # room for the legend above the lines
        blocks = last["repeat"].nunique()
        what = "equal stages" if scenario == "equal" else "a slow last stage"
        ax.set_title(f"modelled pipeline, {what}: step time, median and min-max of {blocks} blocks", fontsize=9)
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    for ax in axes.values():
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)
    return panels


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
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-3, 100)  # a rate of 0 stays visible above the axis
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("prefix cache hit rate (%)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    save_figure(fig, path)
