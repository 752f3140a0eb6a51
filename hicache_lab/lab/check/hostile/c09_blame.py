"""Class 9, blame and summaries: a rank stopped, killed or out of disk; the summary names the rank that caused
it and why, not the ranks that waited for it."""

from __future__ import annotations

import resource
import subprocess
from collections.abc import Callable
from pathlib import Path

from .common import SMALL, WORLD2, run_torchrun, signalled
from .judge import Hostile, Outcome, run_cli

STOPPED = "rank 1 never reported: its process was stopped by a signal (state T)"


def _file_size_limit(limit: int, *args: str) -> Callable[[Path], Outcome]:
    """A full disk, without root: the run with RLIMIT_FSIZE at `limit` bytes (Python ignores SIGXFSZ, so a write
    past it fails with EFBIG), set on the launcher as it starts (before it writes) and inherited by its ranks."""

    def during(proc: subprocess.Popen) -> None:
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))

    return lambda scratch: run_cli(scratch, *args, "--out", "out", during=during)


CASES = [
    Hostile(9, "SIGSTOP on rank 1 mid-run", signalled("--collective-timeout", "5", stop="running"), 1, STOPPED),
    Hostile(
        9,
        "SIGSTOP on rank 1 before it joins the world",
        signalled("--collective-timeout", "5", stop="starts"),
        1,
        STOPPED,
    ),
    Hostile(
        9,
        "torchrun, --fault kill-rank:1@10 (torchrun then SIGTERMs rank 0)",
        lambda s: run_torchrun(s, *WORLD2, "--fault", "kill-rank:1@10", "--out", "out"),
        1,
        "crashed (rank 1): rank 1 died (its process is gone) without a result",
    ),
    Hostile(
        9,
        "a full disk (a file-size limit of 8 KiB) under one rank",
        _file_size_limit(8192, *SMALL),
        1,
        "cannot write out/trace_rank0.jsonl: File too large (EFBIG)",
    ),
    Hostile(
        9,
        "a full disk (a file-size limit of 8 KiB) under two ranks",
        _file_size_limit(8192, *WORLD2),
        1,
        "cannot write out/trace_rank",
    ),
    Hostile(
        9,
        "torchrun, SIGSTOP on rank 1 mid-run",
        signalled("--collective-timeout", "5", stop="running", torchrun=True),
        1,
        "rank 1 never reported: its process is stopped by a signal (state T)",
        slow=True,
    ),
]
