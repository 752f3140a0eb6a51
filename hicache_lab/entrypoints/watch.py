"""How the launcher watches a spawned world's ranks while they run, so that no wait of its own is unbounded.

* A **heartbeat**: each rank runs a thread (`start_beating`) that writes the time into its slot of an array it
  shares with the launcher. A rank whose slot stops changing for `silence_bound` seconds while its process lives
  is stuck where no bound of its own can act: a thread holding the interpreter in C code (a `--sync-impl` or
  other plug-in), or a process stopped by a signal. The bound lies past every bound a rank keeps itself (a
  collective's timeout, a plug-in call's), so a rank that can end itself always does so first.
* **An exit without a result**: a rank that exited (code 0 included: `os._exit` in code it ran) without writing
  this run's `rank{R}.json` failed.
* **The fork server** that starts the ranks (launch.rank_processes) reports their exit codes. Stopped by a
  signal, it never does: the ranks' processes are zombies and would be waited for forever; the launcher ends it
  (the codes then read 255) and says so. Dead, it took its ranks with it: that is the cause.

A launcher that was itself stopped or starved (its own look came late) gives every rank a fresh start: a pause
of the whole machine is no rank's silence.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from multiprocessing import forkserver
from pathlib import Path

from .ending import exited, process_state
from .report import WorldEnd, read_results

BEAT_S = 0.5  # how often a rank's heartbeat writes
SILENCE_FLOOR_S = 30.0  # the least silence the launcher waits out, however short the collective timeout
LATE_LOOK_S = 2.0  # a look of the launcher's this late after its last: it was paused, not the ranks


def silence_bound(collective_timeout_s: float, grace_s: float) -> float:
    """Seconds without a heartbeat after which a living rank is stuck: past a plug-in call's bound (two
    collective timeouts) and the grace its peers get."""
    return max(SILENCE_FLOOR_S, 2 * collective_timeout_s + 2 * grace_s)


def start_beating(beats, rank: int) -> None:
    """In a rank: write the time into `beats[rank]` every BEAT_S, from a daemon thread."""

    def beat() -> None:
        while True:
            beats[rank] = time.monotonic()
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def fork_server_pid() -> int | None:
    return forkserver._forkserver._forkserver_pid


def release_stopped_server() -> str | None:
    """End the fork server if a signal stopped it (the exit codes it owes then read 255); what was done, in words."""
    server = fork_server_pid()
    state = process_state(server) if server is not None else "gone"
    if not state.startswith("stopped"):
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(server, signal.SIGKILL)
    return f"the fork server that starts the ranks (pid {server}) was {state}: it could not report the ranks' exits"


class Watch:
    """The launcher's look at its ranks, once per tick (`look`): what failed goes into the WorldEnd."""

    def __init__(self, procs: list, beats, out_dir: Path, run_id: str, silence_s: float):
        self.procs, self.beats, self.out_dir, self.run_id, self.silence_s = procs, beats, out_dir, run_id, silence_s
        self.fresh = self.last_look = time.monotonic()  # a rank is silent since no earlier than `fresh`
        self.zombie_since: float | None = None
        self.reported: set[int] = set()

    def look(self, end: WorldEnd) -> bool:
        """Note each rank that failed in `end.failed`; whether any rank still runs."""
        now = time.monotonic()
        if now - self.last_look > LATE_LOOK_S:
            self.fresh = now
        self.last_look, running, zombies = now, False, False
        for rank, proc in enumerate(self.procs):
            code = proc.exitcode
            if code is not None:
                self._note_exit(rank, code, end)
            elif exited(proc.pid):
                zombies = running = True
            else:
                running = True
                silent = now - max(self.beats[rank], self.fresh)
                if silent > self.silence_s:
                    end.failed.setdefault(rank, self._silent_words(proc.pid, silent))
        self._check_server(zombies, now, end)
        return running

    def _note_exit(self, rank: int, code: int, end: WorldEnd) -> None:
        if code == 0 and rank not in self.reported:
            reported = {r["rank"] for r in read_results(self.out_dir, WorldEnd(self.run_id), len(self.procs))}
            self.reported |= reported
            if rank not in reported:
                end.failed.setdefault(
                    rank,
                    "exited with code 0 (code the rank ran ended its process: os._exit, or an exit in a thread)",
                )
        elif code == 255 and ((server := fork_server_pid()) is None or exited(server)):
            end.failed.setdefault(rank, f"ended with the fork server that started it (pid {server}), which died")
        elif code != 0:
            end.failed.setdefault(rank, code)

    def _silent_words(self, pid: int, silent: float) -> str:
        return (
            f"stopped answering (no heartbeat for {silent:.0f} s while its process was {process_state(pid)}: a thread "
            "holding the interpreter in C code, such as a plug-in's busy loop, or a process stopped by a signal)"
        )

    def _check_server(self, zombies: bool, now: float, end: WorldEnd) -> None:
        """A rank that exited but whose exit the fork server has not reported for a while: the server is stuck."""
        if not zombies:
            self.zombie_since = None
            return
        self.zombie_since = self.zombie_since or now
        if now - self.zombie_since > LATE_LOOK_S and (words := release_stopped_server()):
            end.notes.append(words)
