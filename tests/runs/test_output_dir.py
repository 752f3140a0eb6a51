"""A run owns its output directory (entrypoints/outdir.py): it refuses a directory of the user's, locks it while it
runs, deletes only the lab's own files there, and its summary merges only results that carry its run id. A file
of the run that cannot be written ends it with one line naming the file, never a traceback."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pytest

from hicache_lab.entrypoints import outdir
from hicache_lab.entrypoints.launch import run_world
from hicache_lab.entrypoints.outdir import LAB_FILES, MARKER, Claim, OutputError
from hicache_lab.entrypoints.report import WorldEnd, read_results
from hicache_lab.errors import ConfigError
from hicache_lab.lab.binders import LAB
from hicache_lab.lab.presets import WORLD
from hicache_lab.managers.step_trace import read_trace


def test_a_directory_of_the_users_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "rank0.json").write_text('{"mine": true}\n')
    with pytest.raises(ConfigError, match=r"holds files no run of the lab wrote \(rank0.json\)"):
        Claim(tmp_path)
    assert (tmp_path / "rank0.json").read_text() == '{"mine": true}\n' and not (tmp_path / MARKER).exists()


def test_a_directory_a_run_holds_is_refused_naming_its_pid(tmp_path):
    with Claim(tmp_path / "out"), pytest.raises(ConfigError, match=r"is in use by another run \(pid \d+\)"):
        Claim(tmp_path / "out")  # flock: two open files of one process conflict as two processes do
    Claim(tmp_path / "out").release()  # released: the next run may have it


def test_a_run_deletes_only_the_files_the_lab_writes(tmp_path):
    Claim(tmp_path).release()
    lab = ["rank0.json", "rank12.json", "trace_rank3.jsonl", "rank1.cache_ops.jsonl", "summary.json", "requests.jsonl"]
    users = ["rank0_notes.json", "rank.json", "notes.txt", "summary.json.bak"]
    for name in lab + users:
        (tmp_path / name).write_text("{}\n")
    with Claim(tmp_path) as claim:
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([MARKER, *users])
        assert json.loads((tmp_path / MARKER).read_text())["run_id"] == claim.run_id


def test_a_summary_reads_only_this_runs_results(tmp_path):
    """torchrun on a directory a larger, earlier run left: its rank 2 (and a file cut short) are not merged."""
    for rank, run_id in ((0, "this"), (1, "this"), (2, "this"), (1, "earlier")):
        name = f"rank{rank}.json" if run_id == "this" else "rank1_old.json"
        (tmp_path / name).write_text(json.dumps({"rank": rank, "run_id": run_id}))
    (tmp_path / "rank3.json").write_text('{"rank": 3, "run_')  # a full disk cut it short
    assert [r["rank"] for r in read_results(tmp_path, WorldEnd("this"), world_size=2)] == [0, 1]


def test_a_trace_cut_short_keeps_its_whole_lines(tmp_path):
    (tmp_path / "trace_rank0.jsonl").write_text('{"rank": 0, "step": 0}\n{"rank": 0, "st')
    assert read_trace(tmp_path) == [{"rank": 0, "step": 0}]


@pytest.mark.spawns  # a run with a --sync-impl starts processes (its import is checked in one, and its rank)
def test_the_cleanup_knows_every_file_a_run_writes(small_config, tmp_path):
    """What a run with every writer of its own turned on leaves in --out: each name is one the start-of-run
    cleanup deletes (LAB_FILES), so a link planted under it is removed rather than written through."""
    cfg = small_config(enable_hierarchical_cache=True, record_cache_ops=True)
    audited = "writing_check=hicache_lab.mem_cache.hiradix_cache:HiRadixCache.writing_check"
    cfg = cfg.with_lab(sync_impls=(audited,))
    assert run_world(cfg, tmp_path, verbose=False, binders=LAB)["completed"]
    written = {p.name for p in tmp_path.iterdir() if p.is_file() and p.name != MARKER}
    assert {"summary.json", "sync_audit_rank0.jsonl", "rank0.cache_ops.jsonl"} <= written
    assert [name for name in written if not LAB_FILES.fullmatch(name)] == []


class _FullDisk(io.StringIO):
    """A file on a full disk: what is written waits in its buffer, and reaching the disk (close) fails."""

    def close(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_file_written_whole_that_cannot_be_is_named_and_removed(tmp_path, monkeypatch):
    """The error of a full disk comes at close, where the buffer reaches it: OutputError naming the file, and
    the empty file it left removed (it would be read as one cut short)."""
    monkeypatch.setattr(outdir, "open", lambda path, *a, **k: (Path(path).touch(), _FullDisk())[1], raising=False)
    with pytest.raises(OutputError, match=r"cannot write .*summary.json: No space left on device \(ENOSPC\)"):
        outdir.write_file(tmp_path / "summary.json", "{}\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name", ["trace_rank0.jsonl", "rank0.cache_ops.jsonl", "requests.jsonl", "rank0.json", "summary.json"]
)
def test_a_full_disk_under_every_file_of_a_run_ends_it_with_one_line_naming_the_file(
    name, tmp_path, monkeypatch, capsys
):
    """Each file a run writes, on a full disk (/dev/full: a write fails with ENOSPC once it reaches the disk):
    exit 1 and `cannot write FILE: No space left on device`, never a traceback."""
    from hicache_lab.__main__ import main

    opener = outdir._no_links
    monkeypatch.setattr(
        outdir, "_no_links", lambda path, flags: opener("/dev/full" if path.endswith(name) else path, flags)
    )
    out = tmp_path / "out"
    args = ["run", *WORLD.split(), "--num-rounds", "2", "--record-cache-ops", "--out", str(out)]
    assert main(args) == 1
    output = capsys.readouterr()
    assert f"cannot write {out / name}: No space left on device (ENOSPC)" in output.out + output.err
    assert "Traceback" not in output.out + output.err
