"""What the soak found, pinned down: each a world that once failed in fixed mode."""

from __future__ import annotations

import dataclasses

import pytest

from hicache_lab.entrypoints.launch import run_world


def test_a_head_waiting_for_room_held_by_prefetch_anchors_behind_it_does_not_livelock(small_config, tmp_path):
    """Soak case 2 (seed 0 of the first draw): the head of the queue did not fit the device pool while
    prefetches of requests behind it kept their anchors locked; they ended only at their own admission, so
    the loop idled forever. SGLang's way closes it: an anchor is only host-protected (the device may evict
    it), and admission passes over a request still prefetching."""
    cfg = small_config(
        enable_hierarchical_cache=True,
        page_size=2,
        write_policy="write_through_selective",
        latency="real",
        storage_backend="file",
        prefetch_policy="wait_complete",
        prefetch_threshold=16,
    )
    cfg.model.num_layers = 4
    cfg.workload.num_rounds, cfg.workload.seed = 3, 287852352
    summary = run_world(cfg, tmp_path, verbose=False)
    assert summary["completed"] and summary["outputs_match_reference"] is True


@pytest.mark.spawns
def test_a_later_stage_waits_for_its_own_agreement_of_a_prefetch_batch(world_config, tmp_path):
    """Soak case 423 (seed 1, issue 30's draw): three stages, a file store flushed between rounds. Stage 0
    relayed a prefetch batch's ack that stage 1's read thread had agreed with it but not yet recorded: stage 1
    read past the end of its agreements (IndexError). It now waits for its thread, which has entered that
    collective already."""
    cfg = world_config(pp=3)
    cache = {"storage_backend": "file", "prefetch_policy": "timeout", "prefetch_threshold": 16}
    cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, flush_between_rounds=True, **cache))
    cfg.model.num_layers, cfg.workload.num_rounds, cfg.workload.seed = 4, 3, 174809984
    summary = run_world(cfg, tmp_path, verbose=False)
    assert summary["completed"] and not summary["diverged"] and summary["outputs_match_reference"], summary["error"]
