"""`python -m hicache_lab figures`: every committed figure (the README's and the docs') from live runs (and
the benchmark CSV), into runs/figures; `--out figures` regenerates the committed ones.

* pp_queue_divergence.png - acks each PP stage consumed, step by step, legacy vs fixed (PP=2)
* hit_rate_by_round.png   - L1 only, L1 + L2 legacy, L1 + L2 fixed (PP=2), against the infinite-cache bound
* digest_agreement.png    - which ranks hold rank 0's tree at every step, PP=2 and PP=3, legacy vs fixed
* hit_rate_by_tier.png    - one rank whose history outgrows device and host: L1, L1 + L2, L1 + L2 + L3
* hicache_tree.png        - one rank's tree as write-through, eviction and load-back change it
* causal_chain.png        - the legacy PP=2 run's chain: ack on one stage only -> unlock -> admission, eviction
                            -> different batches -> the crash (teach/chain.py)
* sync_cost.png           - bench/results/agreement_cost.csv (from `python -m bench.agreement_cost`), if present

`--quick` uses a small workload (seconds, for CI), never into figures/; the committed figures use the demo's.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from ...config import RunConfig
from ...entrypoints.launch import run_world
from ...entrypoints.preflight import check_writable_dir
from ...errors import ConfigError
from ..presets import BENCH_RESULTS, TIER_CACHES, WORKLOAD, config, tier_config
from ..teach.tour import OneRank
from .chain import chain_figure
from .hit_rates import plot_hit_rate_by_tier, plot_hit_rates
from .pipeline import plot_digest_agreement, plot_queue_divergence
from .sync_cost import plot_sync_cost
from .trees import TREE_LEAF_WIDTH, TREE_LEVEL_HEIGHT, draw_tree, tree_drawing, tree_legend

SYNC_COST_CSV = BENCH_RESULTS / "agreement_cost.csv"
COMMITTED = Path("figures")  # the README's figures, from the repository's root
FILES = (
    "pp_queue_divergence.png",
    "hit_rate_by_round.png",
    "digest_agreement.png",
    "hit_rate_by_tier.png",
    "hicache_tree.png",
    "causal_chain.png",
    "sync_cost.png",
)


def base_config(quick: bool) -> RunConfig:
    """The demo's model and workload; quick: the test suite's small one (presets.WORKLOAD)."""
    return config(WORKLOAD, "--hicache-ratio 2") if quick else RunConfig()


def variant(base: RunConfig, pp: int = 1, sync: str = "fixed", **cache) -> RunConfig:
    return dataclasses.replace(
        base,
        cache=dataclasses.replace(base.cache, **cache),
        parallel=dataclasses.replace(base.parallel, pp=pp, sync=sync),
    )


def pipeline_figures(base: RunConfig, runs_dir: Path, out: Path) -> None:
    worlds = {}  # (pp, sync) -> (output dir, summary)
    for pp in (2, 3):
        for sync in ("legacy", "fixed"):
            cfg = variant(base, pp, sync, enable_hierarchical_cache=True)
            worlds[pp, sync] = (runs_dir / f"pp{pp}_{sync}", run_world(cfg, runs_dir / f"pp{pp}_{sync}", verbose=False))
    l1_only = run_world(variant(base, 2), runs_dir / "pp2_l1", verbose=False)
    plot_queue_divergence({f"--pp 2 --sync {sync}": worlds[2, sync] for sync in ("legacy", "fixed")}, out / FILES[0])
    hit_rates = {"L1 only": l1_only, "L1 + L2, legacy sync": worlds[2, "legacy"][1]}
    plot_hit_rates({**hit_rates, "L1 + L2, fixed sync": worlds[2, "fixed"][1]}, out / FILES[1])
    plot_digest_agreement({f"--pp {pp} --sync {sync}": world for (pp, sync), world in worlds.items()}, out / FILES[2])
    chain_figure(
        *worlds[2, "legacy"], out / FILES[5], "--pp 2 --sync legacy: from an ack consumed on one stage to the crash"
    )


def tier_figure(runs_dir: Path, out: Path, device: str = "cpu") -> dict[str, dict]:
    summaries = {
        label: run_world(tier_config(device, **cache), runs_dir / f"tier_{i}", verbose=False)
        for i, (label, cache) in enumerate(TIER_CACHES.items())
    }
    plot_hit_rate_by_tier(summaries, out / FILES[3])
    return summaries


def tree_figure(out: Path) -> None:
    """Four moments of one rank's tree (lab.teach.tour.OneRank), each panel as wide as its tree."""
    rank = OneRank()
    a, b, c = list(range(100, 116)), list(range(100, 108)) + list(range(200, 208)), list(range(300, 324))
    panels = []  # (title, drawing): the tree keeps changing, so each moment is drawn from a snapshot

    def snap(title: str) -> None:
        panels.append((title, tree_drawing(rank.tree)))

    rank.serve(a)
    snap("1. A served: its host write in flight\n(locked until the ack is consumed)")
    rank.step()
    rank.serve(b)
    rank.step()
    snap("2. B shares A's first 8 tokens: split;\nacks consumed, both backed up")
    rank.serve(c)
    snap("3. C needs room: A's and B's tails\nevicted to host-only")
    rank.step()
    rank.serve(a + [1, 2, 3, 4])
    snap("4. A again: its tail loaded back\n(locked until the load ack)")
    rank.close()
    rows = (panels[:2], panels[2:])  # two panels a row, each as wide as its tree: readable at README width
    widths = [[max(d.leaves, 1.5) for _, d in row] for row in rows]
    depths = [max(d.depth for _, d in row) for row in rows]
    fig = plt.figure(
        figsize=(
            TREE_LEAF_WIDTH * max(map(sum, widths)) + 0.4,
            sum(TREE_LEVEL_HEIGHT * (d + 1) + 0.8 for d in depths) + 0.7,
        ),
        layout="constrained",
    )
    for subfig, row, ratios, depth in zip(
        fig.subfigures(2, 1, height_ratios=[d + 1.8 for d in depths]), rows, widths, depths, strict=True
    ):
        for ax, (title, drawing) in zip(subfig.subplots(1, 2, width_ratios=ratios), row, strict=True):
            draw_tree(ax, drawing, title, legend=False)
            ax.set_ylim(-depth - 0.5, 0.35)  # one depth scale a row
    fig.legend(handles=tree_legend(), loc="outside lower center", ncol=2, fontsize=9, frameon=False)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / FILES[4], dpi=120)
    plt.close(fig)


def make_figures(out: Path, runs_dir: Path, quick: bool = False, device: str = "cpu") -> list[Path]:
    """Every figure into `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    base = base_config(quick)
    base = dataclasses.replace(base, device=device)
    pipeline_figures(base, runs_dir, out)
    tier_figure(runs_dir, out, device)
    tree_figure(out)
    written = [out / name for name in FILES[:6]]
    if SYNC_COST_CSV.exists():
        plot_sync_cost(pd.read_csv(SYNC_COST_CSV), out / FILES[6])
        written.append(out / FILES[6])
    return written


def add_figures_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default="runs/figures",
        help="where the figures go (default: runs/figures; the README's committed ones: --out figures)",
    )
    parser.add_argument("--runs", default="runs/figures", help="where their runs go (default: runs/figures)")
    parser.add_argument("--quick", action="store_true", help="a small workload: seconds instead of minutes")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")


def cmd_figures(args: argparse.Namespace) -> int:
    check_writable_dir(args.out, "figures --out")  # before a minute of runs, not after
    check_writable_dir(args.runs, "figures --runs")
    if args.quick and Path(args.out).resolve() == COMMITTED.resolve():
        raise ConfigError(
            f"figures --quick --out {args.out}: the README describes the full workload's figures; "
            "give --quick another --out"
        )
    for path in make_figures(Path(args.out), Path(args.runs), args.quick, args.device):
        print(f"wrote {path}")
    if not SYNC_COST_CSV.exists():
        print(f"skipped {FILES[6]}: no {SYNC_COST_CSV} (run python -m bench.agreement_cost)")
    return 0
