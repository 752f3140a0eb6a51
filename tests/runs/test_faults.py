"""Faults end cleanly and loudly: a rank lost mid-run stops the world within the timeout with the rank named (the
cause, not a peer that timed out waiting for it); a storage tier that cannot write or read turns into misses with
a warning, outputs still exact, while a run file that cannot be written ends the run naming it; the copy checksum
catches a torn or misplaced host copy at once, and passes every intact one; a rank dies with its launcher, and a
signal ends a process with its files written even while its main thread is blocked in C++."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache_lab.entrypoints.report import WorldEnd, blame
from hicache_lab.lab.binders import run

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
    assert done.returncode == 0, done.stderr[-2000:]  # else the files read below are an earlier run's
    summary = json.loads((out / "summary.json").read_text())
    return summary, json.loads((out / "rank0.json").read_text()), done.stderr


@pytest.mark.spawns
def test_a_killed_rank_ends_the_world_within_the_timeout_and_is_named(world_config, tmp_path):
    cfg = world_config(pp=2, collective_timeout_s=30, fault="kill-rank:1@10")
    summary = run(cfg, tmp_path, verbose=False)
    assert summary["crashed"] and summary["failing_rank"] == 1
    assert "rank 1 was killed by SIGKILL without a result" in summary["error"]
    assert summary["elapsed_s"] < cfg.parallel.collective_timeout_s, "the others were stopped, not timed out"


@pytest.mark.parametrize("fault", ["tear-copy:0@3", "misplace-copy:0@3"])
def test_copy_checksum_catches_a_bad_host_write_at_once(small_config, tmp_path, fault):
    cfg = small_config(enable_hierarchical_cache=True, copy_checksum=True, fault=fault)
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
@pytest.mark.spawns
def test_a_store_the_run_cannot_use_is_refused_at_start(tmp_path):
    store = tmp_path / "store"
    filled, _, _ = run_cli(tmp_path, *STORAGE, "--hicache-storage-dir", str(store))
    assert filled["completed"]
    store.chmod(0)  # even root cannot use it once it gives up the capabilities that bypass permissions
    try:
        drop = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search")
        command = [*drop, sys.executable, "-m", "hicache_lab", "run", *SMALL.split(), *STORAGE]
        command += ["--hicache-storage-dir", str(store), "--out", str(tmp_path / "again")]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        store.chmod(0o700)
    assert done.returncode == 2 and "--hicache-storage-dir" in done.stderr and "not writable" in done.stderr
    assert not (tmp_path / "again" / "summary.json").exists(), "refused before any rank started"


def test_a_rank_that_timed_out_waiting_is_a_symptom_and_the_stuck_peer_is_named():
    """SIGSTOP on rank 1: rank 0 times out first and is the only one to report, but it only waited; rank 1, which
    never reported and had to be stopped, is the cause, named with what its process was doing."""
    waited = {"rank": 0, "crashed": True, "waited": True, "hung_in": "run > _pp_sync", "failed_at": 1.0}
    waited["error"] = "collective timed out after --collective-timeout 5 s in run > _pp_sync"
    stuck = "its process was stopped by a signal (state T) when the launcher stopped it"
    error, failing = blame([waited], [1], WorldEnd("run", failed={0: 1}, stopped={1: stuck}), elapsed_s=6.0)
    assert failing == 1
    assert error == f"rank 1 never reported: {stuck}; the others waited for it: rank 0 in run > _pp_sync"
    raised = dict(waited, rank=1, waited=False, error="PoolExhaustedError: no room", failed_at=2.0)
    assert blame([waited, raised], [], WorldEnd("run"), elapsed_s=6.0) == (
        "PoolExhaustedError: no room; meanwhile rank 0 in run > _pp_sync",
        1,
    ), "a rank that raised is the cause even when a peer timed out before it"


def test_a_group_that_could_not_connect_to_a_stopped_peer_is_a_symptom_too(tmp_path):
    """SIGSTOP on rank 1 before it joins: on a loaded machine rank 0's gloo gives up connecting to it (when a group
    is created) before the launcher notices; that rank only waited, and the stopped one is named."""
    from hicache_lab.entrypoints.rank import record_crash

    result = {"rank": 0}
    gloo = "Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.h:311] Connect timeout [none]"
    record_crash(result, RuntimeError(gloo), 5.0, tmp_path)
    assert result["waited"] and result["crashed"]
    stuck = "its process was stopped by a signal (state T) when the launcher stopped it"
    error, failing = blame([result], [1], WorldEnd("run", stopped={1: stuck}), elapsed_s=30.0)
    assert (failing, error) == (1, f"rank 1 never reported: {stuck}")


@pytest.mark.spawns
def test_a_child_forked_under_the_guard_neither_signals_for_the_parent_nor_holds_its_watcher():
    """A `--sync-impl` that forks: the child's SIGTERM is its own (the parent's watcher must not read it as the
    parent's and exit 143), and the child, still sleeping, holds no end of the watcher's pipe (the watcher must
    leave when the guard does, or a daemon thread outlives the run: C++ terminate() at the parent's exit)."""
    code = (
        "import os, signal, time\n"
        "from hicache_lab.entrypoints.ending import SignalGuard\n"
        "with SignalGuard() as guard:\n"
        "    child = os.fork()\n"
        "    if child == 0:\n"
        "        try:\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "            time.sleep(10)\n"
        "        finally:\n"
        "            os._exit(0)\n"
        "    time.sleep(2.5)\n"
        "    left = time.monotonic()\n"
        "print('watcher alive:', guard._watcher.is_alive(), 'after', round(time.monotonic() - left, 1), flush=True)\n"
        "os.kill(child, signal.SIGKILL)\n"
        "os.waitpid(child, 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-800:]}"
    assert "watcher alive: False after 0.0" in done.stdout, done.stdout


@pytest.mark.spawns
def test_a_signal_that_finds_the_main_thread_blocked_in_cpp_still_ends_the_process_with_its_files():
    """A Python handler waits while the main thread is blocked in C++ (as in a gloo collective whose peer is
    stuck); the watcher, woken by the same signal, writes what the process owes and exits 128 + signal."""
    code = (
        "import datetime, torch.distributed as dist\n"
        "from hicache_lab.entrypoints.ending import SignalGuard\n"
        "with SignalGuard() as guard:\n"
        "    guard.owe(lambda name: print('wrote what it owes on', name, flush=True))\n"
        "    print('blocked', flush=True)\n"
        "    dist.HashStore().wait(['never set'], datetime.timedelta(seconds=60))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "blocked\n"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and "wrote what it owes on SIGTERM" in out


@pytest.mark.spawns
def test_a_rank_dies_with_its_launcher_even_by_sigkill():
    code = (
        "import os, subprocess, sys\n"
        "child = 'import os, time; from hicache_lab.entrypoints.ending import die_with_parent; '"
        " f'die_with_parent({os.getpid()}); print(os.getpid(), flush=True); time.sleep(60)'\n"
        "subprocess.Popen([sys.executable, '-c', child]).wait()\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{rank}").exists() and "Z" not in _state(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{rank}").exists() or "Z" in _state(rank), "the rank outlived its launcher"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return "Z"


@pytest.mark.spawns
@pytest.mark.skipif(not _can(["prlimit", "--fsize=100000", "true"]), reason="needs prlimit(1)")
def test_a_full_disk_ends_the_run_with_the_file_named_and_no_traceback(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk (Python ignores SIGXFSZ, so a write past it fails with EFBIG)."""
    command = ["prlimit", "--fsize=8192", sys.executable, "-m", "hicache_lab", "run", *SMALL.split()]
    done = subprocess.run([*command, "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr
    assert f"cannot write {tmp_path}/run/trace_rank0.jsonl: File too large (EFBIG)" in done.stdout
