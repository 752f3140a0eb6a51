"""`python -m hicache_lab run` writes a summary a notebook can load and a replayable request log; it ends as the
CLI's docstring says when its reader goes away, when it runs out of file descriptors, and on Ctrl-C while it
loads."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    assert summary["provenance"]["command"] == "python -m hicache_lab run " + " ".join(cmd[4:])  # as typed
    round_keys = {"round", "prompt_tokens", "cached_tokens", "cached_device", "cached_host", "cached_storage"}
    round_keys |= {"hit_rate", "upper_bound_hit_rate", "modelled_ttft_ms", "modelled_step_ms", "ttft_ms", "step_ms"}
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


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal (a background job of a script ignores it)


def test_a_reader_that_has_gone_ends_the_run_quietly_with_141(tmp_path):
    """`run ... | head -1`: standard output a pipe whose reader has ended. The run writes its directory whole, then
    exits 141 (a Unix tool killed by SIGPIPE) with nothing on stderr."""
    read, write = os.pipe()
    os.close(read)
    cmd = [sys.executable, "-m", "hicache_lab", "run", *SMALL.split(), "--max-total-tokens", "128"]
    result = subprocess.run(
        [*cmd, "--out", str(tmp_path)], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
    )
    os.close(write)
    assert result.returncode == 141 and result.stderr == "", result.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["completed"]


def test_too_few_file_descriptors_are_named_with_the_limit(tmp_path):
    """`ulimit -n 20`: the fork server cannot start. One line names the limit and what to raise it to."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (20, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    cmd = [sys.executable, "-m", "hicache_lab", "run", *SMALL.split(), "--pp", "2", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "error: this process may open only 20 files (ulimit -n 20)" in result.stderr
    assert "(Too many open files, EMFILE): raise it, e.g. ulimit -n " in result.stderr


def test_ctrl_c_while_torch_loads_is_one_line_and_130(tmp_path):
    cmd = [sys.executable, "-m", "hicache_lab", "run", *SMALL.split(), "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    maps = Path(f"/proc/{proc.pid}/maps")
    while proc.poll() is None and "libtorch" not in maps.read_text():  # loading torch, after the CLI's handler
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "interrupted by SIGINT\n", err
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []
