"""The release matrix (`python -m hicache_lab releases`): one column per SGLang release, named by what landed in
it, one row per world, each cell coloured by what that release's own code did there."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..sglang.releases import RELEASES
from .style import save_figure

OUTCOME_COLORS = {
    "agreed": "#55a868",
    "leaked": "#ccb974",
    "diverged": "#c44e52",
    "crashed": "#8c1c13",
    "deadlocked": "#8172b3",
    "wrong": "#da8bc3",
    "refused": "#d9d9d9",
    "not judged": "#ffffff",
}


def plot_release_matrix(cells, worlds, path: Path) -> None:
    """`cells` (check/releases.Cell) over `worlds`, one column per release, as a PNG at `path`."""
    versions = list(dict.fromkeys(c.release for c in cells))
    by = {(c.release, c.world): c for c in cells}
    fig, ax = plt.subplots(figsize=(1.7 * len(versions) + 2.6, 0.85 * len(worlds) + 2.4))
    for col, version in enumerate(versions):
        for row, world in enumerate(worlds):
            cell = by[version, world.name]
            ax.add_patch(plt.Rectangle((col, row), 1, 1, color=OUTCOME_COLORS[cell.outcome], ec="white", lw=2))
            dark = cell.outcome in ("diverged", "crashed", "deadlocked")
            ax.text(col + 0.5, row + 0.5, "\n".join(cell.words), ha="center", va="center", fontsize=7.5,
                    color="white" if dark else "black")  # fmt: skip
    ax.set_xlim(0, len(versions))
    ax.set_ylim(len(worlds), 0)
    ax.set_xticks([c + 0.5 for c in range(len(versions))])
    ax.set_xticklabels([_column(v) for v in versions], fontsize=7)
    ax.xaxis.tick_top()
    ax.set_yticks([r + 0.5 for r in range(len(worlds))])
    ax.set_yticklabels([w.name for w in worlds], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    shown = [o for o in OUTCOME_COLORS if any(c.outcome == o for c in cells)]
    ax.legend(
        handles=[Patch(color=OUTCOME_COLORS[o], label=o) for o in shown],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.02),
        ncol=len(shown),
        fontsize=8,
        frameon=False,
    )
    ax.set_title("SGLang's own HiCache in lab worlds, release by release", fontsize=10, pad=12)
    save_figure(fig, path)


def _column(version: str) -> str:
    """A release's column label: its version and what landed in it, wrapped."""
    return f"{version}\n" + "\n".join(textwrap.wrap(RELEASES[version].label, 16))
