"""The default workload reproduces the shape SGLang reported: L1 alone collapses, L1 + L2 tracks the bound."""

from __future__ import annotations

import pytest

from hicache_lab.config import CacheConfig, RunConfig
from hicache_lab.entrypoints.launch import run_world
from hicache_lab.entrypoints.report import mean_hit_rate

pytestmark = pytest.mark.slow  # the default workload, in this process: seconds


@pytest.fixture(scope="module")
def demo_rounds():
    return {
        hicache: run_world(RunConfig(cache=CacheConfig(enable_hierarchical_cache=hicache)), verbose=False)["rounds"]
        for hicache in (False, True)
    }


def test_device_only_cache_collapses_in_later_rounds(demo_rounds):
    assert mean_hit_rate(demo_rounds[False], 6, 7) < 0.40  # 44% then 28%: the histories outgrow the device


def test_hierarchical_cache_keeps_later_rounds_hitting(demo_rounds):
    rows = demo_rounds[True]
    assert mean_hit_rate(rows, 4, 7) > 0.70
    assert mean_hit_rate(rows, 6, 7) > mean_hit_rate(demo_rounds[False], 6, 7) + 0.45
    assert sum(r["cached_host"] for r in rows) > 0


def test_hit_rates_never_exceed_the_infinite_cache_bound(demo_rounds):
    for rows in demo_rounds.values():
        for row in rows:
            assert row["hit_rate"] <= row["upper_bound_hit_rate"] + 1e-9
            assert row["cached_tokens"] == row["cached_device"] + row["cached_host"]
