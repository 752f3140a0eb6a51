"""Bad input files are refused field by field, naming the file, the line and the field: Mooncake traces
(`--trace-file`) and SGLang bench_multiturn logs (`--compare-sglang`). A refusal that a fast class-10 hostile
case checks through the CLI (tests/hostile/test_hostile.py: exit code, message, no file touched) is not repeated
here."""

from __future__ import annotations

import json
import re
import time

import pytest

from hicache_lab.config import RunConfig, WorkloadConfig
from hicache_lab.errors import ConfigError

LINE = {"timestamp": 1, "input_length": 100, "output_length": 5, "hash_ids": [1]}


def _write(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({**LINE, "hash_ids": [1, -4]}, "'hash_ids'[1] is -4"),
        ({**LINE, "hash_ids": [1.5]}, "'hash_ids'[0] is 1.5"),
        ({**LINE, "input_length": True}, "'input_length' must be an integer in 1..512"),
        ({**LINE, "input_length": 100.0}, "'input_length' must be an integer"),
        ({**LINE, "output_length": 0}, "'output_length' must be an integer of at least 1"),
        ({**LINE, "output_length": None}, "'output_length' must be an integer"),
        ({**LINE, "timestamp": -3}, "'timestamp' must be a number >= 0"),
        ({**LINE, "timestamp": "soon"}, "'timestamp' must be a number >= 0"),
        ({**LINE, "timestamp": False}, "'timestamp' must be a number >= 0"),
        ('{"timestamp": -Infinity, "input_length": 100, "hash_ids": [1]}', "not JSON (-Infinity is not a number"),
        ('{"timestamp": 1e999, "input_length": 100, "hash_ids": [1]}', "not JSON (1e999 is beyond a double)"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply to be a record"),
    ],
)
def test_a_bad_trace_line_is_refused_field_by_field(tmp_path, line, message):
    trace = _write(tmp_path / "t.jsonl", LINE, line)
    with pytest.raises(
        ConfigError, match=re.escape(f"--trace-file {tmp_path}/t.jsonl:2: ") + ".*" + re.escape(message)
    ):
        WorkloadConfig(trace_file=trace, num_rounds=1)


def test_a_trace_file_that_is_not_text_is_refused(tmp_path):
    (tmp_path / "t.jsonl").write_bytes(json.dumps(LINE).encode() + b'\n{"hash_ids": "\xff"}\n')
    with pytest.raises(ConfigError, match=r"t.jsonl:2: not UTF-8 text"):
        WorkloadConfig(trace_file=str(tmp_path / "t.jsonl"), num_rounds=1)


def test_a_trace_line_of_millions_of_ids_is_refused_before_a_token_is_drawn(tmp_path, monkeypatch):
    from hicache_lab import mooncake_trace

    drawn = []
    monkeypatch.setattr(mooncake_trace.np.random, "default_rng", lambda seed: drawn.append(seed))
    ids = list(range(2_000_000))
    trace = _write(tmp_path / "t.jsonl", LINE, {**LINE, "input_length": 512 * len(ids), "hash_ids": ids})
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"t.jsonl:2: its request holds 32000001 tokens of KV .* raise it, or lower"):
        RunConfig(workload=WorkloadConfig(trace_file=trace, num_rounds=2))
    assert time.monotonic() - started < 20 and drawn == []  # it took minutes, drawing 2 million generators


def test_a_prompt_draws_only_the_hash_ids_it_reaches(tmp_path, monkeypatch):
    from hicache_lab import mooncake_trace

    real, drawn = mooncake_trace.np.random.default_rng, []
    monkeypatch.setattr(mooncake_trace.np.random, "default_rng", lambda seed: drawn.append(seed) or real(seed))
    trace = _write(tmp_path / "t.jsonl", {**LINE, "input_length": 600, "hash_ids": list(range(10_000))})
    (request,) = mooncake_trace.read_mooncake_trace(trace, 16, 8, 256, 0)
    assert len(request.prompt) == 19 and drawn == [[0, 0], [0, 1]]  # ceil(600 * 16 / 512) tokens: two ids


RUN_LOG = {"tag": "sglang", "summary": {"cache_hit_rate": 0.4}}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"summary": {"cache_hit_rate": "0.5"}}, "'cache_hit_rate' must be a number in 0..1, got '0.5'"),
        ({"summary": {"cache_hit_rate": True}}, "'cache_hit_rate' must be a number in 0..1, got True"),
        ('{"summary": {"cache_hit_rate": NaN}}', "not JSON (NaN is not a number JSON allows)"),
        ({**RUN_LOG, "tag": 5}, "'tag' must be a string, got 5"),
        ({**RUN_LOG, "round": [1, 2]}, "'round' must be an object of round_N entries"),
        ({**RUN_LOG, "round": {"round_-1": {"cache_hit_rate": 0.5}}}, "'round' key 'round_-1' is not round_N"),
        ({**RUN_LOG, "round": {"round_1": {}, "round_01": {}}}, "'round' names a round twice"),
        ({**RUN_LOG, "round": {"round_0": 0.5}}, "'round.round_0' must be an object, got 0.5"),
        ({**RUN_LOG, "round": {"round_0": {"average_ttft": 1}}}, "'round.round_0': 'cache_hit_rate' must be"),
        ({**RUN_LOG, "round": {"round_0": {"cache_hit_rate": 0.5, "average_ttft": -1}}}, "seconds >= 0, got -1"),
        ({**RUN_LOG, "round": {"round_0": {"cache_hit_rate": 0.5, "request_count": 2.5}}}, "'request_count' must"),
        ({"summary": {"cache_hit_rate": 0.5, "total_requests": -1}}, "'summary': 'total_requests' must be"),
    ],
)
def test_a_bad_bench_multiturn_line_is_refused_field_by_field(tmp_path, line, message):
    from hicache_lab.lab.sglang.bench_log import read_bench_multiturn

    log = _write(tmp_path / "log.jsonl", RUN_LOG, line)
    with pytest.raises(ConfigError, match=re.escape(f"bench_multiturn log {log}:2: ") + ".*" + re.escape(message)):
        read_bench_multiturn(log)


def test_a_bench_multiturn_run_without_rounds_keeps_its_summary(tmp_path):
    from hicache_lab.lab.sglang.bench_log import read_bench_multiturn

    log = _write(
        tmp_path / "log.jsonl", {**RUN_LOG, "round": {}}, {"summary": {"cache_hit_rate": 0.2, "average_ttft": None}}
    )
    rows = read_bench_multiturn(log)
    assert [(r["tag"], r["round"], r["hit_rate"], r["requests"]) for r in rows] == [
        ("sglang", None, 0.4, 0),
        ("line 2", None, 0.2, 0),
    ]
