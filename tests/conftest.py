"""Shared helpers: a small workload that still overflows the device pool, so eviction and load-back happen."""

from __future__ import annotations

import pytest
import torch

from hicache_lab.config import CacheConfig, ModelConfig, ParallelConfig, RunConfig, WorkloadConfig

torch.set_num_threads(1)  # as launch.run does: tiny tensors, shared cores


def make_small_config(check_outputs: bool = True, **cache_overrides) -> RunConfig:
    cache = {"max_total_tokens": 256, "hicache_ratio": 3.0, **cache_overrides}
    return RunConfig(
        model=ModelConfig(num_layers=2),
        cache=CacheConfig(**cache),
        workload=WorkloadConfig(
            num_clients=4, num_rounds=4, request_length=32, sub_question_input_length=16, output_length=8
        ),
        parallel=ParallelConfig(collective_timeout_s=30),
        check_outputs=check_outputs,
    )


@pytest.fixture
def small_config():
    """Factory: small_config(**cache_overrides) -> RunConfig."""
    return make_small_config


def make_world_config(tp=1, cp=1, pp=1, sync="fixed", **parallel_overrides) -> RunConfig:
    """The small workload on a multi-rank world: 3 layers (so stages hold different layer counts)."""
    cfg = make_small_config(enable_hierarchical_cache=True)
    cfg.model = ModelConfig(num_layers=3)
    cfg.parallel = ParallelConfig(tp=tp, cp=cp, pp=pp, sync=sync, **{"collective_timeout_s": 20, **parallel_overrides})
    return RunConfig(cfg.model, cfg.cache, cfg.workload, cfg.parallel, check_outputs=True)


@pytest.fixture
def world_config():
    """Factory: world_config(tp=, cp=, pp=, sync=, **parallel_overrides) -> RunConfig."""
    return make_world_config
