"""What the soak does to a case while it runs (soak.py): stop one rank for a while (`pause`: SIGSTOP, then
SIGCONT), or interrupt the whole run as Ctrl-C would (`interrupt`: SIGINT to its process group). Each waits
for the case's ranks first and says in words what happened."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from .hostile.common import forked_ranks


def rank_pids(launcher: int, ranks: int, own_process: bool) -> list[int]:
    """The rank processes of a launcher, in rank order (forked in order by its fork server; a world of one rank
    runs in the launcher, unless it runs a plug-in: `own_process`)."""
    return [launcher] if ranks == 1 and not own_process else forked_ranks(launcher)


def _ranks_started(proc: subprocess.Popen, ranks: int, own_process: bool, done: threading.Event) -> list[int]:
    while len(pids := rank_pids(proc.pid, ranks, own_process)) < ranks:
        if done.wait(0.1):
            return []
    return pids


def pause(proc: subprocess.Popen, case, done: threading.Event) -> str:
    """Stop rank R of the running case for D s, T s after its ranks have started (`Case.pause`: "R@T+D")."""
    rank, _, timing = case.pause.partition("@")
    after, _, length = timing.partition("+")
    if not (pids := _ranks_started(proc, case.ranks, bool(case.plugin), done)):
        return "ended before its ranks were found"
    if done.wait(float(after)):
        return "ended before the pause"
    try:
        os.kill(pids[int(rank)], signal.SIGSTOP)
        time.sleep(float(length))
        os.kill(pids[int(rank)], signal.SIGCONT)
    except ProcessLookupError:
        return "the rank ended during the pause"
    return "paused"


def interrupt(proc: subprocess.Popen, case, done: threading.Event) -> str:
    """SIGINT to the run's whole process group, as Ctrl-C in its terminal, T s after its ranks have started
    (`Case.interrupt`: "T")."""
    if not _ranks_started(proc, case.ranks, bool(case.plugin), done):
        return "ended before its ranks were found"
    if done.wait(float(case.interrupt)):
        return "ended before the interrupt"
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        return "ended before the interrupt"
    return "interrupted"
