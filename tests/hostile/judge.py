"""Hostile input: what an adversarial user tries, and what the lab must answer.

Each case runs `python -m hicache_lab ...` (one process or several; a preflight refusal in this process) in a
scratch directory of its own, which holds a user's files beside the run, and is judged on five things:

* the **exit code** it must end with (2: refused at start; 1: the run failed and says why; 130: interrupted);
* a **message** its output must contain, naming the flag, the file and line, or the rank to blame;
* **no process left**: every process of the case's session is gone soon after the launcher ends (in this
  process: no thread and no child process it started outlives it);
* **no file touched** outside the directories the run owns (`owns`, relative to the scratch directory);
* **outputs exact** where the run completes (`exact`: its summary's oracle says every output matches).

The cases live in `c01_*.py` ... `c11_*.py` beside this file, one per class (`CLASSES`), gathered in
`cases.py`; `make test` runs the fast ones (tests/hostile/test_hostile.py), `python -m hicache_lab soak --hostile`
all of them (`command.py`), and `soak --hostile --table` prints `table()` of them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hicache_lab.lab.check.soak_signals import processes

LINGER_S = 5.0  # how long a case's processes may outlive its launcher before they count as left behind
USER_FILES = {"rank0.json": '{"mine": true}\n', "notes.txt": "a user's notes\n"}  # beside every case's run
CLEAN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@dataclass
class Outcome:
    code: int | None  # None: it outlived its limit and was killed
    output: str
    leftover: list[str] = field(default_factory=list)  # processes (or threads) still alive after LINGER_S


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
    in_process: bool = False  # `run` runs the CLI in this process (run_in_process): one such case at a time


CLASSES = {  # the class, and the module of its cases
    1: ("Storage serves another model's KV", "c01_foreign_model"),
    2: ("A page under another page's name", "c02_misnamed_pages"),
    3: ("One stage's damaged page", "c03_damaged_stage"),
    4: ("Hangs no timeout covers", "c04_hangs"),
    5: ("Orphan processes", "c05_orphans"),
    6: ("Lost or mixed files", "c06_mixed_files"),
    7: ("Ranks started with different flags", "c07_different_flags"),
    8: ("Failures that exit 0", "c08_silent_failures"),
    9: ("Blame and summaries", "c09_blame"),
    10: ("Values the preflight must refuse", "c10_preflight"),
    11: ("Verdicts that could be fooled", "c11_verdicts"),
}


def run_cli(
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


def run_in_process(scratch: Path, *args: str, env: dict[str, str] | None = None) -> Outcome:
    """`python -m hicache_lab ARGS` as `run_cli` runs it, in this process: the package run as `-m` runs it
    (runpy: `sys.exit(main())`; lab/ is below the CLI and does not import it), with `scratch` as the working
    directory, the environment `run_cli` gives, and stdout and stderr captured. For what is refused before
    anything starts, without a process start (3-4 s). The working directory, environment, sys.argv and output
    streams are the process's: run one at a time, with no other case running (judge_all does). A thread (of
    `threading` or not: the kernel's count) or a child process that it started and that outlives it by
    LINGER_S is left behind."""
    threads, tasks, children = set(threading.enumerate()), _tasks(), set(_children_of_this_process())
    output = io.StringIO()
    with _as_the_process(scratch, env, args), contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        try:
            runpy.run_module("hicache_lab", run_name="__main__")
            code = 0
        except SystemExit as exit_:  # the exit status the interpreter gives for what sys.exit was given
            code = 0 if exit_.code is None else exit_.code
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        except Exception:  # a traceback, as the interpreter prints it, and exit 1
            traceback.print_exc()
            code = 1
    deadline = time.monotonic() + LINGER_S
    while ((new := [t for t in threading.enumerate() if t not in threads]) or _tasks() > tasks) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    leftover = [f"thread {t.name!r} of this process" for t in new]
    if (unnamed := _tasks() - tasks - len(new)) > 0:  # started outside `threading` (C++, _thread)
        leftover.append(f"{unnamed} more thread(s) of this process, not of `threading`")
    for pid, command in _children_of_this_process().items():
        if pid not in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            leftover.append(f"pid {pid}: {command}")
    return Outcome(code, output.getvalue(), leftover)


@contextlib.contextmanager
def _as_the_process(scratch: Path, env: dict[str, str] | None, args: tuple[str, ...]) -> Iterator[None]:
    """This process as `run_cli`'s would be: working directory `scratch`, its environment, argv `ARGS`."""
    environ, cwd, argv = dict(os.environ), os.getcwd(), sys.argv
    os.chdir(scratch)
    for name in CLEAN_ENV:
        os.environ.pop(name, None)
    os.environ.update(env or {})
    sys.argv = ["python -m hicache_lab", *args]
    try:
        with warnings.catch_warnings():  # runpy warns when the tests have imported hicache_lab.__main__ too
            warnings.filterwarnings("ignore", "'hicache_lab.__main__' found in sys.modules", RuntimeWarning)
            yield
    finally:
        sys.argv = argv
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)


def _tasks() -> int:
    """The threads of this process, as the kernel counts them (Linux)."""
    return len(os.listdir("/proc/self/task"))


def _children_of_this_process() -> dict[int, str]:
    return processes(lambda f: int(f[1]) == os.getpid())


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
        problems.append(f"processes or threads left behind: {outcome.leftover}")
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
    """Every case in a scratch directory of its own, in the order given: first those that run in this process,
    one at a time and before any other starts (each takes the process's working directory, environment and
    output streams), then the rest `jobs` at once."""

    def one(case: Hostile) -> tuple[Hostile, list[str]]:
        with tempfile.TemporaryDirectory(prefix="hostile-") as scratch:
            return case, judge(case, Path(scratch))[1]

    alone = iter([one(case) for case in cases if case.in_process])
    with ThreadPoolExecutor(jobs) as pool:
        rest = iter(list(pool.map(one, [case for case in cases if not case.in_process])))
    return [next(alone if case.in_process else rest) for case in cases]


def table(cases: list[Hostile]) -> str:
    """The README's table: per class, each case, the exit code it must give and what it must say."""
    lines = ["| class | what the adversary does | exit | the lab says |", "|---|---|---:|---|"]
    for case in sorted(cases, key=lambda c: c.klass):
        says = case.says.replace("|", "\\|")
        slow = " (soak --hostile)" if case.slow else ""
        lines.append(f"| {case.klass}. {CLASSES[case.klass][0]} | {case.name}{slow} | {case.code} | `{says}` |")
    return "\n".join(lines)
