"""Faults end cleanly and loudly: a rank lost mid-run stops the world within the timeout with the rank named;
a storage tier that cannot write or read turns into misses with a warning, outputs still exact; the copy
checksum catches a torn or misplaced host copy at once, and passes every intact one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_lab.entrypoints.launch import run

SMALL = (
    "--num-layers 3 --max-total-tokens 256 --hicache-ratio 3 --num-clients 4 --num-rounds 3 --request-length 32 "
    "--sub-question-input-length 16 --output-length 8 --enable-hierarchical-cache --check-outputs"
)
STORAGE = ("--hicache-storage-backend", "file", "--flush-cache-between-rounds", "--storage-prefetch-threshold", "16")


def run_cli(tmp_path: Path, *args: str, prefix: tuple[str, ...] = ()) -> tuple[dict, dict, str]:
    """A run as its own process (under `prefix`, e.g. a mount namespace): (summary, rank 0's result, stderr)."""
    out = tmp_path / "run"
    command = [*prefix, sys.executable, "-m", "hicache_lab", "run", *SMALL.split(), *args, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    return summary, json.loads((out / "rank0.json").read_text()), done.stderr


def test_a_killed_rank_ends_the_world_within_the_timeout_and_is_named(world_config, tmp_path):
    cfg = world_config(pp=2, collective_timeout_s=30, fault="kill-rank:1@10")
    summary = run(cfg, tmp_path, verbose=False)
    assert summary["crashed"] and summary["failing_rank"] == 1
    assert "rank 1 was killed by SIGKILL without a result" in summary["error"]
    assert summary["elapsed_s"] < cfg.parallel.collective_timeout_s, "the others were stopped, not timed out"


@pytest.mark.parametrize("fault", ["tear-copy:0@3", "misplace-copy:0@3"])
def test_copy_checksum_catches_a_bad_host_write_at_once(small_config, tmp_path, fault):
    from hicache_lab.config import ParallelConfig

    cfg = small_config(enable_hierarchical_cache=True, copy_checksum=True)
    cfg.parallel = ParallelConfig(fault=fault)
    summary = run(cfg, tmp_path, verbose=False)
    assert summary["crashed"] and "CopyChecksumError" in summary["error"]
    assert "does not match its source's checksum" in summary["error"]


def test_copy_checksum_passes_every_intact_copy(small_config, tmp_path):
    summary = run(small_config(enable_hierarchical_cache=True, copy_checksum=True), tmp_path, verbose=False)
    assert summary["completed"] and summary["outputs_match_reference"] is True


def _can(command: list[str]) -> bool:
    return subprocess.run(command, capture_output=True).returncode == 0


@pytest.mark.skipif(not _can(["unshare", "-m", "true"]), reason="needs a private mount namespace (root)")
def test_a_full_disk_turns_backups_into_misses_with_a_warning(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    mount = f'mount -t tmpfs -o size=16k tmpfs {store} && exec "$@"'  # room for about ten pages
    summary, rank0, stderr = run_cli(
        tmp_path, *STORAGE, "--hicache-storage-dir", str(store), prefix=("unshare", "-m", "sh", "-c", mount, "sh")
    )
    assert summary["completed"] and summary["outputs_match_reference"] is True
    assert rank0["storage"]["write_failures"] > 0 and "No space left on device" in stderr


@pytest.mark.skipif(
    not _can(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "true"]),
    reason="needs setpriv and the right to drop capabilities",
)
def test_an_unreadable_store_is_a_miss_with_a_warning(tmp_path):
    store = tmp_path / "store"
    filled, _, _ = run_cli(tmp_path, *STORAGE, "--hicache-storage-dir", str(store))
    assert filled["completed"]
    store.chmod(0)  # even root cannot read it once it gives up the capabilities that bypass permissions
    try:
        drop = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search")
        summary, rank0, stderr = run_cli(tmp_path, *STORAGE, "--hicache-storage-dir", str(store), prefix=drop)
    finally:
        store.chmod(0o700)
    assert summary["completed"] and summary["outputs_match_reference"] is True
    assert rank0["storage"]["lookup_failures"] > 0 and "Permission denied" in stderr
    assert all(r["cached_storage"] == 0 for r in summary["rounds"])
