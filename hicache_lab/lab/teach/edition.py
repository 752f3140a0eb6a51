"""`python -m hicache_lab student-edition DIR`: the repository as a student gets it, as a git repository of one
commit, no recipe before its exercise (tests/lab/test_no_recipe.py): without `teaching/` (the answers, the wrong
ones, the homework's answers; tests that need it skip); the documents that hold the protocol in full with each
exercise's recipe replaced by what the function must achieve (`student_text`, from teaching/student_edition.json,
as the texts it replaces are recipes); the session path's notebooks (`CLEARED`) without their outputs (a
prediction comes before its run) and set for class (`IN_CLASS = True`); the files the lab runs that hold an
answer listed (`CLOSED`), to keep closed until a student's functions pass. A checkout without `teaching/` is a
student edition (`student_edition`): no fix there but the one of a verdict."""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from ...entrypoints.outdir import OutputError
from ...entrypoints.preflight import check_writable_dir
from ...errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]  # the repository this package was installed from
LEFT_OUT = "teaching"
EDITS = f"{LEFT_OUT}/student_edition.json"
CLOSED = {  # path (a folder ends in /) -> what it holds that a student must not see before the exercises pass
    "hicache_lab/distributed/cache_sync.py": "the lab's relay and groups (CacheSync._pp_sync, CacheSync._attn_groups)",
    "hicache_lab/mem_cache/hiradix_cache.py": "the lab's consumption of acks (HiRadixCache.writing_check)",
    "hicache_lab/lab/teach/questions.py": "the design question's star, a right relay (exercise 1)",
    "hicache_lab/lab/teach/mistakes.py": "every kind of mistake's hint (`--hint` shows one, for the verdict you got)",
    "hicache_lab/lab/sglang/": "SGLang's own lines, which the lab patches at runtime",
    "bench/": "the relay, timed against a barrier and an all-reduce",
    "tests/": "the tests, which run right answers of their own",
}
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
            files = [m.name for m in tar.getmembers() if m.isfile()]
        member = None  # written whole: an error from here on is not the archive's
        for path in edits():  # the documents as students get them
            (out / path).write_text(student_text(path, (out / path).read_text()))
        for path in CLEARED:  # the path's notebooks, as students get them
            for_class(out / path)
        commit(out)
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


def for_class(path: Path) -> None:
    """The notebook at `path` without outputs, execution counts or timings, its parameter `IN_CLASS` True."""
    import nbformat  # with Jupyter (the dev extra), which only a teacher cutting an edition needs

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


def student_edition(root: Path = ROOT) -> bool:
    return not (root / LEFT_OUT).is_dir()


def edits(root: Path = ROOT) -> dict[str, list[dict[str, str]]]:
    """{path: [{"teachers": text, "students": text}, ...]}; none in a student edition, whose files are the students'."""
    return {} if student_edition(root) else json.loads((root / EDITS).read_text())["edits"]


def student_text(path: str, text: str, root: Path = ROOT) -> str:
    """`text`, the teachers' `path`, as students get it; a ConfigError where a text to replace is not there once."""
    for edit in edits(root).get(path, ()):
        if (found := text.count(edit["teachers"])) != 1:
            raise ConfigError(
                f"{path} holds {found} times, not once, a text the student edition replaces "
                f"({edit['teachers'][:50]!r}...): update {EDITS} with the document"
            )
        text = text.replace(edit["teachers"], edit["students"])
    return text


def add_edition_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="a new (or empty) directory outside the repository")


def cmd_edition(args: argparse.Namespace) -> int:
    files = make_edition(Path(args.out))
    changed = git("status", "--porcelain", "--untracked-files=no").stdout.decode().strip()
    cleared = "".join(f"\n  {path}" for path in CLEARED)
    print(f"{args.out}: a git repository of {len(files)} files of HEAD, without {LEFT_OUT}/; no outputs in:{cleared}")
    if changed:
        print("(uncommitted changes are not in it: commit them and cut it again)")
    closed = (f"{path}: {what}" for path, what in CLOSED.items())
    print("Ask students to keep closed until their functions pass:", *closed, sep="\n  ")
    return 0
