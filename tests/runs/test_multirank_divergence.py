"""Virtual latency, same seed: each legacy world diverges (or crashes on the divergence) and its fixed twin
completes with identical decisions on every rank and outputs that match the reference."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from hicache_lab.entrypoints.launch import run_world
from hicache_lab.entrypoints.report import whole_steps
from hicache_lab.managers.step_trace import first_divergence, read_trace

pytestmark = pytest.mark.spawns

WORLDS = {"pp2": {"pp": 2}, "cp2": {"cp": 2}, "pp3": {"pp": 3}, "pp2_cp2": {"pp": 2, "cp": 2}}


def assert_diverged(summary):
    assert summary["diverged"], "legacy must diverge"
    assert summary["first_divergence"]["quantity"] in ("acks_write", "acks_load")
    if summary["crashed"]:
        assert summary["failing_rank"] is not None and summary["error"]


def assert_consistent(summary):
    assert summary["completed"], summary["error"]
    assert not summary["diverged"], summary["first_divergence"]
    assert summary["outputs_match_reference"] is True, summary["oracle"]


@pytest.mark.parametrize("world", WORLDS)
def test_legacy_diverges_and_fixed_does_not(world_config, world, tmp_path):
    legacy = run_world(world_config(sync="legacy", **WORLDS[world]), tmp_path / "legacy", verbose=False)
    fixed = run_world(world_config(sync="fixed", **WORLDS[world]), tmp_path / "fixed", verbose=False)
    assert_diverged(legacy)
    assert_consistent(fixed)
    assert sum(r["cached_host"] for r in fixed["rounds"]) > 0, "the fixed run must exercise load-back"


def test_tp_without_sync_diverges_and_legacy_tp_agreement_does_not(world_config, tmp_path):
    off = run_world(world_config(tp=2, sync="off"), tmp_path / "off", verbose=False)
    # legacy agrees on write acks over attention-TP; its load acks are not agreed (test_bug_zoo: load_acks)
    legacy = run_world(
        world_config(tp=2, sync="legacy", enable_fixes=("agree_loads",)), tmp_path / "legacy", verbose=False
    )
    assert_diverged(off)
    assert "TP peers disagree" in off["error"]
    assert_consistent(legacy)


def test_the_same_seed_gives_the_same_first_divergence(world_config, tmp_path):
    firsts = [
        run_world(world_config(pp=2, sync="legacy"), tmp_path / n, verbose=False)["first_divergence"] for n in "ab"
    ]
    assert firsts[0] == firsts[1]


def test_consensus_check_fails_fast_at_the_first_divergent_step(world_config, tmp_path):
    plain = run_world(world_config(pp=2, sync="legacy"), tmp_path / "plain", verbose=False)
    checked = run_world(world_config(pp=2, sync="legacy", consensus_check=1), tmp_path / "checked", verbose=False)
    step = plain["first_divergence"]["step"]
    assert checked["crashed"] and "ConsensusError" in checked["error"]
    assert f"at step {step}" in checked["error"] and plain["first_divergence"]["quantity"] in checked["error"]


def test_cp_fix_alone_is_what_keeps_cp_peers_together(world_config, tmp_path):
    without = run_world(world_config(cp=2, disable_fixes=("cp_groups",)), tmp_path / "without", verbose=False)
    assert_diverged(without)
    only_pp = run_world(
        world_config(pp=2, sync="legacy", enable_fixes=("pp_relay", "agree_loads")), tmp_path / "pp", verbose=False
    )
    assert_consistent(only_pp)


def test_host_pools_sized_in_bytes_agree_on_the_smallest(world_config, tmp_path):
    """3 layers over 2 stages (1 + 2, as SGLang's get_pp_indices): --hicache-size in bytes fits twice the tokens
    on stage 0."""

    def host_free_at_start(**fixes):
        cfg = world_config(pp=2, **fixes)
        cfg.cache.hicache_size_gb = 0.0004
        cfg.workload.num_rounds = 1
        out = tmp_path / ("min" if not fixes else "own")
        run_world(cfg, out, verbose=False)
        return {row["rank"]: row["host_free"] for row in read_trace(out) if row["step"] == 0}

    assert host_free_at_start() == {0: 390, 1: 390}
    assert host_free_at_start(disable_fixes=("host_capacity_min",)) == {0: 781, 1: 390}


def test_a_failing_rank_brings_the_world_down_in_seconds(world_config, tmp_path):
    cfg = world_config(pp=2, sync="legacy", collective_timeout_s=60)
    summary = run_world(cfg, tmp_path, verbose=False)
    assert summary["crashed"] and summary["failing_rank"] is not None
    assert summary["elapsed_s"] < cfg.parallel.collective_timeout_s, "the others were stopped, not timed out"


@pytest.mark.parametrize("pp", [2, 3])
def test_relay_sends_are_drained_every_step_and_grow_without_the_fix(world_config, tmp_path, pp):
    """#28916: the previous step's relay sends are waited for at every check, so a stage holds only the current
    step's (never one of an earlier step), even with no round barrier; reaped by polling instead (#28902), gloo
    frees none and they grow every step. The summary says the same."""
    rows, summaries = {}, {}
    for name, disabled in (("fixed", ()), ("polled", ("bounded_drain",))):
        cfg = world_config(pp=pp, disable_fixes=disabled)
        cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, round_barrier=False))
        summaries[name] = run_world(cfg, tmp_path / name, verbose=False)
        assert summaries[name]["completed"], summaries[name]["error"]
        rows[name] = [row for row in read_trace(tmp_path / name) if row["rank"] == 0]
    fixed, polled = rows["fixed"], rows["polled"]
    assert all(r["relay_sends"] <= r["relay_sent"] for r in fixed) and max(r["relay_sends"] for r in fixed) >= 1
    assert summaries["fixed"]["scheduling"]["max_older_relay_sends"] == 0
    held = [r["relay_sends"] for r in polled]
    assert held == list(itertools.accumulate(r["relay_sent"] for r in polled))  # every send still held
    assert held[-1] >= len(polled)  # at least one per step
    assert summaries["polled"]["scheduling"]["max_older_relay_sends"] == held[-1] - polled[-1]["relay_sent"]


@pytest.mark.spawns
def test_released_sync_relays_once_a_step_and_the_allocation_vote_adds_sends(world_config, tmp_path):
    """`--sync fixed` is 0.5.23: stage 0 relays one agreement a step (SGLang's `_pp_sync` of the step's
    tensor); `alloc_agreement` (#31425, open) relays each copy's allocation verdict on top (SYNC.md's counts)."""
    sent = {}
    for name, fixes in (("released", ()), ("proposal", ("alloc_agreement",))):
        cfg = world_config(pp=2, enable_fixes=fixes)
        cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, num_rounds=3))
        summary = run_world(cfg, tmp_path / name, verbose=False)
        assert summary["completed"] and not summary["diverged"], summary["error"]
        sent[name] = [row["relay_sent"] for row in read_trace(tmp_path / name) if row["rank"] == 0]
    assert set(sent["released"]) == {1}
    assert len(sent["proposal"]) == len(sent["released"]) and max(sent["proposal"]) > 1


def test_the_step_a_signal_cut_short_is_no_divergence():
    """A rank interrupted mid-step traces that step as the signal left it (half a prefill here): only the steps
    every rank finished are compared, so an interrupted run of a right protocol never reads as diverged."""
    whole = {"step": 2, "digest": "a", "acks_write": 0, "acks_load": 0, "extend_tokens": 0, "prefix_tokens": 0}
    rows = [{**whole, "rank": 0}, {**whole, "rank": 1}, {**whole, "rank": 0, "step": 3}]
    rows.append({**whole, "rank": 1, "step": 3, "digest": "b", "extend_tokens": 96})  # cut short by SIGINT
    assert first_divergence(rows)["step"] == 3
    assert first_divergence(whole_steps(rows, cut={1})) is None
    later = [*rows, {**whole, "rank": 1, "step": 4}]  # step 3 was whole on rank 1: its divergence stands
    assert first_divergence(whole_steps(later, cut={1}))["step"] == 3
