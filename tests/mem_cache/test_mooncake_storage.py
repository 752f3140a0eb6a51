"""The Mooncake backend, for real: a mooncake_master on 127.0.0.1 and the lab's ranks as its clients.

Mooncake clients listen on every interface, so each run happens inside a network namespace of its own with
only loopback and a veth pair inside it (`unshare -n`, as root). Without root, unshare, the `mooncake` package
or the system library libibverbs1 these tests skip and say which is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hicache_lab.lab.check.soak_signals import processes
from hicache_lab.mem_cache.mooncake_store import mooncake_missing

NETNS_SETUP = (
    "ip link set lo up && ip link add hcv0 type veth peer name hcv1 && "
    "ip addr add 10.231.0.1/24 dev hcv0 && ip link set hcv0 up && ip link set hcv1 up"
)
# not presets.WORKLOAD: these prompts (64-token openings) must outgrow the default prefetch threshold
SMALL = "--num-clients 4 --num-rounds 3 --num-layers 2 --request-length 64 --max-total-tokens 512 --hicache-ratio 4 "
SMALL += "--collective-timeout 30"
STORAGE = "--enable-hierarchical-cache --hicache-storage-backend mooncake --flush-cache-between-rounds "
STORAGE += "--hicache-storage-prefetch-policy wait_complete --check-outputs"


def why_mooncake_cannot_run() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs root with unshare and ip, to run Mooncake in a private network namespace"
    if why := mooncake_missing():
        return why
    netns = subprocess.run(["unshare", "-n", "sh", "-c", NETNS_SETUP], capture_output=True, text=True)
    if netns.returncode != 0:
        return f"cannot build a private network namespace here: {netns.stderr.strip()}"
    return None


pytestmark = [pytest.mark.spawns, pytest.mark.skipif(bool(reason := why_mooncake_cannot_run()), reason=reason or "")]


def run_in_namespace(out, extra: str = "") -> dict:
    cmd = f"{NETNS_SETUP} && exec {sys.executable} -m hicache_lab run {SMALL} {STORAGE} {extra} --out {out}"
    env = dict(os.environ, GLOG_minloglevel="2")
    result = subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=300)
    assert (out / "summary.json").exists(), result.stderr[-2000:]
    return json.loads((out / "summary.json").read_text())


def storage_tokens(summary) -> int:
    return sum(r["cached_storage"] for r in summary["rounds"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pages_come_back_from_mooncake_with_exact_outputs(dtype, tmp_path):
    summary = run_in_namespace(tmp_path, f"--dtype {dtype}")
    assert summary["completed"] and summary["outputs_match_reference"], summary["error"]
    bound = sum(r["upper_bound_hit_rate"] * r["prompt_tokens"] for r in summary["rounds"])
    assert storage_tokens(summary) == pytest.approx(bound)  # flushed caches: every hit came from Mooncake


def test_cp_rank_in_mooncake_keys_collapses_hits_and_fixed_keys_do_not(tmp_path):
    one_writer = "--cp 2 --hicache-storage-writers one"  # CP rank 0 writes for its CP group
    fixed = run_in_namespace(tmp_path / "fixed", one_writer)
    suffixed = run_in_namespace(tmp_path / "suffixed", f"{one_writer} --disable-fix storage_keys")
    assert fixed["completed"] and fixed["outputs_match_reference"] and not fixed["diverged"]
    assert storage_tokens(fixed) > 0
    assert suffixed["completed"] and storage_tokens(suffixed) == 0


def test_a_master_that_dies_mid_run_leaves_misses_on_every_stage_and_exact_outputs(tmp_path):
    """The master is killed once round 1 has begun: both stages find the store lost (RPC_FAIL) and miss from then
    on, agreed across the stages, so round 2 recomputes what storage held; the run completes, outputs exact, in
    seconds (a put to a dead master takes ~4 s: a lost store is not asked again)."""
    out = tmp_path / "out"
    cmd = f"{NETNS_SETUP} && exec {sys.executable} -m hicache_lab run {SMALL} {STORAGE} --pp 2 --out {out}"
    env = dict(os.environ, GLOG_minloglevel="2")
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)  # fmt: skip
    trace = out / "trace_rank0.jsonl"
    while proc.poll() is None and not any(
        max(json.loads(line)["requests"], default=0) >= 4
        for line in (trace.read_text().splitlines() if trace.exists() else [])
    ):
        time.sleep(0.1)  # until round 1's requests (rids 4-7) run
    masters = processes(lambda f: int(f[3]) == proc.pid)
    for pid in [p for p, command in masters.items() if "mooncake_master" in command]:
        os.kill(pid, signal.SIGKILL)
    output, _ = proc.communicate(timeout=240)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["outputs_match_reference"] is True, summary["error"]
    assert summary["rounds"][2]["cached_storage"] == 0, "the dead master's store served round 2"
    assert output.count("does not answer: its store is lost") == 2, "each stage finds it lost"
