"""Hostile input: what an adversarial user tries, and what the lab must answer.

Each case starts `python -m hicache_lab ...` (one process or several) in a scratch directory of its own, which
holds a user's files beside the run, and is judged on five things:

* the **exit code** it must end with (2: refused at start; 1: the run failed and says why; 130: interrupted);
* a **message** its output must contain, naming the flag, the file and line, or the rank to blame;
* **no process left**: every process of the case's session is gone soon after the launcher ends;
* **no file touched** outside the directories the run owns (`owns`, relative to the scratch directory);
* **outputs exact** where the run completes (`exact`: its summary's oracle says every output matches).

The cases live in `hostile_cases.py`, one list per class of the issue that asked for them; `make test` runs the
fast ones (tests/runs/test_hostile.py), `python -m hicache_lab soak --hostile` all of them, and the README's
table is `table()` of them (a test keeps the two equal).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

LINGER_S = 5.0  # how long a case's processes may outlive its launcher before they count as left behind
USER_FILES = {"rank0.json": '{"mine": true}\n', "notes.txt": "a user's notes\n"}  # beside every case's run
CLEAN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@dataclass
class Outcome:
    code: int | None  # None: it outlived its limit and was killed
    output: str
    leftover: list[str] = field(default_factory=list)  # processes of its session still alive after LINGER_S


@dataclass(frozen=True)
class Hostile:
    klass: int  # the class of hostile input (CLASSES)
    name: str  # what the adversary does, in words
    run: Callable[[Path], Outcome]  # starts the processes in the scratch directory, returns how they ended
    code: int  # the exit code it must end with
    says: str  # text its output must contain
    owns: tuple[str, ...] = ("out",)  # what under the scratch directory the run may create, change or delete
    exact: bool = False  # the run completes: out/summary.json must say every output matches its reference
    slow: bool = False  # only in `soak --hostile`, not in `make test`
    needs: Callable[[], str | None] = lambda: None  # why it cannot run on this machine (None: it can)


CLASSES = {
    1: "Storage serves another model's KV",
    2: "A page under another page's name",
    3: "One stage's damaged page",
    4: "Hangs no timeout covers",
    5: "Orphan processes",
    6: "Lost or mixed files",
    7: "Ranks started with different flags",
    8: "Failures that exit 0",
    9: "Blame and summaries",
    10: "Values the preflight must refuse",
}


def lab(
    scratch: Path,
    *args: str,
    env: dict[str, str] | None = None,
    during: Callable[[subprocess.Popen], None] | None = None,
    limit_s: float = 180,
) -> Outcome:
    """`python -m hicache_lab ARGS` in `scratch`, in a session of its own; `during(process)` runs while it does
    (to send it signals). Stale torchrun variables are removed unless `env` sets them."""
    environ = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV} | (env or {})
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hicache_lab", *args],
            cwd=scratch,
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        if during is not None:
            during(proc)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        leftover = reap_session(proc.pid)
        log.seek(0)
        return Outcome(code, log.read(), leftover)


def processes(match: Callable[[list[str]], bool]) -> dict[int, str]:
    """{pid: command line} of every live process whose /proc/PID/stat fields after the command name (state,
    ppid, pgrp, session, ...) satisfy `match` (Linux)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z" and match(fields):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except (OSError, ValueError, IndexError):
            continue  # it ended while being read
    return found


def reap_session(sid: int) -> list[str]:
    """Wait up to LINGER_S for session `sid` to empty; kill and return what is still there."""
    deadline = time.monotonic() + LINGER_S
    while (alive := processes(lambda f: int(f[3]) == sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [f"pid {pid}: {command}" for pid, command in alive.items()]


def _snapshot(scratch: Path, owns: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under `scratch` outside what the run owns."""
    owned = [scratch / o for o in owns]
    files = {}
    for path in scratch.rglob("*"):
        if path.is_file() and not any(path == o or o in path.parents for o in owned):
            stat = path.stat()
            files[str(path.relative_to(scratch))] = (stat.st_size, stat.st_mtime_ns)
    return files


def judge(case: Hostile, scratch: Path) -> tuple[Outcome, list[str]]:
    """Run `case` in the empty directory `scratch` (the user's files put beside it first); what went wrong."""
    for name, text in USER_FILES.items():
        (scratch / name).write_text(text)
    before = _snapshot(scratch, case.owns)
    outcome = case.run(scratch)
    problems = []
    if outcome.code != case.code:
        problems.append(f"exit code {outcome.code}, expected {case.code}")
    if case.says not in outcome.output:
        problems.append(f"output does not say {case.says!r}")
    if outcome.leftover:
        problems.append(f"processes left behind: {outcome.leftover}")
    after = _snapshot(scratch, case.owns)
    if touched := sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)):
        problems.append(f"files outside {', '.join(case.owns) or 'nothing'} touched: {touched}")
    if case.exact:
        summary = scratch / "out" / "summary.json"
        matched = json.loads(summary.read_text()).get("outputs_match_reference") if summary.is_file() else None
        if matched is not True:
            problems.append(f"outputs_match_reference is {matched}, expected True")
    if problems:
        problems.append(f"output ends: {outcome.output[-1500:]}")
    return outcome, problems


def judge_all(cases: list[Hostile], jobs: int = 1) -> list[tuple[Hostile, list[str]]]:
    """Every case in a scratch directory of its own, `jobs` at once."""

    def one(case: Hostile) -> tuple[Hostile, list[str]]:
        with tempfile.TemporaryDirectory(prefix="hostile-") as scratch:
            return case, judge(case, Path(scratch))[1]

    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(one, cases))


def table(cases: list[Hostile]) -> str:
    """The README's table: per class, each case, the exit code it must give and what it must say."""
    lines = ["| class | what the adversary does | exit | the lab says |", "|---|---|---:|---|"]
    for case in sorted(cases, key=lambda c: c.klass):
        says = case.says.replace("|", "\\|")
        slow = " (soak --hostile)" if case.slow else ""
        lines.append(f"| {case.klass}. {CLASSES[case.klass]} | {case.name}{slow} | {case.code} | `{says}` |")
    return "\n".join(lines)
