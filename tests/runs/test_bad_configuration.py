"""Bad configuration fails at start with a message that names what to change: every config dataclass, field by
field, and the values no flag type stops. A refusal that a fast class-10 hostile case checks through the CLI
(tests/hostile/test_hostile.py: exit code, message, no file touched) is not repeated here."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from hicache_lab.args import FLAGS, SECTIONS
from hicache_lab.config import CacheConfig, ModelConfig, RunConfig, SchedulerConfig, WorkloadConfig
from hicache_lab.errors import ConfigError
from hicache_lab.lab.check.faults import FAULTS
from hicache_lab.parallel_config import ParallelConfig


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
        (lambda: SchedulerConfig(chunked_prefill_size=0), "or -1 to turn chunking off"),
        (lambda: SchedulerConfig(max_prefill_tokens=0), "--max-prefill-tokens"),
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


@pytest.mark.spawns
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
        (lambda: FAULTS.check(RunConfig(parallel=ParallelConfig(pp=2)).with_lab(fault="kill-rank:9@3")), "rank 9 is"),
        (lambda: FAULTS.check(RunConfig().with_lab(fault="kill-rank:0@3")), "needs a world of 2 or more ranks"),
        (lambda: FAULTS.check(RunConfig().with_lab(fault="explode:0@1")), "write KIND:RANK@N"),
        (lambda: ParallelConfig(pp=3, pp_layer_partition=(1, 2)), "one layer count per stage"),
        (lambda: RunConfig(parallel=ParallelConfig(pp=2, pp_layer_partition=(2, 3))), "must add up to --num-layers 4"),
    ],
)
def test_bad_fault_or_layer_partition_names_the_flag(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


# -- every field of every config dataclass, and the values no flag type stops -----------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ModelConfig(hidden_size=0), "--hidden-size must be at least 1"),  # was a crash in a rank
        (lambda: ModelConfig(mlp_size=0), "--mlp-size must be at least 1"),  # ran, with no MLP
        (lambda: ModelConfig(seed=-1), "--model-seed -1 must be in 0..2"),
        (lambda: ModelConfig(rope_theta=float("inf")), "ModelConfig.rope_theta must be a finite number"),
        (lambda: CacheConfig(hicache_ratio=float("nan")), "CacheConfig.hicache_ratio must be a finite number, got nan"),
        (lambda: CacheConfig(hicache_size_gb=float("inf")), "CacheConfig.hicache_size_gb must be a finite number"),
        (lambda: CacheConfig(injected_delay_ms=float("nan")), "CacheConfig.injected_delay_ms must be a finite number"),
        (lambda: CacheConfig(max_total_tokens=True), "CacheConfig.max_total_tokens must be an integer, got True"),
        (lambda: CacheConfig(load_back_threshold=-1), "--load-back-threshold must be >= 0"),
        (lambda: CacheConfig(prefetch_timeout_steps=-1), "--storage-prefetch-timeout-steps must be >= 0"),
        (lambda: CacheConfig(mooncake_master="nohost", mooncake_metadata_url="http://x"), "write HOST:PORT"),
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
