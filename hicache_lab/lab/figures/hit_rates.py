"""Hit rates: by round, run by run in the colour of its deepest tier (`plot_hit_rates`); by tier, round by round
(`plot_hit_rate_by_tier`); and what the prefetch rate limit does to the storage tier (`plot_prefetch_rate_limit`)."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from .style import OTHER_COLORS, TIER_COLORS, rate_by_round, runs_caption, save_figure


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


def crash_round(summary: dict) -> int:
    """The round a crashed run was in: its last row's, or the next one where every client finished that round."""
    rows = summary["rounds"]
    if not rows:
        return 0
    clients = summary.get("config", {}).get("workload", {}).get("num_clients")
    return rows[-1]["round"] + (clients is not None and rows[-1]["requests"] >= clients)


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
            label = f"{label} (crashed in round {crash_round(summary)})"
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
        if summary["crashed"]:  # on the line where the round has a rate, else on the axis: none of it finished
            at = crash_round(summary)
            ax.plot(
                at,
                rates[-1] if rounds and rounds[-1] == at else 0,
                "x",
                color=OTHER_COLORS[1],
                ms=13,
                mew=2.5,
                clip_on=False,
            )
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
    rate_by_round(ax, "prompt tokens found in cache (%)")
    ax.legend(fontsize=8)
    save_figure(fig, path, runs_caption(summaries.values()))


TIER_ROWS = (
    ("cached_device", "device (L1)", TIER_COLORS["device"]),
    ("cached_host", "host (L2)", TIER_COLORS["host"]),
    ("cached_storage", "storage (L3)", TIER_COLORS["storage"]),
)


def _run_tiers(label: str, summary: dict) -> tuple:
    """The rows of TIER_ROWS a run has: down to its deepest tier (all three where that is not known)."""
    depth = {"device": 1, "host": 2, "storage": 3}.get(deepest_tier(label, summary), 3)
    return TIER_ROWS[:depth]


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
    order = [name for _, name, _ in TIER_ROWS if name in drawn] + ["infinite cache (bound)"]
    axes[0][0].legend([drawn[n] for n in order], order, fontsize=7, loc="center right")
    save_figure(fig, path, runs_caption(summaries.values()))


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
    held_back = "prefetches issued, what became of them,\nand those the rate limit held back (whole run)"
    middle.set_title(held_back, fontsize=9)
    middle.set_xticks(range(len(PREFETCH_COUNTERS)), [name for _, name in PREFETCH_COUNTERS], fontsize=7)
    middle.set_ylabel("prefetches")
    right.set_title("tokens read from storage,\nand used by a request", fontsize=9)
    right.set_xticks((0, 1), ["read into\nthe host", "found by a\nrequest (hits)"], fontsize=7)
    right.set_ylabel("tokens")
    for ax in (left, middle, right):
        ax.margins(y=0.15)
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path, runs_caption(summary for summary, _ in runs.values()))
