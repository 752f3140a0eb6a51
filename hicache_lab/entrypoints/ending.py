"""How a run's processes end: none outlives its launcher, and a signal ends the run with its files written.

* `die_with_parent`: a rank (or the `mooncake_master` the launcher starts) gets SIGKILL when its parent dies
  (Linux `prctl(PR_SET_PDEATHSIG)`, set in the child, then a check that the parent did not die first; where
  prctl is unavailable, a thread polls the parent's pid). A rank's parent is the launcher's fork server
  (launch.py): a thread polls the launcher's pid as well. So SIGKILL of the launcher leaves nothing behind.
* `SignalGuard`: SIGINT, SIGTERM and SIGHUP raise `Interrupted` in the main thread, which ends the run through its usual
  path (partial results, a summary that says what interrupted it). A Python handler runs only between bytecodes,
  never while the main thread is blocked in C++ (a gloo collective waiting for a stuck peer): a watcher thread,
  woken by the same signal (`signal.set_wakeup_fd`), then runs what the process owes itself (`owe`) and exits.
* `Adopted`: a process a run's code forked (a user's `--sync-impl` may) outlives neither its rank nor the run:
  the launcher is its subreaper (Linux `PR_SET_CHILD_SUBREAPER`), so such a process becomes the launcher's
  child when its own parent ends, and the launcher kills and reaps every child the run left at its end.
* `process_state`: what a process is doing, from /proc (a rank that never reported: stopped, sleeping, gone);
  `exited`: whether it has ended; `cpu_seconds`: whether it is still working.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # a closed terminal or ssh session sends SIGHUP
WAIT_S = 1.0  # how long the watcher gives the main thread to take a signal before it acts in its place
STUCK_S = 30.0  # how long a process may take to end after it took a signal before the watcher ends it
STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped by a signal"}
STATES |= {"t": "stopped by a debugger", "Z": "a zombie (it has exited)", "X": "dead"}


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP reached the run (a BaseException: `except Exception` does not take it for a crash)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.name = signum, signal.Signals(signum).name


def _prctl(option: int, value: int) -> bool:
    """Linux prctl(option, value); False where prctl is unavailable."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _pdeathsig() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False where prctl is unavailable."""
    return _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def children() -> dict[int, str]:
    """{pid: command} of this process's live children (Linux /proc; empty elsewhere)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            if int(ppid) == os.getpid() and state != "Z":
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
        except (OSError, ValueError):
            continue  # it ended while being read
    return found


class Adopted:
    """While entered, orphans of the run's processes become this process's children; at the exit, every child
    that was not there before (less `keep()`: the fork server and multiprocessing's resource tracker, which
    serve later runs) is killed and reaped, and `left` names them."""

    def __init__(self, keep: Callable[[], set[int]]):
        self.keep, self.left = keep, []

    def __enter__(self) -> Adopted:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.before = set(children())
        return self

    def __exit__(self, *exc) -> None:
        _prctl(PR_SET_CHILD_SUBREAPER, 0)  # orphans after the run are not this process's (a notebook's kernel)
        for pid, command in children().items():
            if pid not in self.before and pid not in self.keep():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                self.left.append(f"pid {pid} ({command.strip()})")


def _watch(parent: int, launcher: int) -> None:
    while os.getppid() == parent and not exited(launcher):
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(launcher: int) -> None:
    """This process ends when its parent or `launcher` does, even by SIGKILL; if either is gone already, at once.
    Its parent is `launcher`, or the launcher's fork server (launch.rank_processes), which outlives the launcher
    while ranks it forked hold its pipe: a thread then watches the launcher itself."""
    parent = os.getppid()
    if not _pdeathsig() or parent != launcher:
        threading.Thread(target=_watch, args=(parent, launcher), daemon=True).start()
    if os.getppid() != parent or exited(launcher):  # it died before prctl took effect
        os._exit(1)


def exited(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie has: it only waits for its parent to see it)."""
    if Path("/proc").is_dir():
        state = process_state(pid)
        return state == "gone" or state.startswith(("a zombie", "dead"))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: it exists
        pass
    return False


def master_preexec(parent: int) -> Callable[[], None]:
    """`preexec_fn` for a child program (mooncake_master): parent-death signal set between fork and exec."""

    def preexec() -> None:
        if _pdeathsig() and os.getppid() != parent:
            os._exit(1)

    return preexec


def process_state(pid: int) -> str:
    """What process `pid` is doing now, in words: its /proc/PID/stat state and, asleep, the kernel call it waits in."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return "gone"
    state = stat[stat.rindex(")") + 2]
    waits = f", waiting in {wchan}" if state in "SD" and wchan not in ("", "0") else ""
    return f"{STATES.get(state, 'in state ' + state)} (state {state}{waits})"


def cpu_seconds(pid: int) -> float | None:
    """The CPU time process `pid` has used (user + system, from /proc/PID/stat); None where it is gone or unknown:
    a rank whose CPU time grows is working, however long that takes on a loaded machine."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_ENTERED: list[SignalGuard] = []  # the guards entered in this process (one, in the main thread)


def _after_fork_in_child() -> None:
    while _ENTERED:
        _ENTERED.pop().forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class SignalGuard:
    """SIGINT, SIGTERM and SIGHUP, for as long as it is entered (in the main thread; elsewhere it does nothing).

    The first signal raises `Interrupted` in the main thread unless the run is already `finishing` (writing its
    files: a signal then must not tear them). If the main thread has not taken a signal within WAIT_S (it is
    blocked in C++), the watcher thread runs what the process owes, newest first (`owe`), and exits 128 + signal.
    So it does when a second signal comes (the files the main thread is writing may be cut short: asked twice,
    the user means it), and when the process has not ended within STUCK_S of the first (it took the signal, then
    blocked on the way out).
    """

    def __init__(self) -> None:
        self.owed: list[Callable[[str], None]] = []
        self.finishing, self._lock = False, threading.Lock()  # the lock: who writes the files, main or watcher
        self.received = self.taken = 0
        self.interrupted: Interrupted | None = None
        self._saved: dict | None = None
        self._closed = False

    def owe(self, write: Callable[[str], None]) -> None:
        """`write(signal name)` runs if a signal finds the main thread stuck (it reads state the main thread left)."""
        self.owed.append(write)

    def finish(self) -> None:
        """From here the process writes its files: signals are noted, no longer raised (idempotent)."""
        if not self.finishing:
            self.finishing = True
            self._lock.acquire()  # the watcher holds it only to write and exit: then this waits for the exit

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        read, write = os.pipe()
        os.set_blocking(write, False)
        handlers = {s: signal.signal(s, self._handler) for s in SIGNALS}
        self._saved = {"handlers": handlers, "fd": signal.set_wakeup_fd(write), "pipe": (read, write)}
        self._watcher = threading.Thread(target=self._watch, args=(read,), daemon=True)
        self._watcher.start()
        _ENTERED.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        _ENTERED.remove(self)
        signal.set_wakeup_fd(self._saved["fd"])
        for signum, handler in self._saved["handlers"].items():
            signal.signal(signum, handler)
        self._closed = True
        os.close(self._saved["pipe"][1])  # the watcher reads end-of-file and leaves:
        self._watcher.join(WAIT_S + 1)  # a daemon thread still there at exit dies in pthread_exit, C++ terminate()

    def forget_in_child(self) -> None:
        """In a child forked while entered (a `--sync-impl` that forks): its signals are its own, and it holds
        no end of the watcher's pipe, or the watcher would wait for the child's end-of-file too (and, at the
        parent's exit, die in C++ terminate()), and read the child's signals as the parent's."""
        signal.set_wakeup_fd(-1)
        for fd in self._saved["pipe"]:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _handler(self, signum: int, frame) -> None:
        self.taken += 1
        if self.interrupted is None and not self.finishing:
            self.interrupted = Interrupted(signum)
            raise self.interrupted

    def _watch(self, read: int) -> None:
        while data := os.read(read, 1):
            if data[0] not in SIGNALS:
                continue  # another handler's signal
            self.received += 1
            if self.received == 1:
                threading.Thread(target=self._unless_ended, args=(data[0],), daemon=True).start()
            time.sleep(WAIT_S)
            if not self._closed and self.taken < self.received:
                self._leave(data[0])  # the main thread is blocked in C++: it cannot take the signal
            if not self._closed and self.received > 1:
                self._leave(data[0])  # asked again: the user means it, whatever the main thread is doing
        os.close(read)

    def _unless_ended(self, signum: int) -> None:
        """After the first signal: a process that has not ended within STUCK_S (its main thread took the signal,
        then blocked on the way out: a thread that never joins) leaves."""
        time.sleep(STUCK_S)
        if not self._closed:
            self._leave(signum)

    def _leave(self, signum: int) -> None:
        """Write what the process owes (unless the main thread is writing its files), then exit 128 + signal."""
        if self._lock.acquire(blocking=False):
            name = signal.Signals(signum).name
            for write in reversed(self.owed):
                with contextlib.suppress(Exception):
                    write(name)
        os._exit(128 + signum)
