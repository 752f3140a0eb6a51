"""What every figure shares: one colour per cache tier, the colours of everything else, the axes of a rate by
round (`rate_by_round`), and `save_figure`."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

# One colour per tier in every figure: the tier's share of a hit, a run whose deepest tier it is, a tree node
# that lives there. Nothing else is drawn in these three colours; other series take OTHER_COLORS.
TIER_COLORS = {"device": "#4c72b0", "host": "#dd8452", "storage": "#55a868"}
BOTH_TIERS_COLOR = "#8172b3"  # a tree node on the device with a host copy
OTHER_COLORS = ("#333333", "#c44e52", "#937860", "#8c8c8c", "#da8bc3", "#ccb974")


def rate_by_round(ax, ylabel: str = "", bottom: float = 0) -> None:
    """`ax` as a rate (%) by round: whole rounds on x, `bottom` to 100 on y, a light grid."""
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_ylim(bottom, 100)
    ax.grid(alpha=0.3)


def save_figure(fig, path: Path) -> None:
    """Lay `fig` out, write it to `path` (its folder made if missing) at the figures' resolution, close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
