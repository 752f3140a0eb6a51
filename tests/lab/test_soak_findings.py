"""What the soak found, pinned down: each a world that once failed in fixed mode."""

from __future__ import annotations

from hicache_lab.entrypoints.launch import run


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
    summary = run(cfg, tmp_path, verbose=False)
    assert summary["completed"] and summary["outputs_match_reference"] is True
