"""Bad configuration fails at start with a message that names what to change."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hicache_lab.config import CacheConfig, ModelConfig, ParallelConfig, RunConfig, WorkloadConfig
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
