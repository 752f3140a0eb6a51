"""With virtual latency a run is reproducible bit for bit: same seed, same steps, acks, tree and tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hicache_lab.entrypoints.launch import run_world
from hicache_lab.lab.check.faults import FAULTS
from hicache_lab.managers.step_trace import read_trace


def timeline(cfg, out_dir):
    run_world(cfg, out_dir, verbose=False)
    steps = [{k: v for k, v in row.items() if k != "ms"} for row in read_trace(out_dir)]  # modelled_ms stays
    modelled = [r["modelled_ttft_ms"] for r in json.loads((out_dir / "summary.json").read_text())["rounds"]]
    return steps, (out_dir / "requests.jsonl").read_text(), modelled


def test_virtual_latency_runs_are_reproducible(small_config, tmp_path):
    cfg = small_config(check_outputs=False, enable_hierarchical_cache=True)
    first, second = timeline(cfg, tmp_path / "a"), timeline(cfg, tmp_path / "b")
    assert first == second  # the modelled TTFTs too (managers/latency_model.py)
    assert sum(step["acks_load"] for step in first[0]) > 0, "loads must have happened"
    assert all(ttft > 0 for ttft in first[2]) and len(set(first[2])) > 1


def test_copy_latency_changes_the_ack_timeline(small_config, tmp_path):
    cfg = small_config(check_outputs=False, enable_hierarchical_cache=True)
    instant = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, max_copy_delay_steps=0))
    acks = [
        [(s["acks_write"], s["acks_load"]) for s in timeline(c, tmp_path / n)[0]]
        for c, n in ((cfg, "a"), (instant, "b"))
    ]
    assert acks[0] != acks[1]


@pytest.mark.spawns
def test_a_cp_peer_reading_its_writers_pages_finds_them_however_slow_the_writer(tmp_path):
    """With one writer per CP group, CP rank 1 looks in storage for the pages CP rank 0 backed up. After a flush
    it must find what rank 0 backed up in that flush, even when rank 0 is slow to write it (a loaded machine):
    the run under virtual latency is the same with rank 0 slowed by 20 ms a step."""
    from hicache_lab.lab.presets import WORLD, config

    storage = (
        "--hicache-storage-backend file --hicache-storage-prefetch-policy wait_complete --storage-prefetch-threshold "
        "16 --flush-cache-between-rounds --hicache-storage-writers one --cp 2 --num-rounds 3"
    )
    cfg, slow = (
        config(WORLD.replace("--check-outputs", ""), storage, extra) for extra in ("", "--fault slow-rank:0@20")
    )
    runs = [run_world(c, tmp_path / name, verbose=False, binders=(FAULTS,)) for c, name in ((cfg, "a"), (slow, "b"))]
    hit_rates = [[r["hit_rate"] for r in s["rounds"]] for s in runs]
    assert hit_rates[0][1] > 0.5, "round 1 finds its history in storage"
    assert hit_rates[0] == hit_rates[1]
