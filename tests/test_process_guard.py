"""The guard that keeps `make check` in one process (tests/conftest.py, `ProcessGuard`) errors on a test that
starts a process of this Python unmarked, and lets the same test pass once it is marked `spawns`."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

STARTS_A_PROCESS = """
import subprocess, sys

import pytest


def test_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.spawns
def test_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


@pytest.mark.spawns  # the suite it runs starts a process, and so does this test
def test_a_test_that_starts_a_process_unmarked_errors_and_marked_passes(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    spawns: starts processes\n    notebook: a kernel\n    slow: seconds\n")
    pytester.makepyfile(test_guarded=STARTS_A_PROCESS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)  # test_unmarked passes its body, then errors at teardown
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_unmarked*", "*this test starts processes (*-c pass)*"])
