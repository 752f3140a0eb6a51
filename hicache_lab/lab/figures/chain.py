"""The causal chain of a legacy run, in words and drawn: each link in one line (`describe`) and in its stages' lanes
(`lane_labels`), a crash's short name (`crash_what`), the figure (`draw_chain`; `chain_figure` finds the chain in
a run's output directory and draws it: figures/causal_chain.png, notebook 02). The chain and what the strip above
it shows are found in teach/chain.py, as numbers."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch
from matplotlib.ticker import MaxNLocator

from ...managers.step_trace import read_trace
from ..teach.chain import Link, ahead_at, differing_steps, find_chain, healed_steps
from .style import OTHER_COLORS, runs_caption, save_figure

ACCENT = OTHER_COLORS[1]  # the stage a link happened on (red); the others are drawn in grey
PHASE_TITLES = {  # each link's row, on the left
    "ack": "ack consumed",
    "unlock": "node unlocked",
    "admit": "prefix match / admission",
    "evict": "eviction",
    "batch": "batch",
    "crash": "crash",
}


def _short(text: str, length: int) -> str:
    """`text`, cut to `length` characters with an ellipsis where it is longer."""
    return text if len(text) <= length else text[: length - 1] + "…"


def crash_what(error: str) -> str:
    """A short name for a forward-pass crash: the failing view of the received hidden states, or the first
    matmul on them; anything else: the exception's first words."""
    if m := re.search(r"shape '(\[[^\]]*\])' is invalid for input of size (\d+)", error or ""):
        return f"view as {m.group(1)} of {m.group(2)} values"
    if m := re.search(r"mat1 and mat2 shapes cannot be multiplied \((\w+) and (\w+)\)", error or ""):
        return f"matmul {m.group(1)} by {m.group(2)}"
    return _short(error or "crashed", 40)


def describe(link: Link) -> str:
    """The link in one line, with its numbers (notebook 02 prints the chain so)."""
    return WORDS[link.what](link)[0]


def lane_labels(link: Link) -> dict[int, str]:
    """What each stage's lane says at this link (a stage left out shows nothing there)."""
    return WORDS[link.what](link)[1]


def _ack_words(link: Link) -> tuple[str, dict[int, str]]:
    at = link.per_stage
    text = "acks consumed (write, load): " + ", ".join(
        f"stage {k} {(n['acks_write'], n['acks_load'])}" for k, n in at.items()
    )
    lanes = {
        k: f"consumed {n['acks_write']} write, {n['acks_load']} load ack(s)\n"
        f"(its own poll: {n['ready_write']} write ready)"
        for k, n in at.items()
    }
    return text, lanes


def _unlock_words(link: Link) -> tuple[str, dict[int, str]]:
    node, tokens = link.node, link.tokens
    text = f"node {node} ({tokens} tokens) unlocked on stage {', '.join(map(str, link.ahead))} only"
    lanes = {
        k: f"node {node} unlocked: its {tokens} tok\nnow count as evictable room"
        if n["unlocked"]
        else f"node {node} still locked\n(its ack not consumed yet)"
        for k, n in link.per_stage.items()
    }
    return text, lanes


def _evict_words(link: Link) -> tuple[str, dict[int, str]]:
    at = link.per_stage
    text = "device evictions: " + ", ".join(
        f"stage {k} {len(n['evicted'])} nodes ({sum(n['evicted'].values())} tokens)" for k, n in at.items()
    )
    if link.node is not None:
        text += f"; node {link.node} on stage {link.ahead[0]} only"
    lanes = {}
    for k, n in at.items():
        count, tokens, extra = len(n["evicted"]), sum(n["evicted"].values()), n["unmatched"]
        shown = ", ".join(map(str, extra[:3])) + (", …" if len(extra) > 3 else "")
        lanes[k] = f"evicted {count} node{'s' * (count != 1)} ({tokens} tok)" + (
            f"\n{len(extra)} not on the other stage: {shown}" if extra else ""
        )
    return text, lanes


def _admit_words(link: Link) -> tuple[str, dict[int, str]]:
    rid, at = link.request, link.per_stage
    text = f"request {rid}: " + ", ".join(
        f"stage {k} " + (f"prefix {n['prefix']}" if n else "not admitted") for k, n in at.items()
    )
    lanes = {
        k: f"request {rid}: {n['prefix']} cached + {n['extend']} new tok" if n else f"request {rid} not admitted"
        for k, n in at.items()
    }
    return text, lanes


def _batch_words(link: Link) -> tuple[str, dict[int, str]]:
    at = link.per_stage
    text = "batches: " + "; ".join(
        f"stage {k} {n['kind']} {n['requests']} ({n['extend_tokens']} new, {n['prefix_tokens']} cached tokens)"
        for k, n in at.items()
    )
    lanes = {
        k: f"{n['kind']} {n['requests']}\n{n['extend_tokens']} new, {n['prefix_tokens']} cached tok"
        for k, n in at.items()
    }
    return text, lanes


def _crash_words(link: Link) -> tuple[str, dict[int, str]]:
    """The crash, and the lanes of the stage that sent the hidden states and of the one that received them: how
    the received rows were viewed, and why that failed."""
    failing, (hidden, heads), lanes = link.stages[0], link.model, {}
    sent = link.per_stage.get(failing - 1, {}).get("rows")
    if sent is not None and hidden:
        lanes[failing - 1] = f"sends {sent} rows × {hidden} to stage {failing}" + (
            "\n(it ran nothing)" if not sent else ""
        )
    if failing in link.per_stage:
        n, label = link.per_stage[failing]["rows"], crash_what(link.error)
        size = re.search(r"input of size (\d+)", link.error or "")
        if sent is not None and hidden and heads and size and label.startswith("view"):
            d = hidden // heads
            label = (
                f"views {size.group(1)} = {sent} × {hidden} values as [{n}, -1, {d}]:\n"
                f"not a multiple of {n} × {d} = {n * d}: the view fails"
            )
        if sent is not None and not sent and label.startswith("matmul") and heads:
            label = (
                f"views 0 values as [{n}, -1, {hidden // heads}]: legal (-1 is 0);\nits first matmul fails: {label[7:]}"
            )
        lanes[failing] = f"with its own {n} rows, it\n{label}"
    return f"stage {failing} crashed: {link.error}", lanes


WORDS = {  # what: the link in one line, and each stage's lane
    "ack": _ack_words,
    "unlock": _unlock_words,
    "admit": _admit_words,
    "evict": _evict_words,
    "batch": _batch_words,
    "crash": _crash_words,
}


def _draw_strip(top, links: list[Link], rows: list[dict], ranks: list[int], title: str) -> None:
    """Every step to the crash: a tick where a stage consumed more acks than the other (grey: healed; red: the
    chain's first link), shaded where the stages' trees differ, the crash marked."""
    last = max((r["step"] for r in rows), default=0)
    first = links[0].step
    healed, longest = healed_steps(rows, first)
    for s in differing_steps(rows):
        top.axvspan(s - 0.5, s + 0.5, color=ACCENT, alpha=0.12, lw=0)
    ahead = ahead_at(rows, healed)
    for i, k in enumerate(ranks):
        mine = ahead[k]
        top.scatter(mine, [i] * len(mine), marker="|", s=120, color="0.55", lw=2)
        if k in links[0].stages:
            top.scatter([first], [i], marker="|", s=220, color=ACCENT, lw=3)
    crash = next((link for link in links if link.what == "crash"), None)
    if crash is not None:  # just above the stage's row: the chain's tick may be at the same step
        y = ranks.index(crash.stages[0]) - 0.38
        top.scatter([crash.step], [y], marker="v", s=60, color=ACCENT, zorder=3)
        top.annotate(
            "crash",
            (crash.step, y),
            xytext=(-6, 0),
            textcoords="offset points",
            ha="right",
            va="center",
            fontsize=8,
            color=ACCENT,
        )
    top.set_yticks(range(len(ranks)), [f"stage {k}" for k in ranks])
    top.set_ylim(len(ranks) - 0.5, -0.7)
    top.set_xlim(-1, last + 2)
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_xlabel("scheduler step", fontsize=8, labelpad=1)
    top.tick_params(labelsize=8)
    top.grid(alpha=0.3, axis="x")
    top.set_title(
        (f"{title}\n" if title else "")
        + "a tick: the stage consumed more acks than the other in that step; shaded: their trees differ\n"
        f"grey: {len(healed)} steps before step {first}, each healed within {longest} step{'s' * (longest != 1)}; "
        "red: the one that did not heal, drawn below",
        fontsize=8.5,
    )


def _draw_lanes(bottom, links: list[Link], ranks: list[int]) -> None:
    """The chain: one row per link, one lane per stage; the lane where a link happened is red, and arrows follow
    the chain to the crash."""
    n, labels = len(links), [lane_labels(link) for link in links]
    lane_x = {k: 0.19 + 0.81 * (i + 0.5) / len(ranks) for i, k in enumerate(ranks)}
    row_y = [1 - (j + 0.5) / n for j in range(n)]
    bottom.set_xlim(0, 1)
    bottom.set_ylim(0, 1)
    bottom.axis("off")
    for k in ranks:
        bottom.text(lane_x[k], 1.02, f"stage {k}", ha="center", va="bottom", fontsize=9, weight="bold")
    for j, link in enumerate(links):
        bottom.text(
            0.0,
            row_y[j],
            f"step {link.step}\n" + PHASE_TITLES[link.what].replace(" / ", " /\n"),
            ha="left",
            va="center",
            fontsize=9,
        )
        for k in ranks:
            if labels[j].get(k):
                _draw_box(bottom, (lane_x[k], row_y[j]), labels[j][k], hit=k in link.stages)
        arrows = []  # down each lane where this link happened, from the lane's box above (else the link above's)
        for k in link.stages if j else ():
            src = k if labels[j - 1].get(k) else links[j - 1].stages[0]
            arrows.append(((lane_x[src], row_y[j - 1] - 0.36 / n), (lane_x[k], row_y[j] + 0.36 / n)))
        if link.what == "crash" and labels[j].get(link.stages[0] - 1):  # the hidden states it received
            arrows.append(((lane_x[link.stages[0] - 1] + 0.13, row_y[j]), (lane_x[link.stages[0]] - 0.17, row_y[j])))
        for start, end in arrows:
            bottom.add_patch(
                FancyArrowPatch(
                    start, end, arrowstyle="-|>", mutation_scale=10, color=ACCENT, lw=1.2, transform=bottom.transAxes
                )
            )


def _draw_box(bottom, at: tuple[float, float], text: str, hit: bool) -> None:
    """One stage's label at one link: red where the link happened there, grey elsewhere."""
    bottom.text(
        *at,
        "\n".join(textwrap.fill(part, 54) for part in text.split("\n")),
        ha="center",
        va="center",
        fontsize=8,
        color="black" if hit else "0.35",
        bbox={
            "boxstyle": "round,pad=0.35",
            "fc": "#f6dcdc" if hit else "#f2f2f2",
            "ec": ACCENT if hit else "0.7",
            "lw": 1.4 if hit else 0.6,
        },
    )


def draw_chain(links: list[Link], rows: list[dict], summary: dict, path: Path, title: str = "") -> None:
    """Top: every step to the crash, with the steps at which the stages consumed different ack counts (grey:
    healed; red: the chain's). Below: the chain, one row per link, one lane per stage; the lane where a link
    happened is red, and arrows follow the chain to the crash."""
    ranks = sorted({r["rank"] for r in rows})
    fig = plt.figure(figsize=(9.5, 1.9 + 0.9 * max(len(links), 1)))
    top, bottom = fig.subplots(2, 1, height_ratios=[1.3, 0.95 * max(len(links), 1)])
    if not links:
        top.text(0.5, 0.5, "no chain: the stages' batches never differ", ha="center", transform=top.transAxes)
        bottom.axis("off")
        top.set_title(title, fontsize=10)
    else:
        _draw_strip(top, links, rows, ranks, title)
        _draw_lanes(bottom, links, ranks)
    save_figure(fig, path, runs_caption([summary]))


def chain_figure(out_dir: Path, summary: dict, path: Path, title: str = "") -> list[Link]:
    """Find the chain in the run written to `out_dir` and draw it into `path`; returns the links."""
    rows = read_trace(out_dir)
    links = find_chain(rows, summary)
    draw_chain(links, rows, summary, path, title)
    return links
