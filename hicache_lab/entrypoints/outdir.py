"""A run owns its output directory (`--out`) for as long as it runs.

* It takes only a new or empty directory, or one a run of the lab wrote before (it holds `MARKER`); a directory
  holding anything else is refused, so a mistyped `--out` never deletes a user's files.
* It locks the directory (`flock` on the marker, released when the process ends, however it ends): a second
  run on it is refused, naming the first one's pid.
* It deletes, of what an earlier run left, only files the lab writes (`LAB_FILES`), and every rank writes the
  run's id (in the marker) into its result, so a summary never merges another run's files.
* A file of the run that cannot be written (full disk, file-size limit, read-only mount) ends the run with
  `OutputError`, which names the file and what to do, never with a traceback: every file of the run is opened by
  `open_run_file`, whose writes, flushes and close (where a buffered write reaches the disk) raise it. A file
  written whole (`write_file`) that could not be is removed, so no empty summary is left to be read as one.
* It never writes through a link: the marker and every run file are opened with `O_NOFOLLOW`, a marker that
  is not a regular file is refused, and the start-of-run cleanup removes links under the lab's names, so a
  link planted in a shared `--out` cannot make a run overwrite the file it points to.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import stat
import time
import uuid
from pathlib import Path
from typing import TextIO

from ..errors import ConfigError

MARKER = ".hicache_lab_run"
LAB_FILES = re.compile(  # every file a run writes into --out (a test holds it to what the runs write)
    r"(rank\d+\.json|trace_rank\d+\.jsonl|rank\d+\.cache_ops\.jsonl|sync_audit_rank\d+\.jsonl|summary\.json"
    r"|requests\.jsonl|hit_rate_vs_sglang\.png)"
)


class OutputError(OSError):
    """A file of the run could not be written; the message names it and says what to do. An OSError of the
    file's (errno, strerror, filename), so a handler of file errors takes it as one."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def cannot_write(path, exc: OSError) -> OutputError:
    code = errno.errorcode.get(exc.errno, str(exc.errno))
    error = OutputError(
        f"cannot write {path}: {exc.strerror} ({code}): make room on its disk (or lift the file-size limit, "
        "ulimit -f), or give --out a writable directory with room"
    )
    error.errno, error.strerror, error.filename = exc.errno, exc.strerror, str(path)
    return error


def _no_links(path: str, flags: int) -> int:
    """`open`'s opener for the run's files: a symbolic link in the path's last part fails (ELOOP)."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


class RunFile:
    """A file of the run, open for writing: `write`, `flush` and `close` raise OutputError naming it where the
    file object would raise OSError, and once one has, every later call raises it again (the file is cut short
    from there). Anything else is the file object's."""

    def __init__(self, file: TextIO, path: Path):
        self._file, self.path, self.name = file, path, str(path)
        self._failure: OSError | None = None

    def __getattr__(self, name: str):
        return getattr(self._file, name)

    def _do(self, call, *args):
        if self._failure is None:
            try:
                return call(*args)
            except OSError as exc:
                self._failure = exc
                with contextlib.suppress(OSError):  # what is left in its buffer cannot be written either
                    self._file.close()
        raise cannot_write(self.path, self._failure) from None

    def write(self, text: str) -> int:
        return self._do(self._file.write, text)

    def flush(self) -> None:
        self._do(self._file.flush)

    def close(self) -> None:
        self._do(self._file.close)

    def __enter__(self) -> RunFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_run_file(path: Path) -> RunFile:
    """`path` opened for writing from its start, never through a symbolic link (OutputError if it is one)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return RunFile(open(path, "w", opener=_no_links), path)  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OutputError(f"{path} is a symbolic link: a run never writes through one; remove it") from None
        raise cannot_write(path, exc) from None


def write_file(path: Path, text: str) -> None:
    """`path` holding `text`, or OutputError (and, a regular file, `path` removed: it would be read cut short)."""
    file = open_run_file(path)
    try:
        with file:
            file.write(text)
    except OutputError:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(path.lstat().st_mode):
                path.unlink()
        raise


def _is_marker(path: Path) -> bool:
    """Whether an earlier run of the lab left `path`; ConfigError if it is there but not a regular file."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise ConfigError(
            f"--out {path.parent}: {MARKER} is not a regular file (a link, or something else a run never writes): "
            "remove it, or give another --out"
        )
    return True


class Claim:
    """The run's hold on its output directory: `run_id` names the run; `release()` (or the end of the process)
    lets another run have it. The marker it leaves says that a run of the lab wrote the directory."""

    def __init__(self, out: Path):
        self.out, self.run_id = out, uuid.uuid4().hex[:12]
        try:
            out.mkdir(parents=True, exist_ok=True)
            ours = _is_marker(out / MARKER)
            foreign = sorted(p.name for p in out.iterdir() if p.name != MARKER)
        except OSError as exc:
            raise ConfigError(f"--out {out}: {exc.strerror}: give a directory you can write") from None
        if foreign and not ours:
            names = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ConfigError(
                f"--out {out} holds files no run of the lab wrote ({names}): give a new or empty directory "
                "(a run deletes what an earlier run left there)"
            )
        try:  # held open (and locked) until release()
            self.file = open(out / MARKER, "a+", opener=_no_links)  # noqa: SIM115
        except OSError as exc:
            raise cannot_write(out / MARKER, exc) from None
        os.register_at_fork(after_in_child=self._forked)
        try:
            self._lock()
        except BaseException:
            self.release()
            raise

    def _lock(self) -> None:
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            try:
                pid = json.loads(self.file.read()).get("pid", "?")
            except ValueError:  # being written by its owner this very moment
                pid = "?"
            raise ConfigError(
                f"--out {self.out} is in use by another run (pid {pid}): wait for it to end, or give another --out"
            ) from None
        for path in self.out.iterdir():
            if LAB_FILES.fullmatch(path.name) and (path.is_symlink() or path.is_file()):
                path.unlink()  # a link itself, never what it points to
        try:
            self.file.truncate(0)
            self.file.write(json.dumps({"run_id": self.run_id, "pid": os.getpid(), "started": time.time()}) + "\n")
            self.file.flush()
        except OSError as exc:
            raise cannot_write(self.out / MARKER, exc) from None

    def _forked(self) -> None:
        """In a process forked from the run (a user's --sync-impl may fork): it must not hold the lock."""
        with contextlib.suppress(OSError):
            self.file.close()

    def release(self) -> None:
        with contextlib.suppress(OSError):  # a marker that could not be written was reported already
            self.file.close()

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
