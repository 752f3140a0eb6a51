"""`python -m hicache_lab student-edition DIR`: the repository as a student gets it for a graded session, as a git
repository of one commit, without `teaching/` (the exercise's answers, the catalogue of wrong ones, the homework's
answers), the session path's notebooks (`CLEARED`) without their outputs (a prediction comes before its run) and
set for class (`IN_CLASS = True`). No document on the student path holds an answer (tests/lab/test_student_path.py
checks it), and the tests that need `teaching/` skip in the edition, saying why. What a student edition cannot
hide is the package's own source, which holds the lab's answers (`CLOSED`): docs/lab_session.md asks students to
keep it closed until their three functions pass.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import nbformat

from ...entrypoints.outdir import OutputError
from ...entrypoints.preflight import check_writable_dir
from ...errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]  # the repository this package was installed from
LEFT_OUT = "teaching"
CLOSED = (  # where the lab's own answers to notebook 06 are, in the package's source
    "hicache_lab/distributed/cache_sync.py (CacheSync._pp_sync, CacheSync._attn_groups)",
    "hicache_lab/mem_cache/hiradix_cache.py (HiRadixCache.writing_check)",
)
CLEARED = ("notebooks/01_hicache_tour.ipynb", "notebooks/02_pp_queue_divergence.ipynb", "notebooks/06_exercises.ipynb")
AUTHOR = ("-c", "user.name=hicache_lab student-edition", "-c", "user.email=student-edition@hicache-lab.invalid")
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a disk that filled (or a limit reached) as the edition was written


def git(*args: str, where: Path = ROOT) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, timeout=120)
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
    """Write HEAD's tree, less `teaching/`, into `out` (absent or empty) and commit it there. Returns the paths
    written. Where it cannot be written whole, what was written is removed (a rerun starts on an empty directory)."""
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
            for path in CLEARED:  # as a student gets it (`member`: where a full disk would have stopped it)
                member = tar.getmember(path)
                for_class(out / path)
            commit(out)
            return [m.name for m in tar.getmembers() if m.isfile()]
    except (ConfigError, OSError) as exc:
        _remove(out, made)
        if isinstance(exc, ConfigError):  # from git
            raise
        where = f" at {member.name}" if member is not None else ""
        if exc.errno in FULL:
            raise OutputError(
                f"cannot write the student edition into {out}{where}: {exc.strerror}; what it wrote is removed: "
                "make room on its disk (or lift the file-size limit, ulimit -f) and run it again"
            ) from None
        raise ConfigError(f"cannot write into {out}{where}: {exc.strerror}: give a directory you can write") from None


def for_class(path: Path) -> None:
    """The notebook at `path` without outputs, execution counts or timings, its parameter `IN_CLASS` True."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
            cell.source = re.sub(r"^IN_CLASS = False\b", "IN_CLASS = True", cell.source, flags=re.M)
    nbformat.write(nb, path)


def commit(out: Path) -> None:
    """Make `out` a git repository of one commit, by a fixed author (no git identity need be configured)."""
    record = (*AUTHOR, "-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-m", "Student edition")
    for step in (("init", "-q"), ("add", "-A"), record):
        done = git("-c", "init.defaultBranch=main", *step, where=out)
        if done.returncode != 0:
            raise ConfigError(f"git could not commit in {out}: {done.stderr.decode(errors='replace').strip()!r}")


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
    cleared = "".join(f"\n  {path}" for path in CLEARED)
    print(f"{args.out}: a git repository of {len(files)} files of HEAD, without {LEFT_OUT}/; no outputs in:{cleared}")
    if changed:
        print("(uncommitted changes are not in it: commit them and cut it again)")
    print("Ask students to keep closed until their functions pass:", *CLOSED, sep="\n  ")
    return 0
