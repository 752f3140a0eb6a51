"""`python -m hicache_lab student-edition DIR`: the repository as a student gets it for a graded session, without
`teaching/` (the exercise's answers, the catalogue of wrong ones, the homework's answers).

Everything else is as committed, but for the documents that hold an exercise's recipe, shipped as closed.py's
`EDITS` rewrite them: no file of the edition states an exercise's algorithm, or lets a student's function call one
that does its work (tests/lab/test_student_path.py checks every file), and the tests that need `teaching/` skip
in the edition, saying why. What a student edition cannot hide are the files the lab runs that hold its answers
(`CLOSED`): ask students to keep them closed until their three functions pass.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from ...entrypoints.outdir import OutputError
from ...entrypoints.preflight import check_writable_dir
from ...errors import ConfigError
from .closed import CLOSED, LEFT_OUT, ROOT, for_students

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a disk that filled (or a limit reached) as the edition was written


def git(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=120)
    except FileNotFoundError:
        raise ConfigError(
            "student-edition cuts the edition with git, and there is no git on PATH: install git, or add its "
            "directory to PATH"
        ) from None


def check_checkout() -> None:
    """ROOT is a git checkout this user's git will read; a ConfigError in git's own words otherwise."""
    probe = git("rev-parse", "--is-inside-work-tree")
    if probe.returncode == 0:
        return
    said = probe.stderr.decode(errors="replace").strip().splitlines()
    first = said[0] if said else f"exit {probe.returncode}"
    if "dubious ownership" in first:
        raise ConfigError(
            f"git refuses to read {ROOT}, which another user owns (git said: {first!r}): run as its owner, or "
            f"let git trust it: git config --global --add safe.directory {ROOT}"
        )
    raise ConfigError(f"{ROOT} is not a git checkout (git said: {first!r}): a student edition is cut from its HEAD")


def check_target(out: Path) -> None:
    """`out` can take an edition: new or an empty directory, outside the repository, where this user can write."""
    if out.is_symlink() and not out.exists():
        raise ConfigError(
            f"{out} is a symbolic link to {os.readlink(out)}, which does not exist: remove the link, or give a "
            "new directory"
        )
    try:
        taken = out.exists() and (not out.is_dir() or any(out.iterdir()))
    except OSError as exc:
        raise ConfigError(f"{out}: {exc.strerror}: give a directory you can read and write") from None
    if taken:
        raise ConfigError(f"{out} exists and is not an empty directory: give a new one")
    if out.resolve().is_relative_to(ROOT.resolve()):
        raise ConfigError(f"{out} is inside the repository: give a directory outside it")
    check_writable_dir(out, "student-edition")


def make_edition(out: Path) -> list[str]:
    """Write HEAD's tree, less `teaching/`, into `out` (absent or empty). Returns the paths written. Where it
    cannot be written whole, what was written is removed (a rerun then starts on a new or empty directory)."""
    check_checkout()
    out = Path(out)
    check_target(out)
    archive = git("archive", "--format=tar", "HEAD", "--", ".", f":(exclude){LEFT_OUT}")
    if archive.returncode != 0:
        raise ConfigError(f"git archive failed: {archive.stderr.decode(errors='replace').strip()}")
    missing = [p for p in (out.absolute(), *out.absolute().parents) if not p.exists()]
    made = missing[-1] if missing else None  # the first directory this call creates (None: `out` was there)
    member = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            # git's own archive of this repository: members are plain files and folders below `out` (Python
            # before 3.11.4 has no extraction filter)
            for member in tar:
                tar.extract(member, out, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            files = [m.name for m in tar.getmembers() if m.isfile()]
        member = None  # written whole: an error from here on is not the archive's
        for_students(out)
        return files
    except ConfigError:
        _remove(out, made)
        raise
    except OSError as exc:
        _remove(out, made)
        where = f" at {member.name}" if member is not None else ""
        if exc.errno in FULL:
            raise OutputError(
                f"cannot write the student edition into {out}{where}: {exc.strerror}; what it wrote is removed: "
                "make room on its disk (or lift the file-size limit, ulimit -f) and run it again"
            ) from None
        raise ConfigError(f"cannot write into {out}{where}: {exc.strerror}: give a directory you can write") from None


def _remove(out: Path, made: Path | None) -> None:
    """What `make_edition` wrote: the directories it made, or, in a directory that was there (empty), all in it."""
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        return
    for path in out.iterdir() if out.is_dir() else ():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


def add_edition_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="a new (or empty) directory outside the repository")


def cmd_edition(args: argparse.Namespace) -> int:
    files = make_edition(Path(args.out))
    changed = git("status", "--porcelain", "--untracked-files=no").stdout.decode().strip()
    print(f"{args.out}: {len(files)} files of HEAD, without {LEFT_OUT}/")
    if changed:
        print("(uncommitted changes are not in it: commit them and cut it again)")
    closed = (f"{path}: {what}" for path, what in CLOSED.items())
    print("Ask students to keep closed until their functions pass:", *closed, sep="\n  ")
    return 0
