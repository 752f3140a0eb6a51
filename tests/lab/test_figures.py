"""`python -m hicache_lab figures --quick` writes every figure from live runs; the causal chain it draws is
found in its legacy PP=2 run (in causal order, ending in the crash) and not in the fixed run of the same seed.
In this process: a format or resolution it cannot write refused, and every figure's caption line (the workload,
the flags its runs share, the machine) under everything else the figure draws."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import matplotlib.pyplot as plt
import pytest

from hicache_lab.errors import ConfigError
from hicache_lab.lab.figures.chain import describe
from hicache_lab.lab.figures.hit_rates import plot_hit_rates
from hicache_lab.lab.figures.regenerate import FILES, add_figures_flags, cmd_figures
from hicache_lab.lab.figures.style import add_caption, runs_caption
from hicache_lab.lab.presets import config
from hicache_lab.lab.teach.chain import find_chain
from hicache_lab.managers.step_trace import read_trace

SUMMARY = {  # what a figure of runs reads of a summary
    "config": dataclasses.asdict(config("--pp 2 --enable-hierarchical-cache --num-clients 4 --hicache-storage-dir /x")),
    "provenance": {"machine": "a test CPU, 2 CPUs"},
    "rounds": [{"round": 0, "hit_rate": 0.0, "upper_bound_hit_rate": 0.0}],
    "crashed": False,
}


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (("--format", "jpg"), "--format jpg: the figures are written as png, pdf, svg"),
        (("--dpi", "10"), "--dpi 10: give dots per inch from 50 to 1200"),
        (("--dpi", "5000"), "--dpi 5000: give dots per inch from 50 to 1200"),
    ],
)
def test_a_format_or_resolution_it_cannot_write_is_refused_before_any_run(tmp_path, flags, refusal):
    parser = argparse.ArgumentParser()
    add_figures_flags(parser)
    args = parser.parse_args(["--quick", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs"), *flags])
    with pytest.raises(ConfigError, match=refusal):
        cmd_figures(args)
    assert not (tmp_path / "runs").exists()


def test_the_caption_says_the_workload_the_shared_flags_and_the_machine():
    other = json.loads(json.dumps(SUMMARY))
    other["config"]["parallel"]["pp"] = 3  # what differs between the runs, the legend says
    line = runs_caption(iter([SUMMARY, other]))  # as the figures pass them: a generator
    assert line.startswith("workload: 4 clients × 8 rounds, 256-token openings, 32-token follow-ups")
    assert "configuration: --enable-hierarchical-cache  ·  machine: a test CPU, 2 CPUs" in line
    assert "--pp" not in line and "/x" not in line  # not shared; a path of one machine


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
def test_every_figure_is_written_in_its_format_with_its_caption(tmp_path, suffix):
    with plt.rc_context({"savefig.dpi": 60, "svg.fonttype": "none"}):  # svg: text kept as text, to be read back
        plot_hit_rates({"L1 + L2": SUMMARY}, tmp_path / f"rates{suffix}")
    written = (tmp_path / f"rates{suffix}").read_bytes()
    assert written[:4] == {".png": b"\x89PNG", ".pdf": b"%PDF", ".svg": b"<?xm"}[suffix]
    if suffix == ".svg":
        assert "machine: a test CPU" in written.decode()
    if suffix == ".pdf":
        assert b"/FontFile2" in written and b"/Type3" not in written  # TrueType embedded, as publishers ask


def test_the_caption_sits_under_everything_the_figure_draws():
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], label="a line")
    fig.legend(loc="lower center")  # at the figure's lower edge, where the caption goes
    add_caption(fig, runs_caption([SUMMARY]))
    renderer = fig.canvas.get_renderer()
    line = fig.texts[-1]
    others = [a.get_window_extent(renderer) for a in (*fig.legends, ax)]
    assert line.get_text().count("\n") >= 1  # wider than the figure: wrapped, not cut
    assert all(line.get_window_extent(renderer).y1 < box.y0 for box in others)
    plt.close(fig)


@pytest.fixture(scope="module")
def figures_dir(tmp_path_factory):
    """One `figures --quick` run for the module: its figures and its runs (pp2_legacy, pp2_fixed, ...)."""
    out = tmp_path_factory.mktemp("figures")
    cmd = [sys.executable, "-m", "hicache_lab", "figures", "--quick", "--out", str(out), "--runs", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return out


@pytest.mark.spawns
def test_figures_command_writes_every_figure(figures_dir):
    written = {p.name for p in figures_dir.glob("*.png") if p.stat().st_size > 10_000}
    assert set(FILES[:6]) <= written  # sync_cost.png only where bench/results/agreement_cost.csv exists


def _chain(run_dir):
    return find_chain(read_trace(run_dir), json.loads((run_dir / "summary.json").read_text()))


@pytest.mark.spawns
def test_the_legacy_chain_runs_in_causal_order_to_the_crash(figures_dir):
    summary = json.loads((figures_dir / "pp2_legacy" / "summary.json").read_text())
    links = _chain(figures_dir / "pp2_legacy")
    assert summary["crashed"]
    whats = [link.what for link in links]
    assert whats[0] == "ack" and whats[-1] == "crash" and {"unlock", "evict", "batch"} <= set(whats)
    assert [link.order for link in links] == sorted(link.order for link in links)  # (step, PHASES index)
    ack, unlock, evict = (next(link for link in links if link.what == w) for w in ("ack", "unlock", "evict"))
    assert unlock.stages == ack.stages and len(ack.stages) < 2  # one stage consumed it, and unlocked its node
    assert evict.node == unlock.node is not None and evict.ahead == ack.stages  # evicted there, still locked elsewhere
    assert f"node {unlock.node} on stage {ack.stages[0]} only" in describe(evict)
    crash = links[-1]
    assert crash.stages == (summary["failing_rank"],) and crash.step >= links[0].step
    assert crash.error == summary["error"] and summary["error"] in describe(crash)


@pytest.mark.spawns
def test_the_fixed_run_of_the_same_seed_has_no_chain(figures_dir):
    assert _chain(figures_dir / "pp2_fixed") == []


@pytest.mark.spawns
def test_the_storage_tier_finds_what_the_host_dropped(figures_dir):
    """hit_rate_by_tier.png's L1 + L2 + L3 run (presets.TIER_CACHES) finds pages on storage in rounds 3 and 4,
    where the L1 + L2 run of the same workload has lost most of its host hits."""
    host_only, with_storage = (json.loads((figures_dir / f"tier_{i}" / "summary.json").read_text()) for i in (1, 2))
    for host_row, row in zip(host_only["rounds"][3:], with_storage["rounds"][3:], strict=True):
        assert row["cached_storage"] > 0, row
        assert row["hit_rate"] > host_row["hit_rate"], (row, host_row)
