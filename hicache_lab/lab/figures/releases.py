"""`python -m hicache_lab releases`: the release matrix (check/releases.py runs its cells) as a table and a figure,
one column per SGLang release, named by what landed in it, one row per world, each cell coloured by what that
release's own code did there."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import signal
import textwrap
from dataclasses import astuple
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ...errors import ConfigError
from ...provenance import machine
from ..check.releases import WORLDS, config, format_table, run_cell
from ..presets import World
from ..sglang import releases
from .style import runs_caption, save_figure

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
    """`cells` (check/releases.Cell) over `worlds`, one column per release, into `path`; its caption line says
    what the worlds share (each row's flags, its name says; each column's --cache-impl, its label)."""
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
    configs = [{"config": dataclasses.asdict(config(v, world))} for v in versions for world in worlds]
    save_figure(fig, path, runs_caption(configs, machine()))


def _column(version: str) -> str:
    """A release's column label: its version and what landed in it, wrapped."""
    return f"{version}\n" + "\n".join(textwrap.wrap(releases.RELEASES[version].label, 18, break_long_words=False))


def add_releases_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--releases",
        default="",
        help=f"comma-separated releases (default: every one installed; the lab runs {', '.join(releases.RELEASES)})",
    )
    parser.add_argument(
        "--worlds", default="", help=f"comma-separated worlds (default: all: {', '.join(w.key for w in WORLDS)})"
    )
    parser.add_argument(
        "--out",
        default="runs/releases",
        help="run directories, the table (OUT/releases.md) and its cells (OUT/releases.csv)",
    )
    parser.add_argument(
        "--figure", help="where the figure goes (default: OUT/releases.png; figures/release_matrix.png is committed)"
    )


def chosen(args) -> tuple[list[str], tuple[World, ...]]:
    asked = {v.strip() for v in args.releases.split(",") if v.strip()}
    versions = [v for v in releases.RELEASES if v in asked] or releases.installed()
    unknown = sorted(asked - set(releases.RELEASES))
    if unknown:
        raise ConfigError(f"--releases {','.join(unknown)}: the lab runs {', '.join(releases.RELEASES)}")
    if not versions:
        raise ConfigError("no release is installed: `make releases` installs them (`make` installs 0.5.23)")
    if missing := [f"{v}: {why}" for v in versions if (why := releases.missing(v))]:
        raise ConfigError("; ".join(missing))
    names = [w.strip() for w in args.worlds.split(",") if w.strip()]
    known = {w.key: w for w in WORLDS}
    if unknown := [n for n in names if n not in known]:
        raise ConfigError(f"--worlds {','.join(unknown)}: choose among {', '.join(known)}")
    return versions, tuple(known[n] for n in names) if names else WORLDS


def cmd_releases(args) -> int:
    """Every chosen release (default: every one installed) over every chosen world, each cell said as it ends;
    then the table (OUT/releases.md, its cells in OUT/releases.csv) and the figure (OUT/releases.png). Exit 0
    when every cell was judged, whatever the release did there (that is its history); 128 + the signal when
    interrupted (the cells so far are printed)."""
    versions, worlds = chosen(args)
    out = Path(args.out)
    cells = []
    for version in versions:
        for world in worlds:
            cell = run_cell(version, world, out)
            print(f"sglang {version:<7} {world.name:<24} {cell.outcome}: {cell.detail}", flush=True)
            cells.append(cell)
            if cell.outcome == "not judged":
                print("interrupted: the cells so far are above")
                return 128 + signal.Signals[cell.detail.removeprefix("interrupted by ")]
    table = format_table(cells, worlds)
    out.mkdir(parents=True, exist_ok=True)
    (out / "releases.md").write_text(table + "\n")
    with open(out / "releases.csv", "w", newline="") as f:  # one row per cell, for pandas and the like
        csv.writer(f).writerows([("release", "world", "outcome", "detail")] + [astuple(c)[:4] for c in cells])
    figure = Path(args.figure) if args.figure else out / "releases.png"
    plot_release_matrix(cells, worlds, figure)
    print(f"\n{table}\n\nwrote {out / 'releases.md'}, {out / 'releases.csv'} and {figure}")
    return 0
