"""A fault asked for is a promise: each counts its chances on the rank it strikes (hooks.Chances), the summary says
whether it fired (`faults`), and a run whose fault never came fails with the N that could have fired it, so a
fault test can never pass by testing nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache_lab.lab.binders import run
from hicache_lab.lab.check.faults import Chances
from hicache_lab.lab.presets import WORKLOAD


def test_chances_find_the_nth_inside_a_batch_and_record_what_came():
    chances = Chances("--fault damage-page:0@5", 0, "read {} pages from the file store", "", 5)
    assert chances.take(3) is None and chances.take(4) == 2 and chances.take(1) is None
    assert chances.record() == {
        "asked": "--fault damage-page:0@5",
        "rank": 0,
        "fired": True,
        "chances": 8,
        "message": None,
    }
    short = Chances("--fault alloc-fail:1@9", 1, "made {} slot allocations for a copy", "", 9)
    short.take(4)
    assert short.record()["message"] == (
        "--fault alloc-fail:1@9 never fired: rank 1 made only 4 slot allocations for a copy; pick N below 4"
    )


@pytest.mark.spawns
def test_a_fault_that_never_fires_fails_the_cli_and_names_an_n_that_would(tmp_path):
    flags = [*WORKLOAD.split(), "--num-layers", "2", "--enable-hierarchical-cache", "--check-outputs"]
    cmd = [sys.executable, "-m", "hicache_lab", "run", *flags, "--fault", "alloc-fail:0@100000", "--out", "out"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completed"] and summary["outputs_match_reference"] is True, "the run itself went well"
    (fault,) = summary["faults"]
    made = fault["chances"]["0"]
    assert fault["fired"] is False and 0 < made < 100000
    message = f"--fault alloc-fail:0@100000 never fired: rank 0 made only {made} slot allocations for a copy"
    assert result.returncode == 1 and f"{message}; pick N below {made}" in result.stderr


@pytest.mark.parametrize(("fault", "skip_load_wait"), [("alloc-fail:0@3", False), ("tear-copy:0@2", False), ("", True)])
def test_a_fault_that_fires_is_recorded_as_fired(small_config, tmp_path, fault, skip_load_wait):
    cfg = small_config(enable_hierarchical_cache=True, skip_load_wait=skip_load_wait, fault=fault)
    (record,) = run(cfg, tmp_path, verbose=False)["faults"]
    assert record["fired"] is True and record["message"] is None
    assert record["chances"]["0"] >= 1
