"""With virtual latency a run is reproducible bit for bit: same seed, same steps, acks, tree and tokens."""

from __future__ import annotations

import dataclasses

from hicache_lab.entrypoints.launch import run
from hicache_lab.managers.step_trace import read_trace


def timeline(cfg, out_dir):
    run(cfg, out_dir, verbose=False)
    steps = [{k: v for k, v in row.items() if k != "ms"} for row in read_trace(out_dir)]
    return steps, (out_dir / "requests.jsonl").read_text()


def test_virtual_latency_runs_are_reproducible(small_config, tmp_path):
    cfg = small_config(check_outputs=False, enable_hierarchical_cache=True)
    first, second = timeline(cfg, tmp_path / "a"), timeline(cfg, tmp_path / "b")
    assert first == second
    assert sum(step["acks_load"] for step in first[0]) > 0, "loads must have happened"


def test_copy_latency_changes_the_ack_timeline(small_config, tmp_path):
    cfg = small_config(check_outputs=False, enable_hierarchical_cache=True)
    instant = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, max_copy_delay_steps=0))
    acks = [
        [(s["acks_write"], s["acks_load"]) for s in timeline(c, tmp_path / n)[0]]
        for c, n in ((cfg, "a"), (instant, "b"))
    ]
    assert acks[0] != acks[1]
