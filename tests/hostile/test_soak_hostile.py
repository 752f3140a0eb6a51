"""`soak --hostile`, from the package: it finds this suite in the source checkout it runs from, and where the
package is installed without its tests it refuses in one line (exit 2), naming what to do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hicache_lab.__main__ import main
from hicache_lab.lab.check import soak_hostile

from . import command
from .cases import CASES
from .judge import table


def test_the_package_finds_this_suite_in_its_checkout():
    assert soak_hostile.suite(soak_hostile.CHECKOUT) is command  # the module pytest imported: the same path


@pytest.mark.parametrize("flags", [[], ["--table"]], ids=["run", "table"])
def test_soak_hostile_without_a_checkout_refuses_in_one_line(flags, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(soak_hostile, "CHECKOUT", tmp_path / "site-packages")  # installed: no tests/ beside it
    results = tmp_path / "results"
    assert main(["soak", "--hostile", *flags, "--out", str(tmp_path / "out"), "--results", str(results)]) == 2
    out, err = capsys.readouterr()
    missing = tmp_path / "site-packages" / "tests" / "hostile"
    assert out == "" and err == (
        f"configuration error: soak --hostile runs the hostile-input suite of a source checkout, and {missing} is "
        "not there (the package is installed without its tests): clone the repository and run it from there\n"
    )
    assert not results.exists()


@pytest.mark.spawns
def test_soak_hostile_table_in_a_process_of_its_own_loads_the_suite_from_the_checkout(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hicache_lab", "soak", "--hostile", "--table"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == table(CASES) + "\n"
