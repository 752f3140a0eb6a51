"""Bad configuration fails at start with a message that names what to change."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import time

import pytest

from hicache_lab.config import CacheConfig, ModelConfig, RunConfig, WorkloadConfig
from hicache_lab.parallel_config import ParallelConfig
from hicache_lab.entrypoints import preflight
from hicache_lab.entrypoints.args import FLAGS, SECTIONS
from hicache_lab.entrypoints.preflight import check_writable_dir, memory_needed
from hicache_lab.errors import ConfigError


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CacheConfig(enable_hierarchical_cache=True, hicache_ratio=0.5), "--hicache-ratio"),
        (lambda: CacheConfig(enable_hierarchical_cache=True, hicache_ratio=1.0), "ratio > 1"),
        (lambda: CacheConfig(max_total_tokens=1000, page_size=64), "use 960"),
        (lambda: CacheConfig(write_policy="write_around"), "--hicache-write-policy"),
        (lambda: CacheConfig(host_layout="page_first_direct"), "--hicache-mem-layout"),
        (lambda: CacheConfig(latency="instant"), "--latency"),
        (lambda: ModelConfig(hidden_size=60, num_heads=4), "--num-heads"),
        (lambda: WorkloadConfig(num_clients=0), "--num-clients"),
        (lambda: WorkloadConfig(chunked_prefill_size=0), "or -1 to turn chunking off"),
        (lambda: WorkloadConfig(max_prefill_tokens=0), "--max-prefill-tokens"),
        (lambda: ParallelConfig(pp_async_batch_depth=-1), "--pp-async-batch-depth"),
        (lambda: CacheConfig(prefetch_timeout_base_s=-1), "--prefetch-timeout-base"),
        (lambda: RunConfig(cache=CacheConfig(max_total_tokens=128)), "raise it"),
    ],
)
def test_bad_configuration_names_the_flag(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_host_pool_in_bytes_smaller_than_device_pool_is_rejected():
    cache = CacheConfig(enable_hierarchical_cache=True, hicache_size_gb=0.001)
    with pytest.raises(ConfigError, match="raise --hicache-size"):
        cache.host_tokens(bytes_per_token=2048)


def test_host_pool_in_bytes_gives_tokens():
    cache = CacheConfig(enable_hierarchical_cache=True, hicache_size_gb=0.016, page_size=64)
    assert cache.host_tokens(bytes_per_token=2048) == 7808  # 16e6 / 2048 = 7812, down to whole pages


def test_cli_reports_bad_configuration_and_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "hicache_lab", "run", "--hicache-write-policy", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "configuration error" in result.stderr and "--hicache-write-policy" in result.stderr


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ParallelConfig(pp=2, fault="kill-rank:9@3"), "rank 9 is not in a world of 2"),
        (lambda: ParallelConfig(fault="kill-rank:0@3"), "needs a world of 2 or more ranks"),
        (lambda: ParallelConfig(fault="explode:0@1"), "write KIND:RANK@N"),
        (lambda: ParallelConfig(pp=3, pp_layer_partition=(1, 2)), "one layer count per stage"),
        (lambda: RunConfig(parallel=ParallelConfig(pp=2, pp_layer_partition=(2, 3))), "must add up to --num-layers 4"),
    ],
)
def test_bad_fault_or_layer_partition_names_the_flag(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--enable-hierarchical-cache", "--hicache-size", "0.00001"], "raise --hicache-size"),
        (["--out", "{file}"], "--out {file} is a file"),
        (["--enable-hierarchical-cache", "--hicache-storage-backend=file", "--hicache-storage-dir={file}"], "a file"),
    ],
)
def test_what_only_the_launcher_can_check_still_fails_before_any_rank_starts(args, message, tmp_path, capsys):
    from hicache_lab.__main__ import main

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["run", *(a.format(file=a_file) for a in args)]) == 2
    assert message.format(file=a_file) in capsys.readouterr().err


def test_mooncake_where_it_cannot_run_is_refused_before_any_rank_starts(tmp_path, capsys):
    """Where Mooncake cannot run (its package or the system library libibverbs1 missing), a run on it is refused
    naming what to install; where it can, the same flags pass the check that refuses them."""
    from hicache_lab.__main__ import main
    from hicache_lab.mem_cache.hicache_storage import mooncake_missing

    flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"]
    if why := mooncake_missing():
        assert main(["run", *flags, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "--hicache-storage-backend mooncake: `import mooncake.store` fails here" in err, err
        assert "libibverbs1" in err and "pip install mooncake-transfer-engine-non-cuda" in err and why in err
        assert not (tmp_path / "out").exists()  # refused before the run claimed its directory
    else:
        cfg = RunConfig(cache=CacheConfig(enable_hierarchical_cache=True, storage_backend="mooncake"))
        preflight.preflight(cfg, tmp_path / "out")


# -- every field of every config dataclass, and the values no flag type stops -----------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ModelConfig(num_heads=0), "--num-heads must be at least 1"),  # was a ZeroDivisionError
        (lambda: ModelConfig(hidden_size=0), "--hidden-size must be at least 1"),  # was a crash in a rank
        (lambda: ModelConfig(mlp_size=0), "--mlp-size must be at least 1"),  # ran, with no MLP
        (lambda: ModelConfig(vocab_size=1), "--vocab-size must be at least 2"),
        (lambda: ModelConfig(seed=-1), "--model-seed -1 must be in 0..2"),
        (lambda: ModelConfig(rope_theta=float("inf")), "ModelConfig.rope_theta must be a finite number"),
        (lambda: CacheConfig(hicache_ratio=float("nan")), "CacheConfig.hicache_ratio must be a finite number, got nan"),
        (lambda: CacheConfig(hicache_size_gb=float("inf")), "CacheConfig.hicache_size_gb must be a finite number"),
        (lambda: CacheConfig(injected_delay_ms=float("nan")), "CacheConfig.injected_delay_ms must be a finite number"),
        (lambda: CacheConfig(max_total_tokens=-5, page_size=3), "--max-total-tokens -5 must hold at least one page"),
        (lambda: CacheConfig(max_total_tokens=True), "CacheConfig.max_total_tokens must be an integer, got True"),
        (lambda: CacheConfig(load_back_threshold=-1), "--load-back-threshold must be >= 0"),
        (lambda: CacheConfig(prefetch_timeout_steps=-1), "--storage-prefetch-timeout-steps must be >= 0"),
        (lambda: CacheConfig(mooncake_master="nohost", mooncake_metadata_url="http://x"), "write HOST:PORT"),
        (lambda: WorkloadConfig(seed=-1), "--seed -1 must be in 0..2"),
        (lambda: WorkloadConfig(num_clients="4"), "WorkloadConfig.num_clients must be an integer, got '4'"),
        (
            lambda: ParallelConfig(collective_timeout_s=float("nan")),
            "ParallelConfig.collective_timeout_s must be a finite number",
        ),
        (lambda: ParallelConfig(collective_timeout_s=1e9), "give at most 86400 s"),
        (lambda: ParallelConfig(pp_async_batch_depth=10**7), "give at most 64"),
        (lambda: RunConfig(cache=CacheConfig(injected_delay_ms=1e9)), "1/100 of --collective-timeout"),
    ],
)
def test_values_no_flag_type_stops_are_refused_naming_the_flag(make, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make()


def _numeric_fields():
    kinds = ("int", "float")
    return [(cls, f.name) for cls in SECTIONS.values() for f in dataclasses.fields(cls) if f.type in kinds]


@pytest.mark.parametrize(("cls", "name"), _numeric_fields(), ids=lambda v: getattr(v, "__name__", v))
def test_every_number_of_every_config_refuses_nan_bools_and_negative_values(cls, name):
    for value in (float("nan"), float("inf"), True, "3"):  # what argparse's types stop, built in Python
        with pytest.raises(ConfigError, match=re.escape(f"{cls.__name__}.{name} must be ")):
            cls(**{name: value})
    flag = next((f for f, section, n, _, _ in FLAGS if n == name and SECTIONS[section] is cls), f"{cls.__name__}.")
    with pytest.raises(ConfigError, match=re.escape(flag)):  # no size, count, timeout or seed is negative
        cls(**{name: -2})  # (-1 is --chunked-prefill-size's "no chunking")


@pytest.mark.parametrize("flag", [flag for flag, _, _, kind, _ in FLAGS if kind is not int and kind is not str])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e999"])
def test_every_float_flag_refuses_inf_and_nan(flag, value, capsys):
    from hicache_lab.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", f"{flag}={value}"])
    assert exit_.value.code == 2
    assert f"argument {flag}: '{value}' is not a finite number" in capsys.readouterr().err


# -- this machine: memory, writable directories, the environment --------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-total-tokens", str(10**12)], "for device KV pools: lower --max-total-tokens"),
        (["--enable-hierarchical-cache", "--hicache-ratio", "1e12"], "for host KV pools: lower --hicache-ratio"),
        (["--enable-hierarchical-cache", "--hicache-size", "1e6"], "for host KV pools: lower --hicache-size"),
        (["--vocab-size", str(10**9), "--num-clients", "1"], "for model weights: lower --vocab-size"),
        (
            ["--chunked-prefill-size", "-1", "--request-length", "200000", "--max-total-tokens", "300000"],
            "for attention of one prefill: lower --chunked-prefill-size",
        ),  # fmt: skip
    ],
)
def test_a_world_larger_than_this_machine_is_refused_naming_the_flag(args, message, tmp_path, capsys):
    from hicache_lab.__main__ import main

    assert main(["run", "--num-rounds", "1", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "more than this machine's" in err and message in err
    assert not (tmp_path / "out").exists()


def test_the_memory_check_is_against_this_machine(monkeypatch, tmp_path):
    cfg = RunConfig()
    assert sum(n for n, _, _ in memory_needed(cfg).values()) < 1e9  # the default world fits any machine
    preflight.preflight(cfg, tmp_path / "out")
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 25_000}  # a machine of 100 MB
    monkeypatch.setattr(preflight.os, "sysconf", lambda name: pages[name])
    with pytest.raises(ConfigError, match="more than this machine's 0.102 GB of memory; the most, 0.3 GB, for rank"):
        preflight.preflight(cfg, tmp_path / "out")


def test_an_output_directory_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    check_writable_dir(tmp_path / "new" / "deeper", "--out")  # the nearest existing directory is writable
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # and nothing was left there
    with pytest.raises(ConfigError, match="--out /proc/x/y is not writable: cannot create a file in /proc"):
        check_writable_dir("/proc/x/y", "--out")  # even root cannot
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="afile is a file, not a directory"):
        check_writable_dir(tmp_path / "afile" / "out", "--out")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # another user's directory
    with pytest.raises(ConfigError, match=r"--out runs/latest is not writable \(relative to the working directory "):
        check_writable_dir("runs/latest", "--out")


@pytest.mark.parametrize(
    ("environ", "answer"),
    [
        ({}, False),
        ({"RANK": "0", "WORLD_SIZE": "1"}, False),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, True),
        ({"WORLD_SIZE": "2"}, "RANK is missing"),
        ({"RANK": "0"}, "WORLD_SIZE is missing"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK is not an integer in 0..1"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK is not an integer in 0..1"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE is not a positive integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE is not a positive integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR is missing"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT is not a port"),
    ],
)
def test_stale_torchrun_variables_are_refused_naming_them(environ, answer):
    from hicache_lab.__main__ import started_by_torchrun

    if isinstance(answer, bool):
        assert started_by_torchrun(environ) is answer
    else:
        with pytest.raises(ConfigError, match=f"{answer}.*unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT"):
            started_by_torchrun(environ)


# -- files: Mooncake traces and bench_multiturn logs, field by field ----------------------------------------------

LINE = {"timestamp": 1, "input_length": 100, "output_length": 5, "hash_ids": [1]}


def _write(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({**LINE, "hash_ids": [1, True]}, "'hash_ids'[1] is True, not a non-negative integer"),
        ({**LINE, "hash_ids": [1, -4]}, "'hash_ids'[1] is -4"),
        ({**LINE, "hash_ids": [1.5]}, "'hash_ids'[0] is 1.5"),
        ({**LINE, "input_length": True}, "'input_length' must be an integer in 1..512"),
        ({**LINE, "input_length": 100.0}, "'input_length' must be an integer"),
        ({**LINE, "output_length": "5"}, "'output_length' must be an integer of at least 1 (tokens), got '5'"),
        ({**LINE, "output_length": 0}, "'output_length' must be an integer of at least 1"),
        ({**LINE, "output_length": None}, "'output_length' must be an integer"),
        ({**LINE, "timestamp": -3}, "'timestamp' must be a number >= 0"),
        ({**LINE, "timestamp": "soon"}, "'timestamp' must be a number >= 0"),
        ({**LINE, "timestamp": False}, "'timestamp' must be a number >= 0"),
        ('{"timestamp": NaN, "input_length": 100, "hash_ids": [1]}', "not JSON (NaN is not a number"),
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
        ({"summary": {"cache_hit_rate": 1.5}}, "'summary': 'cache_hit_rate' must be a number in 0..1, got 1.5"),
        ({"summary": {"cache_hit_rate": "0.5"}}, "'cache_hit_rate' must be a number in 0..1, got '0.5'"),
        ({"summary": {"cache_hit_rate": True}}, "'cache_hit_rate' must be a number in 0..1, got True"),
        ('{"summary": {"cache_hit_rate": NaN}}', "not JSON (NaN is not a number JSON allows)"),
        ({**RUN_LOG, "tag": 5}, "'tag' must be a string, got 5"),
        ({**RUN_LOG, "round": [1, 2]}, "'round' must be an object of round_N entries"),
        ({**RUN_LOG, "round": {"round_x": {"cache_hit_rate": 0.5}}}, "'round' key 'round_x' is not round_N"),
        ({**RUN_LOG, "round": {"round_-1": {"cache_hit_rate": 0.5}}}, "'round' key 'round_-1' is not round_N"),
        ({**RUN_LOG, "round": {"round_1": {}, "round_01": {}}}, "'round' names a round twice"),
        ({**RUN_LOG, "round": {"round_0": 0.5}}, "'round.round_0' must be an object, got 0.5"),
        ({**RUN_LOG, "round": {"round_0": {"average_ttft": 1}}}, "'round.round_0': 'cache_hit_rate' must be"),
        ({**RUN_LOG, "round": {"round_0": {"cache_hit_rate": 0.5, "average_ttft": "fast"}}}, "'average_ttft' must"),
        ({**RUN_LOG, "round": {"round_0": {"cache_hit_rate": 0.5, "average_ttft": -1}}}, "seconds >= 0, got -1"),
        ({**RUN_LOG, "round": {"round_0": {"cache_hit_rate": 0.5, "request_count": 2.5}}}, "'request_count' must"),
        ({"summary": {"cache_hit_rate": 0.5, "total_requests": -1}}, "'summary': 'total_requests' must be"),
    ],
)
def test_a_bad_bench_multiturn_line_is_refused_field_by_field(tmp_path, line, message):
    from hicache_lab.lab.sglang.source import read_bench_multiturn

    log = _write(tmp_path / "log.jsonl", RUN_LOG, line)
    with pytest.raises(ConfigError, match=re.escape(f"bench_multiturn log {log}:2: ") + ".*" + re.escape(message)):
        read_bench_multiturn(log)


def test_a_bench_multiturn_run_without_rounds_keeps_its_summary(tmp_path):
    from hicache_lab.lab.sglang.source import read_bench_multiturn

    log = _write(
        tmp_path / "log.jsonl", {**RUN_LOG, "round": {}}, {"summary": {"cache_hit_rate": 0.2, "average_ttft": None}}
    )
    rows = read_bench_multiturn(log)
    assert [(r["tag"], r["round"], r["hit_rate"], r["requests"]) for r in rows] == [
        ("sglang", None, 0.4, 0),
        ("line 2", None, 0.2, 0),
    ]


# -- exhaustive: the work is counted before anything is enumerated ------------------------------------------------


def test_exhaustive_timings_are_found_copy_by_copy_as_the_product_found_them():
    from hicache_lab.lab.check.exhaustive import completion_steps, count_timings, timings

    for copies in range(5):
        for max_delay in range(5):
            brute: dict = {}  # the former enumeration: every delay tuple, first one per timing
            for delays in itertools.product(range(max_delay + 1), repeat=copies):
                brute.setdefault(completion_steps(delays), delays)
            assert timings(copies, max_delay) == list(brute.values())
            assert count_timings(copies, max_delay) == len(brute)


@pytest.mark.parametrize(
    ("stages", "copies", "max_delay", "message"),
    [
        (2, 50, 50, "--stages 2 --copies 50 --max-delay 50 asks for at least"),  # 51**50 delays to enumerate
        (3, 10**9, 1, "stage-steps, at most 150,000"),  # few timings, a billion steps each
        (2, 1, 10**12, "asks for at least 1e+24 schedules"),
        (2, 0, 2, "at least 1 copy"),
        (2, 3, -1, "a delay of at least 0 steps"),
    ],
)
def test_exhaustive_refuses_work_past_its_bound_before_enumerating(stages, copies, max_delay, message):
    from hicache_lab.lab.check.exhaustive import check_work

    started = time.monotonic()
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_work(stages, copies, max_delay, ["fixed", "legacy"])
    assert time.monotonic() - started < 1
    assert check_work(2, 3, 3, ["fixed", "legacy"]) == 529 * 2 * 7 * 2  # the README's run stays allowed
