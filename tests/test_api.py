"""The lab from Python (`hicache_lab.api`): a run's results as DataFrames, every summary's provenance, many runs in
one table, a sweep that resumes, and the refusals: bad input at once, a script without its main guard before any
rank starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from hicache_lab import api, provenance
from hicache_lab.config import RunConfig
from hicache_lab.errors import ConfigError
from hicache_lab.lab.presets import WORKLOAD

SMALL = f"{WORKLOAD} --num-layers 2 --num-rounds 3 --enable-hierarchical-cache"  # one rank, in this process
PROVENANCE = {
    "command",
    "commit",
    "dirty",
    "python",
    "torch",
    "sglang",
    "hicache_lab",
    "host",
    "machine",
    "date",
    "seed",
}


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> api.Run:
    return api.run(f"{SMALL} --seed 5 --model-seed 7", tmp_path_factory.mktemp("api") / "one")


def test_run_gives_its_rounds_and_trace_as_dataframes(one):
    assert isinstance(one.config, RunConfig) and one.config.workload.seed == 5
    assert one.summary["completed"] and isinstance(one.rounds, pd.DataFrame)
    assert one.rounds["round"].tolist() == [0, 1, 2] and one.rounds["hit_rate"].iloc[1] > 0
    assert {"rank", "step", "kind", "acks_write"} <= set(one.trace.columns) and len(one.trace) > 10


def test_every_summary_says_where_its_run_came_from(one):
    found = json.loads((one.out / "summary.json").read_text())["provenance"]
    assert PROVENANCE | {"model_seed"} == set(found)
    assert (found["seed"], found["model_seed"]) == (5, 7)
    assert re.fullmatch(r"[0-9a-f]{40}", found["commit"]) or found["commit"] == "not a checkout"
    assert found["hicache_lab"] == "0.1.0" and found["python"].count(".") == 2 and found["torch"][0].isdigit()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", found["date"])


def test_provenance_says_the_command_and_never_fails_outside_a_checkout(monkeypatch, tmp_path):
    main = str(Path(api.__file__).with_name("__main__.py"))
    assert provenance.command_line([main, "run", "--out", "a b"]) == "python -m hicache_lab run --out 'a b'"
    assert provenance.command_line(["examples/sweep.py"]) == "python examples/sweep.py"
    assert provenance._installed("no-such-package-here") == "not installed"
    monkeypatch.setattr(provenance, "PACKAGE", tmp_path / "hicache_lab")
    assert provenance._commit() == ("not a checkout", None)
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert provenance._commit() == ("not a checkout", None)


def test_load_runs_makes_one_table_of_rounds_configuration_and_provenance(one, tmp_path):
    other = api.run(SMALL, tmp_path / "other")
    table = api.load_runs([one.out, other.out])
    assert len(table) == 6 and table["run"].nunique() == 2
    assert table["workload.seed"].tolist() == [5] * 3 + [0] * 3 and set(table["cache.page_size"]) == {1}
    assert {f"provenance.{key}" for key in PROVENANCE} <= set(table.columns)
    assert table.loc[3:, "hit_rate"].tolist() == other.rounds["hit_rate"].tolist()
    assert len(api.load_runs(str(tmp_path / "oth*"))) == 3  # a glob
    with pytest.raises(ConfigError, match="holds no run"):
        api.load_runs(tmp_path / "nothing")


def test_a_sweep_runs_each_point_once_and_resumes(tmp_path, monkeypatch, capsys):
    ran, real = [], api.run
    monkeypatch.setattr(api, "run", lambda cfg, out, plugins: ran.append(out) or real(cfg, out, plugins))
    first = api.sweep({"--hicache-ratio": [2, 3]}, base=SMALL, out=tmp_path)
    assert [p.name for p in ran] == ["hicache-ratio=2", "hicache-ratio=3"] and len(first) == 6
    assert first["cache.hicache_ratio"].tolist() == [2.0] * 3 + [3.0] * 3
    ran.clear()
    again = api.sweep({"--hicache-ratio": [2, 3, 4]}, base=SMALL, out=tmp_path)
    assert [p.name for p in ran] == ["hicache-ratio=4"]  # the two run before are read, not run
    assert "2 already run, not run again" in capsys.readouterr().err  # the progress bar says so
    pd.testing.assert_frame_equal(again.iloc[:6], first)


def test_bad_input_is_refused_before_any_run(tmp_path):
    for grid, says in (
        ({"hicache-ratio": [2]}, "maps `run` flags to lists of values"),
        ({"--sync": "fixed"}, "maps `run` flags to lists of values"),
        ({"--hicache-ratio": [2, -1]}, "--hicache-ratio -1.0 must be > 0"),
        ({"--hicache-rato": [2]}, "unrecognized arguments: --hicache-rato 2"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)):
            api.sweep(grid, base=SMALL, out=tmp_path / "sweep")
    assert not (tmp_path / "sweep").exists()
    with pytest.raises(ConfigError, match="plugins are Binder instances"):
        api.run(SMALL, tmp_path / "one", plugins=["my_module:BINDER"])


SCRIPTS = {  # a script, and whether it calls the API from its top level
    "top.py": ("run('--pp 2', 'runs/x')", True),
    "inside.py": ("def main():\n    run('--pp 2', 'runs/x')\n\n\nmain()", True),
    "guarded.py": ("if __name__ == '__main__':\n    run('--pp 0', 'runs/x')", False),
}


@pytest.mark.spawns
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_without_its_main_guard_is_refused_at_once(name, tmp_path):
    body, unguarded = SCRIPTS[name]
    (tmp_path / name).write_text(f"from hicache_lab.api import run\n\n{body}\n")
    done = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    if unguarded:
        assert done.returncode == 2 and not (tmp_path / "runs").exists(), done.stderr
        line = 3 if name == "top.py" else 7
        assert (
            f"configuration error: hicache_lab.api.run is called from the top level of {tmp_path / name}, line "
            f"{line}," in done.stderr
        )
        assert 'put the calls under `if __name__ == "__main__":`' in done.stderr
    else:  # past the guard's check, to the configuration's
        assert done.returncode == 1 and "ConfigError: --pp must be at least 1" in done.stderr, done.stderr
