"""`python -m hicache_lab figures --quick` writes every figure from live runs; the causal chain it draws is
found in its legacy PP=2 run (in causal order, ending in the crash) and not in the fixed run of the same seed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache_lab.lab.figures.chain import describe
from hicache_lab.lab.figures.regenerate import FILES
from hicache_lab.lab.teach.chain import find_chain
from hicache_lab.managers.step_trace import read_trace

pytestmark = pytest.mark.spawns


@pytest.fixture(scope="module")
def figures_dir(tmp_path_factory):
    """One `figures --quick` run for the module: its figures and its runs (pp2_legacy, pp2_fixed, ...)."""
    out = tmp_path_factory.mktemp("figures")
    cmd = [sys.executable, "-m", "hicache_lab", "figures", "--quick", "--out", str(out), "--runs", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def test_figures_command_writes_every_figure(figures_dir):
    written = {p.name for p in figures_dir.glob("*.png") if p.stat().st_size > 10_000}
    assert set(FILES[:6]) <= written  # sync_cost.png only where bench/results/agreement_cost.csv exists


def _chain(run_dir):
    return find_chain(read_trace(run_dir), json.loads((run_dir / "summary.json").read_text()))


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


def test_the_fixed_run_of_the_same_seed_has_no_chain(figures_dir):
    assert _chain(figures_dir / "pp2_fixed") == []


def test_the_storage_tier_finds_what_the_host_dropped(figures_dir):
    """hit_rate_by_tier.png's L1 + L2 + L3 run (presets.TIER_CACHES) finds pages on storage in rounds 3 and 4,
    where the L1 + L2 run of the same workload has lost most of its host hits."""
    host_only, with_storage = (json.loads((figures_dir / f"tier_{i}" / "summary.json").read_text()) for i in (1, 2))
    for host_row, row in zip(host_only["rounds"][3:], with_storage["rounds"][3:], strict=True):
        assert row["cached_storage"] > 0, row
        assert row["hit_rate"] > host_row["hit_rate"], (row, host_row)
