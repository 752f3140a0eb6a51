"""With virtual latency a run is reproducible bit for bit: same seed, same steps, acks, tree and tokens."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from hicache_lab.launch import build_scheduler
from hicache_lab.parallel import RankLayout, build_groups
from hicache_lab.workload import MultiTurnWorkload, run_workload


def trace_of(cfg):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        scheduler = build_scheduler(cfg, build_groups(RankLayout(1, 1, 1, 0), cfg.parallel))
        reqs = run_workload(scheduler, MultiTurnWorkload(cfg.workload, cfg.model.vocab_size))
        steps = [
            (r.kind, r.requests, r.extend_tokens, r.prefix_tokens, r.acks_write, r.acks_load) for r in scheduler.records
        ]
        return steps, [r.output for r in reqs], scheduler.cache.tree.digest()
    finally:
        dist.destroy_process_group()


def test_virtual_latency_runs_are_reproducible(small_config):
    cfg = small_config(check_outputs=False, enable_hierarchical_cache=True)
    first, second = trace_of(cfg), trace_of(cfg)
    assert first == second
    assert sum(step[5] for step in first[0]) > 0, "loads must have happened"


def test_copy_latency_changes_the_ack_timeline(small_config):
    cfg = small_config(check_outputs=False, enable_hierarchical_cache=True)
    other = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, max_copy_delay_steps=0))
    acks = [[s[4:] for s in trace_of(c)[0]] for c in (cfg, other)]
    assert acks[0] != acks[1]
