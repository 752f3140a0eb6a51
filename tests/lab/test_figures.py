"""`python -m hicache_lab figures --quick` writes every figure from live runs."""

from __future__ import annotations

import subprocess
import sys

from hicache_lab.lab.figures import FILES


def test_figures_command_writes_every_figure(tmp_path):
    cmd = [sys.executable, "-m", "hicache_lab", "figures", "--quick", "--out", str(tmp_path), "--runs", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    written = {p.name for p in tmp_path.glob("*.png") if p.stat().st_size > 10_000}
    assert set(FILES[:5]) <= written  # sync_cost.png only where bench/results/agreement_cost.csv exists
