"""Mooncake trace replay and SGLang bench_multiturn logs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hicache_lab.config import CacheConfig, RunConfig, WorkloadConfig
from hicache_lab.entrypoints.launch import run_world
from hicache_lab.entrypoints.report import mean_hit_rate
from hicache_lab.errors import ConfigError
from hicache_lab.lab.sglang.bench_log import read_bench_multiturn
from hicache_lab.mooncake_trace import read_mooncake_trace

SAMPLE = str(Path(__file__).resolve().parents[2] / "data" / "mooncake_sample.jsonl")


def write_lines(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_shared_hash_ids_become_shared_prefixes_in_timestamp_order(tmp_path):
    trace = write_lines(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 50, "input_length": 1500, "output_length": 100, "hash_ids": [7, 8, 9]},
            {"timestamp": 10, "input_length": 1024, "output_length": 512, "hash_ids": [7, 8]},
            {"timestamp": 30, "input_length": 300, "output_length": 1, "hash_ids": [5]},
        ],
    )
    first, second, third = read_mooncake_trace(trace, 16, 8, 256, 0)
    assert [r.timestamp for r in (first, second, third)] == [10, 30, 50]
    assert len(first.prompt) == 32 and len(second.prompt) == 10 and len(third.prompt) == 47  # ceil(n * 16 / 512)
    assert third.prompt[:32] == first.prompt  # ids 7, 8 shared
    assert second.prompt[:10] != first.prompt[:10]  # id 5 is other tokens
    assert (first.output_length, second.output_length, third.output_length) == (8, 1, 4)  # scaled, capped at 8


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (["{not json"], "not JSON"),
        ([{"input_length": 10}], "needs a non-empty 'hash_ids'"),
        ([{"input_length": 1025, "hash_ids": [1, 2]}], "must be an integer in 1..1024"),
        ([[1, 2]], "expected a JSON object"),
        ([], "holds no lines"),
    ],
)
def test_bad_traces_name_the_line_and_the_fix(tmp_path, lines, message):
    trace = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ConfigError, match=message):
        WorkloadConfig(trace_file=trace)


def test_a_trace_too_short_for_its_windows_or_missing_is_a_configuration_error(tmp_path):
    trace = write_lines(tmp_path / "two.jsonl", [{"input_length": 5, "hash_ids": [1]}] * 2)
    with pytest.raises(ConfigError, match="holds 2 requests, fewer than --num-rounds 3"):
        WorkloadConfig(trace_file=trace, num_rounds=3)
    assert WorkloadConfig(trace_file=trace, num_rounds=3, round_barrier=False)  # one window: the whole trace
    with pytest.raises(ConfigError, match="no such file"):
        WorkloadConfig(trace_file=str(tmp_path / "missing.jsonl"))


def test_replayed_trace_is_served_correctly_and_the_host_tier_keeps_its_prefixes(tmp_path):
    base = RunConfig(workload=WorkloadConfig(trace_file=SAMPLE), check_outputs=True)
    rates = {}
    for hicache in (False, True):  # a 4,096-token pool: the README's figures
        cfg = dataclasses.replace(base, cache=CacheConfig(max_total_tokens=4096, enable_hierarchical_cache=hicache))
        summary = run_world(cfg, tmp_path / str(hicache), verbose=False)
        assert summary["outputs_match_reference"] is True
        rates[hicache] = mean_hit_rate(summary["rounds"], 6, 7)
        bound = mean_hit_rate(summary["rounds"], 6, 7, "upper_bound_hit_rate")
    assert rates[True] == pytest.approx(bound)  # 89.6% on the sample: every shared prefix found
    assert rates[True] > rates[False] + 0.15  # the device pool alone has lost some (72.1%)


def test_bench_multiturn_logs_become_rows_per_run_and_round(tmp_path):
    log = write_lines(
        tmp_path / "performance_metrics.jsonl",
        [
            {
                "tag": "hicache",
                "summary": {"cache_hit_rate": 0.4, "average_ttft": 0.2, "total_requests": 6},
                "round": {
                    "round_1": {"cache_hit_rate": 0.6, "average_ttft": 0.1, "request_count": 3},
                    "round_0": {"cache_hit_rate": 0.0, "average_ttft": 0.3, "request_count": 3},
                },
            },
            {"summary": {"cache_hit_rate": 0.3, "average_ttft": 0.5, "total_requests": 4}},
        ],
    )
    rows = read_bench_multiturn(log)
    assert [(r["tag"], r["round"], r["hit_rate"], r["requests"]) for r in rows] == [
        ("hicache", 0, 0.0, 3),
        ("hicache", 1, 0.6, 3),
        ("line 2", None, 0.3, 4),
    ]
    assert rows[1]["ttft_ms"] == pytest.approx(100.0)
    with pytest.raises(ConfigError, match="no 'summary.cache_hit_rate'"):
        read_bench_multiturn(write_lines(tmp_path / "other.jsonl", [{"summary": {"ttft": 1}}]))


def test_run_compares_with_a_bench_multiturn_log_and_rejects_another_file_before_running(tmp_path, capsys):
    from hicache_lab.__main__ import main

    log = write_lines(
        tmp_path / "log.jsonl",
        [{"tag": "sglang", "summary": {"cache_hit_rate": 0.3}, "round": {"round_1": {"cache_hit_rate": 0.5}}}],
    )
    small = ["--num-clients", "2", "--num-rounds", "2", "--request-length", "64", "--out", str(tmp_path / "run")]
    assert main(["run", *small, "--compare-sglang", log]) == 0
    assert "   1  70.5%           50.0%" in capsys.readouterr().out  # the lab's round 1 beside SGLang's
    assert (tmp_path / "run" / "hit_rate_vs_sglang.png").stat().st_size > 0
    other = write_lines(tmp_path / "other.jsonl", [{"summary": {}}])
    assert main(["run", *small[:-1], str(tmp_path / "never"), "--compare-sglang", other]) == 2
    assert not (tmp_path / "never").exists()


def test_a_rewritten_trace_is_read_again(tmp_path):
    import os

    path = tmp_path / "t.jsonl"
    write_lines(path, [{"input_length": 16, "hash_ids": [1]}])
    assert len(read_mooncake_trace(str(path), 16, 8, 256, 0)) == 1
    write_lines(path, [{"input_length": 16, "hash_ids": [1]}] * 3)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))  # a later version
    assert len(read_mooncake_trace(str(path), 16, 8, 256, 0)) == 3
