"""A run owns its output directory (`--out`) for as long as it runs.

* It takes only a new or empty directory, or one a run of the lab wrote before (it holds `MARKER`); a directory
  holding anything else is refused, so a mistyped `--out` never deletes a user's files.
* It locks the directory (`flock` on the marker, released when the process ends, however it ends): a second
  run on it is refused, naming the first one's pid.
* It deletes, of what an earlier run left, only files the lab writes (`LAB_FILES`), and every rank writes the
  run's id (in the marker) into its result, so a summary never merges another run's files.
* A file of the run that cannot be written (full disk, file-size limit, read-only mount) ends the run with
  `OutputError`, which names the file and what to do, never with a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
import uuid
from pathlib import Path

from ..errors import ConfigError

MARKER = ".hicache_lab_run"
LAB_FILES = re.compile(
    r"(rank\d+\.json|trace_rank\d+\.jsonl|rank\d+\.cache_ops\.jsonl|summary\.json|requests\.jsonl"
    r"|hit_rate_vs_sglang\.png)"
)


class OutputError(Exception):
    """A file of the run could not be written; the message names it and says what to do."""


def cannot_write(path, exc: OSError) -> OutputError:
    code = errno.errorcode.get(exc.errno, str(exc.errno))
    return OutputError(
        f"cannot write {path}: {exc.strerror} ({code}): make room on its disk (or lift the file-size limit, "
        "ulimit -f), or give --out a writable directory with room"
    )


def write_file(path: Path, text: str) -> None:
    """`path.write_text(text)`, or OutputError."""
    try:
        path.write_text(text)
    except OSError as exc:
        raise cannot_write(path, exc) from None


class Claim:
    """The run's hold on its output directory: `run_id` names the run; `release()` (or the end of the process)
    lets another run have it. The marker it leaves says that a run of the lab wrote the directory."""

    def __init__(self, out: Path):
        self.out, self.run_id = out, uuid.uuid4().hex[:12]
        try:
            out.mkdir(parents=True, exist_ok=True)
            ours = (out / MARKER).is_file()
            foreign = sorted(p.name for p in out.iterdir() if p.name != MARKER)
        except OSError as exc:
            raise ConfigError(f"--out {out}: {exc.strerror}: give a directory you can write") from None
        if foreign and not ours:
            names = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ConfigError(
                f"--out {out} holds files no run of the lab wrote ({names}): give a new or empty directory "
                "(a run deletes what an earlier run left there)"
            )
        try:
            self.file = (out / MARKER).open("a+")  # noqa: SIM115 - held open (and locked) until release()
        except OSError as exc:
            raise cannot_write(out / MARKER, exc) from None
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
            if path.is_file() and LAB_FILES.fullmatch(path.name):
                path.unlink()
        try:
            self.file.truncate(0)
            self.file.write(json.dumps({"run_id": self.run_id, "pid": os.getpid(), "started": time.time()}) + "\n")
            self.file.flush()
        except OSError as exc:
            raise cannot_write(self.out / MARKER, exc) from None

    def release(self) -> None:
        with contextlib.suppress(OSError):  # a marker that could not be written was reported already
            self.file.close()

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
