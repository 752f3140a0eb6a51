"""What the classes of hostile cases share: the storage run `R`, the worlds, the user's `--sync-impl` module,
a refusal at start (`refusal`), and the processes of a world found and signalled (`signalled`, `torchrun`).

`R` is the issue's storage run: 4 clients x 3 rounds, host tier and file store (in `store/`, beside the run's
`out/`), caches flushed between rounds so every later round's hits come from storage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from hicache_lab.lab.check.soak_signals import children, forked_ranks
from hicache_lab.lab.presets import WORLD

from .judge import CLEAN_ENV, Hostile, Outcome, reap_session, run_cli, run_in_process

R = [
    *("run", "--num-clients", "4", "--num-rounds", "3", "--enable-hierarchical-cache"),
    *("--hicache-storage-backend", "file", "--hicache-storage-dir", "store", "--flush-cache-between-rounds"),
    *("--storage-prefetch-threshold", "16", "--hicache-storage-prefetch-policy", "wait_complete"),
]
STORE = ("out", "store", "first")  # what a storage case's runs own
OUT = ("--out", "out")
SMALL = ["run", *WORLD.split()]  # presets.WORLD: one rank, 4 clients x 4 rounds, outputs checked
WORLD2 = ["run", *WORLD.split(), "--pp", "2", "--num-rounds", "8"]  # two stages, long enough to signal mid-run
ONE_RANK = ["run", *WORLD.split(), "--num-rounds", "3", "--collective-timeout", "2"]  # user code bound: 4 s
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
TRACE_LINE = {"timestamp": 1, "input_length": 100, "output_length": 5, "hash_ids": [1]}  # a valid Mooncake line


def lines(*rows: object) -> str:
    """JSONL text: dicts and lists as JSON, strings as they are."""
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def refusal(
    klass: int,
    name: str,
    args: list[str],
    says: str,
    *,
    files: dict[str, str | bytes | Callable[[], str]] | None = None,
    env: dict[str, str] | None = None,
    cwd: str = "",
    slow: bool = False,
    in_process: bool = False,
) -> Hostile:
    """A case refused at start: `python -m hicache_lab ARGS` exits 2 saying `says`, and writes nothing. `files`
    (name: text or bytes, or a function giving text) are written beside the run first; `cwd` replaces the scratch
    directory as the working directory; `env` is added to the environment. `in_process`: the CLI runs in this
    process (judge.run_in_process), not a process of its own."""

    def run(scratch: Path) -> Outcome:
        for file, text in (files or {}).items():
            text = text() if callable(text) else text
            (scratch / file).write_bytes(text if isinstance(text, bytes) else text.encode())
        return (run_in_process if in_process else run_cli)(Path(cwd) if cwd else scratch, *args, env=env)

    return Hostile(klass, name, run, 2, says, owns=("out", *(files or {})), slow=slow, in_process=in_process)


def after_filling(change: Callable[[list[Path]], None], flags: tuple[str, ...] = ()):
    """A case that fills the store with R, changes its page files (`change(files)`), then runs R on it again."""

    def run(scratch: Path):
        run_cli(scratch, *R, *flags, "--out", "first")
        change(sorted((scratch / "store").glob("*.bin")))
        return run_cli(scratch, *R, *flags, "--check-outputs", "--out", "out")

    return run


def no_traceback(outcome: Outcome) -> Outcome:
    """`outcome`, failed (no exit code) where its output holds a Python traceback: the lab never prints one."""
    if "Traceback" in outcome.output:
        return Outcome(None, f"{outcome.output}\na traceback was printed", outcome.leftover)
    return outcome


def cli(*args: str) -> Callable[[Path], Outcome]:
    """A case that runs `python -m hicache_lab ARGS --out out`."""
    return lambda scratch: run_cli(scratch, *args, "--out", "out")


# -- user code ------------------------------------------------------------------------------------------------

USER_SYNC = '''\
"""A user's --sync-impl functions that misbehave (hostile/common.py writes this file beside the run)."""
import os
import socket
import sys
import threading
import time


def sleep(self, data):
    time.sleep(3600)


def spin(self, count):
    while True:
        pass


def deaf(self, data):
    mine, theirs = socket.socketpair()
    mine.recv(1)  # a receive no one sends


def leave(self, *args):
    sys.exit(0)


def ends_the_process(self, *args):
    os._exit(0)


def in_c(self, *args):
    sum(range(10**12))  # one C call that holds the interpreter: no other thread of the rank runs meanwhile


def leaves_a_thread(self, *args):
    """The lab's own function, but its first call starts a thread (not a daemon) that sleeps for an hour."""
    if not getattr(self, "threaded", False):
        self.threaded = True
        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    name = "_pp_sync" if hasattr(type(self), "_pp_sync") else "writing_check"
    return getattr(type(self), name)(self, *args)


def leave_on_stage_1(self, data):
    if self.pp_rank == 1:
        sys.exit(0)


def forks(self, *args):
    """The lab's own function, but its first call forks a child that sleeps (and holds what its parent held)."""
    if not getattr(self, "forked", False):
        self.forked = True
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
    name = "_pp_sync" if hasattr(type(self), "_pp_sync") else "writing_check"
    return getattr(type(self), name)(self, *args)
'''
USER_CODE = ("out", "user_sync.py", "user_sync_top.py")  # what a user-code case owns: its run and the modules


def user_code(*args: str, top: str = ""):
    """A case that writes USER_SYNC as user_sync.py (and `top`, module-level code, as user_sync_top.py) beside the
    run, then runs `python -m hicache_lab ARGS --out out` (no bytecode cache: nothing else is written)."""

    def run(scratch: Path) -> Outcome:
        (scratch / "user_sync.py").write_text(USER_SYNC)
        (scratch / "user_sync_top.py").write_text(f"import sys\nimport time\n{top}\n\n\ndef f(self, data):\n    pass\n")
        return run_cli(scratch, *args, "--out", "out", env={"PYTHONDONTWRITEBYTECODE": "1"})

    return run


# -- the processes of a world ---------------------------------------------------------------------------------


def ranks(proc: subprocess.Popen, count: int = 2) -> list[int]:
    """The launcher's (or torchrun's) `count` rank processes, rank 0 first, once there; [] if it ended first."""
    while proc.poll() is None:
        if len(found := forked_ranks(proc.pid) or children(proc.pid, "hicache_lab")) >= count:
            return found
        time.sleep(0.05)
    return []


def running(scratch: Path, proc: subprocess.Popen, rank: int = 1) -> None:
    """Wait until rank `rank` has traced a step of its loop (or the launcher ended)."""
    trace = scratch / "out" / f"trace_rank{rank}.jsonl"
    while proc.poll() is None and not (trace.is_file() and trace.stat().st_size):
        time.sleep(0.05)


def signalled(*flags: str, stop: str = "", launcher: int = 0, group: bool = False, torchrun: bool = False):
    """The two-stage world with `flags`. Rank 1 gets SIGSTOP when it `starts` (before it joins the world) or is
    `running` its loop, if `stop` says so; then the launcher (its whole process group, as Ctrl-C, if `group`)
    gets signal `launcher`, once rank 1 runs."""

    def during(scratch: Path, proc: subprocess.Popen) -> None:
        if not (found := ranks(proc)):
            return
        if stop == "running" or launcher:
            running(scratch, proc)
        if stop:
            os.kill(found[1], signal.SIGSTOP)
        if launcher:
            time.sleep(0.5)
            (os.killpg if group else os.kill)(proc.pid, launcher)

    def run(scratch: Path) -> Outcome:
        args = (*WORLD2, *flags, "--out", "out")
        return (run_torchrun if torchrun else run_cli)(scratch, *args, during=partial(during, scratch))

    return run


def run_torchrun(scratch: Path, *args: str, during=None) -> Outcome:
    """`torchrun --nproc-per-node 2 -m hicache_lab ARGS` in `scratch`, as `run_cli` runs the launcher; torchrun
    starts each rank in a session of its own, so the ranks it started are looked for too once it has ended."""
    seen: set[int] = set()

    def watch(proc: subprocess.Popen) -> None:
        if during is not None:
            threading.Thread(target=during, args=(proc,), daemon=True).start()
        while proc.poll() is None:
            seen.update(children(proc.pid))
            time.sleep(0.05)

    environ = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [*TORCHRUN, "-m", "hicache_lab", *args],
            cwd=scratch,
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        watcher = threading.Thread(target=watch, args=(proc,))
        watcher.start()
        try:
            code = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(proc.pid, signal.SIGKILL)
        watcher.join()
        leftover = [left for pid in {proc.pid, *seen} for left in reap_session(pid)]
        log.seek(0)
        return Outcome(code, log.read(), leftover)
