"""Scheduling as SGLang's: a prompt goes into the tree (and its write-through starts) in the step of its prefill;
chunked prefill and retraction happen under pressure and keep outputs exact on one rank and on a fixed pipeline,
whose legacy twin still diverges; a request whose prefetch is not ready is passed over, not waited for."""

from __future__ import annotations

import dataclasses

import pytest

from hicache_lab.entrypoints.launch import run_world
from hicache_lab.managers.schedule_batch import Req
from hicache_lab.managers.scheduler import Scheduler
from hicache_lab.managers.step_trace import read_trace

PRESSURE = {
    "ignore_eos": False,  # admitted on the estimate of what they answer: decode memory runs out (retractions)
    "output_length": 64,
    "num_rounds": 2,
    "num_clients": 8,
}  # 8 answers of 64 in 256 slots


def under_pressure(cfg):
    scheduler = dataclasses.replace(cfg.scheduler, chunked_prefill_size=16)
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, **PRESSURE), scheduler=scheduler)


def test_a_prompts_host_write_starts_in_the_step_of_its_prefill(small_config, tmp_path):
    summary = run_world(small_config(enable_hierarchical_cache=True), tmp_path, verbose=False)
    assert summary["completed"]
    first = read_trace(tmp_path)[0]
    assert first["kind"] == "prefill" and first["host_write_tokens"] == first["extend_tokens"] > 0


def test_chunked_prefill_and_retraction_keep_outputs_exact(small_config, tmp_path):
    summary = run_world(under_pressure(small_config(enable_hierarchical_cache=True)), tmp_path, verbose=False)
    assert summary["completed"] and summary["outputs_match_reference"] is True, summary["error"]
    counts = summary["scheduling"]
    assert counts["chunked_prefills"] > 0 and counts["retractions"] > 0, counts


@pytest.mark.spawns
def test_a_fixed_pipeline_agrees_through_chunks_and_retractions_and_legacy_does_not(world_config, tmp_path):
    fixed = run_world(under_pressure(world_config(pp=2)), tmp_path / "fixed", verbose=False)
    legacy = run_world(under_pressure(world_config(pp=2, sync="legacy")), tmp_path / "legacy", verbose=False)
    assert fixed["completed"] and not fixed["diverged"] and fixed["outputs_match_reference"], fixed["error"]
    assert fixed["scheduling"]["chunked_prefills"] > 0 and fixed["scheduling"]["retractions"] > 0
    assert legacy["diverged"]


@pytest.mark.spawns
def test_an_async_pipeline_flushed_between_rounds_with_a_store_agrees_and_legacy_does_not(world_config, tmp_path):
    """`--pp-async-batch-depth 1` with a file store and a flush: at a new round the last stage waited for sends
    of the last `pp` iterations, which stage 0 takes back only after `pp + depth`, while stage 0 waited for the
    last stage's storage query (a deadlock of fixed sync, adversarial review T2). The drain counts every slot."""

    def world(sync):
        cfg = world_config(pp=2, sync=sync, pp_async_batch_depth=1)
        store = {"storage_backend": "file", "storage_dir": str(tmp_path / sync / "store")}
        return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, flush_between_rounds=True, **store))

    fixed = run_world(world("fixed"), tmp_path / "fixed", verbose=False)
    legacy = run_world(world("legacy"), tmp_path / "legacy", verbose=False)
    assert fixed["completed"] and not fixed["diverged"] and fixed["outputs_match_reference"], fixed["error"]
    assert sum(r["cached_storage"] for r in fixed["rounds"]) > 0  # the store was read after each flush
    assert legacy["diverged"]


def step(s: Scheduler, iteration: int):
    batch = s.schedule(iteration)
    s.process_result(batch, [7] * len(batch.reqs), None)
    return batch


def test_a_request_whose_prefetch_is_not_ready_is_passed_over(file_cache):
    """wait_complete, a slow storage read: the request behind the prefetching one is admitted first (SGLang's
    `_get_new_batch_prefill_raw` continues past it); the prefetching one follows once its pages are in."""
    cache = file_cache(
        max_total_tokens=128,
        prefetch_policy="wait_complete",
        prefetch_threshold=8,
        max_copy_delay_steps=0,
        flush_between_rounds=True,
    )
    s = Scheduler(cache, max_running=4)
    history = Req(0, 0, 0, list(range(40)), max_new_tokens=2)
    s.add([history])
    for i in range(4):
        step(s, i)
    assert history.finished and cache.storage.stats.pages_backed_up > 0
    s.new_round(flush=True)  # device and host dropped: the history is in storage only
    storage = cache.storage
    storage._due = lambda previous: max(previous, storage.step + 3)  # every storage operation takes 3 steps
    fetching = Req(1, 0, 1, history.prompt + history.output + [90, 91], max_new_tokens=2)
    fresh = Req(2, 1, 1, [200 + t for t in range(12)], max_new_tokens=2)
    s.add([fetching, fresh])
    admitted = {}
    for i in range(10, 30):
        for req in step(s, i).reqs:
            admitted.setdefault(req.rid, i)
        if fetching.finished:
            break
    assert admitted[2] == 10 and admitted[1] > 10, admitted
    assert fetching.cached_storage > 0
    cache.close()
