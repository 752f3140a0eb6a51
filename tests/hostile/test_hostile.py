"""Hostile input (this folder): every fast case ends as it must, each class has a file of its own, the
preflight refusals run in this process (all but one) and what they leave behind is found, and docs/checks.md
names the command that prints the cases' table."""

from __future__ import annotations

import _thread
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from . import judge as judge_module
from .cases import BY_CLASS, CASES
from .judge import CLASSES, Hostile, Outcome, judge, judge_all, run_in_process, table

CHECKS = Path(__file__).resolve().parents[2] / "docs" / "checks.md"


FAST = [pytest.param(c, marks=() if c.in_process else pytest.mark.spawns) for c in CASES if not c.slow]


@pytest.mark.parametrize("case", FAST, ids=lambda c: f"{c.klass}-{c.name[:48]}")
def test_hostile_case(case, tmp_path):  # those in this process start none: `make check` runs them
    if why := case.needs():
        pytest.skip(why)
    _, problems = judge(case, tmp_path)
    assert not problems, "\n".join(problems)


def test_each_class_is_a_file_of_its_own_and_only_preflight_refusals_run_in_this_process():
    assert list(BY_CLASS) == list(CLASSES)
    for klass, module in BY_CLASS.items():
        assert module.__name__.rpartition(".")[2] == CLASSES[klass][1]
        assert module.CASES and {case.klass for case in module.CASES} == {klass}, module.__name__
    assert [c.name for c in CASES if c.klass == 10 and not c.in_process] == [
        "stale `RANK=3 WORLD_SIZE=2` in the environment"  # the one in a process of its own
    ]
    assert not [c.name for c in CASES if c.in_process and c.klass != 10]


@pytest.mark.spawns
def test_a_case_in_this_process_is_found_out_for_what_it_leaves(tmp_path, monkeypatch):
    """A refusal that leaves a thread or a child process behind fails the judge; the working directory, the
    environment and sys.argv are this process's again afterwards."""
    stop, started = threading.Event(), []

    def leaves_a_thread_of_each_kind_and_a_process(module, run_name):
        threading.Thread(target=stop.wait, name="left behind", daemon=True).start()
        _thread.start_new_thread(stop.wait, ())  # a thread `threading` does not know of (as one of C++'s)
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        environ = f"RANK={os.environ.get('RANK')} WORLD_SIZE={os.environ.get('WORLD_SIZE')}"
        print(f"refused in {os.getcwd()}, {environ}, argv {sys.argv[1:]}", file=sys.stderr)
        sys.exit(2)

    monkeypatch.setattr(judge_module.runpy, "run_module", leaves_a_thread_of_each_kind_and_a_process)
    monkeypatch.setattr(judge_module, "LINGER_S", 0.2)
    monkeypatch.setenv("RANK", "7")  # stale: removed for the case, unless it sets it
    cwd, argv, world = os.getcwd(), sys.argv, os.environ.get("WORLD_SIZE")
    try:
        outcome = run_in_process(tmp_path, "run", "--seed", "1", env={"WORLD_SIZE": "2"})
    finally:
        stop.set()
        for child in started:
            child.wait()
    assert outcome.code == 2
    assert f"refused in {tmp_path}, RANK=None WORLD_SIZE=2, argv ['run', '--seed', '1']" in outcome.output
    assert outcome.leftover[:2] == [
        "thread 'left behind' of this process",
        "1 more thread(s) of this process, not of `threading`",
    ]
    assert outcome.leftover[2].startswith(f"pid {started[0].pid}: ") and started[0].returncode == -9
    assert (os.getcwd(), sys.argv, os.environ["RANK"], os.environ.get("WORLD_SIZE")) == (cwd, argv, "7", world)


def test_judge_all_runs_the_cases_in_this_process_alone_and_first():
    ran = []

    def run(name: str):
        def record(scratch: Path) -> Outcome:
            ran.append((name, threading.current_thread() is threading.main_thread()))
            return Outcome(0, "")

        return record

    cases = [Hostile(10, n, run(n), 0, "", in_process=n != "b") for n in ("a", "b", "c")]
    judged = judge_all(cases, jobs=2)
    assert [(case.name, problems) for case, problems in judged] == [("a", []), ("b", []), ("c", [])]
    assert ran == [("a", True), ("c", True), ("b", False)]  # b in the pool, once a and c have ended


def test_checks_doc_names_the_command_that_prints_the_table_and_every_class():
    """The case table is not committed: docs/checks.md tells the reader the command that prints it from the cases,
    and names each class the cases have."""
    text = CHECKS.read_text()
    assert "python -m hicache_lab soak --hostile --table" in text, "docs/checks.md must name the table's command"
    assert table(CASES).splitlines()[0] not in text, "the table is printed, not committed: drop it from docs/checks.md"
    missing = [f"{n}. {name}" for n, (name, _) in CLASSES.items() if f"{n}. {name}" not in text]
    assert not missing, f"docs/checks.md omits the classes {missing}"
