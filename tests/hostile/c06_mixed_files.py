"""Class 6, lost or mixed files: `--out` naming the user's own directory, a second run on a directory in use,
a run again beside the user's file, torchrun on a larger run's directory; links planted where a run writes,
a hard-linked backup of the store under `--fault damage-page`; a run, and a student edition, whose files outgrow
the file-size limit."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
from pathlib import Path

from .common import SMALL, STORE, WORLD2, R, no_traceback, ranks, run_torchrun
from .judge import Hostile, Outcome, run_cli


def _in_user_dir(scratch: Path) -> Outcome:
    (scratch / "mine").mkdir()
    (scratch / "mine" / "summary.json").write_text('{"my own": "summary"}\n')
    return run_cli(scratch, *SMALL, "--out", "mine")


def _two_at_once(scratch: Path) -> Outcome:
    """A second run on `out/` while a first holds it (held there: its rank 1 stopped until the second has
    ended): the second is refused, the first ends exact."""
    second = []

    def during(proc: subprocess.Popen) -> None:
        if found := ranks(proc):
            os.kill(found[1], signal.SIGSTOP)
            second.append(run_cli(scratch, *SMALL, "--out", "out"))
            os.kill(found[1], signal.SIGCONT)

    first = run_cli(scratch, *WORLD2, "--out", "out", during=during)
    if first.code != 0 or not second:
        return first
    return Outcome(second[0].code, second[0].output + first.output, first.leftover + second[0].leftover)


def _rerun_beside_notes(scratch: Path) -> Outcome:
    """A run, a file of the user's put beside its files (named much like them), a second run on the same `out/`:
    the user's file is kept."""
    if (first := run_cli(scratch, *SMALL, "--num-rounds", "2", "--out", "out")).code != 0:
        return first
    (scratch / "out" / "rank0_notes.json").write_text("{}\n")
    again = run_cli(scratch, *SMALL, "--out", "out")
    kept = (scratch / "out" / "rank0_notes.json").is_file()
    return again if kept else Outcome(None, again.output + "\nout/rank0_notes.json was deleted", again.leftover)


def _torchrun_after_a_larger_run(scratch: Path) -> Outcome:
    """Three stages into `out/`, then two under torchrun on the same `out/`: rank 2's files are not this run's
    (merged, its trace makes the fixed run diverge)."""
    run_cli(scratch, *SMALL, "--pp", "3", "--num-rounds", "2", "--out", "out")
    outcome = run_torchrun(scratch, *SMALL, "--pp", "2", "--out", "out")
    summary = json.loads((scratch / "out" / "summary.json").read_text())
    if summary["diverged"] or set(summary["per_rank_hit_rates"]) != {"0", "1"}:
        return Outcome(None, f"{outcome.output}\nmerged another run's files: {summary['first_divergence']}")
    return outcome


def _linked_marker(scratch: Path) -> Outcome:
    """A link as the run's marker in `out/`, pointing at the user's notes.txt (a shared /tmp lets anyone plant
    one): refused, and notes.txt keeps its text (the judge checks it)."""
    (scratch / "out").mkdir()
    (scratch / "out" / ".hicache_lab_run").symlink_to(scratch / "notes.txt")
    return run_cli(scratch, *SMALL, "--out", "out")


ROOT = Path(__file__).resolve().parents[2]  # the repository, as student-edition finds it
AUDITED = ("--sync-impl", "writing_check=hicache_lab.mem_cache.hiradix_cache:HiRadixCache.writing_check")


def _linked_run_files(scratch: Path) -> Outcome:
    """An earlier run's `out/`, its summary.json and its audit file replaced by links to the user's notes.txt:
    the next run writes its own files, never through the links."""
    if (first := run_cli(scratch, *SMALL, *AUDITED, "--num-rounds", "2", "--out", "out")).code != 0:
        return first
    for name in ("summary.json", "sync_audit_rank0.jsonl"):
        (scratch / "out" / name).unlink()
        (scratch / "out" / name).symlink_to(scratch / "notes.txt")
    return run_cli(scratch, *SMALL, *AUDITED, "--out", "out")


def _hard_linked_backup(scratch: Path) -> Outcome:
    """A store filled, backed up as hard links (`cp -al`), then read under `--fault damage-page`: the fault
    damages the store's page, never the backup's."""
    run_cli(scratch, *R, "--out", "first")
    (scratch / "backup").mkdir()
    for page in (scratch / "store").glob("*.bin"):
        os.link(page, scratch / "backup" / page.name)
    backup = {p: p.read_bytes() for p in (scratch / "backup").iterdir()}
    outcome = run_cli(scratch, *R, "--fault", "damage-page:0@3", "--check-outputs", "--out", "out")
    if changed := [p.name for p, data in backup.items() if p.read_bytes() != data]:
        return Outcome(None, f"{outcome.output}\nthe backup's copy of {changed} damaged too", outcome.leftover)
    return outcome


def _limited(kib: int):
    """`during` for run_cli: `ulimit -f KIB` on the command, set as it starts (before it writes; what it starts
    inherits it). Python ignores SIGXFSZ: a write past the limit fails with EFBIG, as on a full disk."""
    return lambda proc: resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (kib << 10, kib << 10))


def _file_size_limit(scratch: Path) -> Outcome:
    """One rank under `ulimit -f 2`: its trace stops at 2 KiB (a crash naming it), and a file written whole (its
    result, or the summary, which is larger) fails as it is closed. The last line names that file, with what to
    do, and no traceback is printed."""
    outcome = no_traceback(run_cli(scratch, *SMALL, "--out", "out", during=_limited(2)))
    if not outcome.output.rstrip().endswith("ulimit -f), or give --out a writable directory with room"):
        return Outcome(None, f"{outcome.output}\nthe last line does not name a file it could not write")
    return outcome


def _edition_past_the_limit(scratch: Path) -> Outcome:
    """`student-edition out` under `ulimit -f 64` (a notebook outgrows it): one line, what it wrote removed, and
    the same command without the limit then works."""
    outcome = no_traceback(run_cli(scratch, "student-edition", "out", during=_limited(64)))
    if (scratch / "out").exists():
        return Outcome(None, f"{outcome.output}\nout/ was left behind", outcome.leftover)
    if (again := run_cli(scratch, "student-edition", "out")).code != 0:
        return Outcome(None, f"{outcome.output}\nthe rerun failed: {again.output}", outcome.leftover)
    return outcome


def _git_checkout() -> str | None:
    return None if (ROOT / ".git").exists() else f"student-edition is cut from a git checkout; {ROOT} is none"


CASES = [
    Hostile(
        6,
        "--out '' (the working directory, with the user's rank0.json)",
        lambda s: run_cli(s, *SMALL, "--out", ""),
        2,
        "--out '' names no directory",
        owns=(),
    ),
    Hostile(
        6,
        "--out . (the working directory)",
        lambda s: run_cli(s, *SMALL, "--out", "."),
        2,
        "--out . holds files no run of the lab wrote (notes.txt, rank0.json)",
        owns=(),
    ),
    Hostile(
        6,
        "--out a directory of the user's (holding a summary.json)",
        _in_user_dir,
        2,
        "--out mine holds files no run of the lab wrote (summary.json)",
        owns=("mine",),
    ),
    Hostile(
        6,
        "a second run on the --out another run holds",
        _two_at_once,
        2,
        "--out out is in use by another run (pid",
        exact=True,
    ),
    Hostile(
        6,
        "a run again on its --out, a file of the user's (rank0_notes.json) beside its files",
        _rerun_beside_notes,
        0,
        "outputs_match_reference: True",
        exact=True,
    ),
    Hostile(
        6,
        "torchrun, 2 ranks, on the --out of a 3-rank run",
        _torchrun_after_a_larger_run,
        0,
        "outputs_match_reference: True",
        exact=True,
    ),
    Hostile(
        6,
        "a link as the marker of --out, pointing at the user's notes.txt",
        _linked_marker,
        2,
        "--out out: .hicache_lab_run is not a regular file",
    ),
    Hostile(
        6,
        "an earlier run's summary.json and audit file turned into links to the user's notes.txt",
        _linked_run_files,
        0,
        "outputs_match_reference: True",
        exact=True,
    ),
    Hostile(
        6,
        "--fault damage-page on a store whose pages are hard-linked into a backup",
        _hard_linked_backup,
        0,
        "--fault damage-page: page",
        owns=(*STORE, "backup"),
        exact=True,
    ),
    Hostile(
        6,
        "a file-size limit (`ulimit -f 2`) the run's result or summary outgrows",
        _file_size_limit,
        1,
        "error: cannot write out/",
    ),
    Hostile(
        6,
        "`student-edition` under a file-size limit (`ulimit -f 64`) a notebook outgrows",
        _edition_past_the_limit,
        1,
        "File too large; what it wrote is removed: make room on its disk (or lift the file-size limit, ulimit -f) "
        "and run it again",
        needs=_git_checkout,
    ),
]
