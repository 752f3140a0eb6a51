"""Class 5, orphan processes: the launcher, torchrun or the whole group signalled mid-run; every rank, and a
`mooncake_master` the launcher started, must end with it; so must what a user's `--sync-impl` forked."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from hicache_lab.lab.check.soak_signals import processes
from hicache_lab.lab.presets import WORLD
from hicache_lab.mem_cache.mooncake_store import mooncake_missing

from .common import SMALL, USER_CODE, WORLD2, children, no_traceback, ranks, running, signalled, user_code
from .judge import LINGER_S, Hostile, Outcome, run_cli


def _master_killed(scratch: Path) -> Outcome:
    """A one-rank run on the Mooncake store whose mooncake_master the launcher started; SIGKILL of the launcher
    mid-run must take the master with it."""

    def during(proc: subprocess.Popen) -> None:
        while proc.poll() is None and not children(proc.pid, "mooncake_master"):
            time.sleep(0.05)
        running(scratch, proc, rank=0)
        proc.kill()

    mooncake = ("--hicache-storage-backend", "mooncake", "--num-rounds", "8")
    return run_cli(scratch, "run", *WORLD.split(), *mooncake, "--out", "out", during=during)


def _one_rank_interrupted(scratch: Path) -> Outcome:
    """Ctrl-C of a one-rank run (its rank runs in the launcher's own process) once it has run a second."""

    def during(proc: subprocess.Popen) -> None:
        running(scratch, proc, rank=0)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)

    long = ("--max-total-tokens", "4096", "--num-clients", "8", "--num-rounds", "40")  # 17 s, unless interrupted
    return run_cli(scratch, "run", *WORLD.split(), *long, "--out", "out", during=during)


def _ctrl_c_three_times(scratch: Path) -> Outcome:
    """Three SIGINTs to the launcher's process group 0.3 s apart, once rank 1 runs: the run still ends with 130,
    its summary, and no traceback from any process."""

    def during(proc: subprocess.Popen) -> None:
        if ranks(proc):
            running(scratch, proc)
            for _ in range(3):
                os.killpg(proc.pid, signal.SIGINT)
                time.sleep(0.3)

    return no_traceback(run_cli(scratch, *WORLD2, "--out", "out", during=during))


def _soak_stopped(scratch: Path) -> Outcome:
    """SIGTERM to a soak once its runs are going: each run is a process group of its own (the soak kills it
    whole past its limit), so the soak must end them itself, not leave them running."""

    def during(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 60
        while proc.poll() is None and not children(proc.pid, "hicache_lab run") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)

    soak = ("soak", "--seed", "5", "--max-ranks", "2", "--runs", "4", "--modes", "fixed", "--jobs", "2")
    outcome = run_cli(scratch, *soak, "--out", "out", "--results", "out", during=during)
    deadline = time.monotonic() + LINGER_S  # a process that is ending may take a moment on a loaded machine
    while (left := _in(scratch)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return Outcome(outcome.code, outcome.output, outcome.leftover + left)


def _in(scratch: Path) -> list[str]:
    """Every process whose working directory is `scratch`."""
    return [f"pid {p}: {c}" for p, c in processes(lambda f: True).items() if _cwd(p) == scratch.resolve()]


def _cwd(pid: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return None


FORKS_ON_STAGES = ("--sync-impl", "pp_sync=user_sync.py:forks")


def _forked_then_run_again(scratch: Path) -> Outcome:
    """A one-rank run whose writing_check forks a sleeping child, then a second run on the same `out/`: the
    child must neither outlive the first run nor hold `out/` locked."""
    first = user_code(*SMALL, "--sync-impl", "writing_check=user_sync.py:forks")(scratch)
    if first.code != 0:
        return first
    again = run_cli(scratch, *SMALL, "--num-rounds", "2", "--out", "out")
    return Outcome(again.code, first.output + again.output, first.leftover + again.leftover)


CASES = [
    Hostile(
        5, "SIGKILL of the launcher while rank 1 is stopped (SIGSTOP)", signalled(stop="running", launcher=9), -9, ""
    ),
    Hostile(
        5,
        "SIGTERM of the launcher while rank 1 is stopped (SIGSTOP)",
        signalled(stop="running", launcher=signal.SIGTERM),
        128 + signal.SIGTERM,
        "interrupted by SIGTERM",
    ),
    Hostile(
        5,
        "Ctrl-C mid-run (SIGINT to the launcher's whole process group)",
        signalled(launcher=signal.SIGINT, group=True),
        128 + signal.SIGINT,
        "interrupted by SIGINT",
    ),
    Hostile(
        5,
        "SIGKILL of torchrun while rank 1 is stopped (its ranks run in sessions of their own)",
        signalled(stop="running", launcher=signal.SIGKILL, torchrun=True),
        -9,
        "",
    ),
    Hostile(
        5,
        "Ctrl-C of a one-rank run (in the launcher's own process)",
        _one_rank_interrupted,
        130,
        "interrupted by SIGINT after",
    ),
    Hostile(
        5,
        "Ctrl-C of torchrun mid-run (it passes SIGINT on to its ranks; it exits 1 for ranks that did not complete)",
        signalled(launcher=signal.SIGINT, group=True, torchrun=True),
        1,
        "interrupted by SIGINT after",
    ),
    Hostile(
        5,
        "SIGKILL of the launcher of a run whose mooncake_master it started",
        _master_killed,
        -9,
        "",
        needs=mooncake_missing,
    ),
    Hostile(
        5,
        "SIGHUP of the launcher mid-run (its terminal closed)",
        signalled(launcher=signal.SIGHUP),
        128 + signal.SIGHUP,
        "interrupted by SIGHUP",
    ),
    Hostile(
        5,
        "a --sync-impl pp_sync that forks a sleeping child on each of two stages",
        user_code(*WORLD2, *FORKS_ON_STAGES),
        0,
        "ended 2 process(es) the run left behind",
        owns=USER_CODE,
        exact=True,
    ),
    Hostile(
        5,
        "a one-rank run whose --sync-impl forks, then a run on its --out",
        _forked_then_run_again,
        0,
        "ended 1 process(es) the run left behind",
        owns=USER_CODE,
        exact=True,
    ),
    Hostile(
        5,
        "Ctrl-C three times, 0.3 s apart, mid-run (SIGINT to the whole process group each time)",
        _ctrl_c_three_times,
        128 + signal.SIGINT,
        "interrupted by SIGINT",
    ),
    Hostile(
        5,
        "SIGTERM of a soak while its runs go (each in a session of its own)",
        _soak_stopped,
        128 + signal.SIGTERM,
        "interrupted by SIGTERM",
    ),
]
