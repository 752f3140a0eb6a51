"""The causal chain of a legacy run, drawn (`draw_chain`; `chain_figure` finds it in a run's output directory and
draws it: figures/causal_chain.png, notebook 02). The chain and what the strip above it shows are found in
teach/chain.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch
from matplotlib.ticker import MaxNLocator

from ...managers.step_trace import read_trace
from ..teach.chain import PHASE_TITLES, Link, ahead_at, differing_steps, find_chain, healed_steps
from .style import OTHER_COLORS, save_figure

ACCENT = OTHER_COLORS[1]  # the stage a link happened on (red); the others are drawn in grey


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
    n = len(links)
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
            text = link.values.get(k, "")
            if not text:
                continue
            hit = k in link.stages
            bottom.text(
                lane_x[k],
                row_y[j],
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
        arrows = []  # down each lane where this link happened, from the lane's box above (else the link above's)
        for k in link.stages if j else ():
            src = k if links[j - 1].values.get(k) else links[j - 1].stages[0]
            arrows.append(((lane_x[src], row_y[j - 1] - 0.36 / n), (lane_x[k], row_y[j] + 0.36 / n)))
        if link.what == "crash" and link.values.get(link.stages[0] - 1):  # the hidden states it received
            arrows.append(((lane_x[link.stages[0] - 1] + 0.13, row_y[j]), (lane_x[link.stages[0]] - 0.17, row_y[j])))
        for start, end in arrows:
            bottom.add_patch(
                FancyArrowPatch(
                    start, end, arrowstyle="-|>", mutation_scale=10, color=ACCENT, lw=1.2, transform=bottom.transAxes
                )
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
    save_figure(fig, path)


def chain_figure(out_dir: Path, summary: dict, path: Path, title: str = "") -> list[Link]:
    """Find the chain in the run written to `out_dir` and draw it into `path`; returns the links."""
    rows = read_trace(out_dir)
    links = find_chain(rows, summary)
    draw_chain(links, rows, summary, path, title)
    return links
