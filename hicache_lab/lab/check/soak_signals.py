"""What the soak does to a case while it runs (soak.py): stop one rank for a while (`pause`: SIGSTOP, then
SIGCONT), or interrupt the whole run as Ctrl-C would (`interrupt`: SIGINT to its process group). Each waits
for the case's ranks first (`forked_ranks`: a launcher's rank processes, found in /proc, as the hostile-input
suite in tests/hostile/ finds them too) and says in words what happened."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path


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


def _started(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def children(pid: int, word: str = "") -> list[int]:
    """The live children of `pid` whose command line holds `word`, first started first."""
    found = [p for p, command in processes(lambda f: int(f[1]) == pid).items() if word in command]
    with contextlib.suppress(OSError):
        return sorted(found, key=_started)
    return []


def forked_ranks(launcher: int) -> list[int]:
    """The live rank processes of a launcher, first started first: its fork server's children (the server is the
    launcher's child: launch.rank_processes)."""
    found = [rank for server in children(launcher, "multiprocessing.forkserver") for rank in children(server)]
    with contextlib.suppress(OSError):
        return sorted(found, key=_started)
    return []


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
