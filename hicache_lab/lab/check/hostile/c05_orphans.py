"""Class 5, orphan processes: the launcher, torchrun or the whole group signalled mid-run; every rank, and a
`mooncake_master` the launcher started, must end with it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from ....mem_cache.hicache_storage import mooncake_missing
from ...presets import WORLD
from .common import children, running, signalled
from .judge import Hostile, Outcome, run_cli


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
]
