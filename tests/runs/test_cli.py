"""`python -m hicache_lab run` writes a summary a notebook can load and a replayable request log."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache_lab.managers.step_trace import load_trace

pytestmark = pytest.mark.spawns

SMALL = "--num-clients 3 --num-rounds 3 --request-length 24 --sub-question-input-length 8 --output-length 4"


def test_run_writes_summary_and_requests(tmp_path):
    cmd = [sys.executable, "-m", "hicache_lab", "run", *SMALL.split(), "--max-total-tokens", "128"]
    cmd += ["--enable-hierarchical-cache", "--check-outputs", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--enable-hierarchical-cache" in result.stdout  # the equivalent SGLang flags

    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("config", "completed", "crashed", "error", "rounds", "outputs_match_reference", "elapsed_s"):
        assert key in summary
    assert summary["completed"] and not summary["crashed"] and summary["outputs_match_reference"] is True
    round_keys = {"round", "prompt_tokens", "cached_tokens", "cached_device", "cached_host", "cached_storage"}
    round_keys |= {"hit_rate", "upper_bound_hit_rate", "ttft_ms", "step_ms"}
    assert [r["round"] for r in summary["rounds"]] == [0, 1, 2]
    assert round_keys <= set(summary["rounds"][0])

    requests = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(requests) == 9
    first, later = requests[0], next(r for r in requests if r["client"] == 0 and r["round"] == 1)
    assert len(first["output"]) == 4
    assert later["prompt"][: len(first["prompt"]) + 4] == first["prompt"] + first["output"]

    trace = load_trace(tmp_path)
    assert list(trace["step"]) == list(range(len(trace)))  # one flushed line per step
    assert {"acks_write", "acks_load", "digest", "device_free", "host_free"} <= set(trace.columns)
    assert trace["acks_write"].sum() > 0


def test_help_lists_sglang_style_flags():
    result = subprocess.run([sys.executable, "-m", "hicache_lab", "run", "--help"], capture_output=True, text=True)
    for flag in ("--enable-hierarchical-cache", "--hicache-ratio", "--hicache-size", "--hicache-write-policy"):
        assert flag in result.stdout
