"""`python -m hicache_lab student-edition DIR`: the repository as a student gets it for a graded session, without
`teaching/` (the exercise's answers, the catalogue of wrong ones, the homework's answers).

Everything else is as committed: no document on the student path holds an answer (tests/lab/test_student_path.py
checks it), and the tests that need `teaching/` skip in the edition, saying why. What a student edition cannot
hide is the package's own source, which holds the lab's answers (`CLOSED`): docs/lab_session.md asks students to
keep it closed until their three functions pass.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import tarfile
from pathlib import Path

from ...errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]  # the repository this package was installed from
LEFT_OUT = "teaching"
CLOSED = (  # where the lab's own answers to notebook 06 are, in the package's source
    "hicache_lab/distributed/cache_sync.py (CacheSync._pp_sync, CacheSync._attn_groups)",
    "hicache_lab/mem_cache/hiradix_cache.py (HiRadixCache.writing_check)",
)


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=120)


def make_edition(out: Path) -> list[str]:
    """Write HEAD's tree, less `teaching/`, into `out` (absent or empty). Returns the paths written."""
    if git("rev-parse", "--is-inside-work-tree").returncode != 0:
        raise ConfigError(f"{ROOT} is not a git checkout: a student edition is cut from the repository's HEAD")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory: give a new one")
    if out.resolve().is_relative_to(ROOT.resolve()):
        raise ConfigError(f"{out} is inside the repository: give a directory outside it")
    archive = git("archive", "--format=tar", "HEAD", "--", ".", f":(exclude){LEFT_OUT}")
    if archive.returncode != 0:
        raise ConfigError(f"git archive failed: {archive.stderr.decode(errors='replace').strip()}")
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        # git's own archive of this repository: members are plain files and folders below `out` (Python before
        # 3.11.4 has no extraction filter)
        tar.extractall(out, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return [m.name for m in tar.getmembers() if m.isfile()]


def add_edition_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="a new (or empty) directory outside the repository")


def cmd_edition(args: argparse.Namespace) -> int:
    files = make_edition(Path(args.out))
    changed = git("status", "--porcelain", "--untracked-files=no").stdout.decode().strip()
    print(f"{args.out}: {len(files)} files of HEAD, without {LEFT_OUT}/")
    if changed:
        print("(uncommitted changes are not in it: commit them and cut it again)")
    print("Ask students to keep closed until their functions pass:", *CLOSED, sep="\n  ")
    return 0
