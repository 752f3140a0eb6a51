"""L3: pages backed up to the file store come back through prefetch, and the CP fixes decide whether CP
peers find each other's pages and agree on what they fetched."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hicache_lab.config import CacheConfig
from hicache_lab.distributed.cache_sync import CacheSync
from hicache_lab.entrypoints.launch import run_world
from hicache_lab.entrypoints.report import storage_hit_rate as storage_hit
from hicache_lab.lab.presets import TIER_CACHES, tier_config
from hicache_lab.mem_cache.build import KVShape, build_cache
from hicache_lab.mem_cache.hicache_storage import FileStorage
from hicache_lab.mem_cache.tree_node import node_hashes
from hicache_lab.parallel_config import ParallelConfig


def storage_world(world_config, **parallel):
    """The small world with a run-local file store, caches flushed between rounds: later hits come from L3."""
    cfg = world_config(**parallel)
    cache = dataclasses.replace(
        cfg.cache, storage_backend="file", prefetch_policy="wait_complete", prefetch_threshold=16
    )
    return dataclasses.replace(cfg, cache=dataclasses.replace(cache, flush_between_rounds=True))


@pytest.fixture(scope="module")
def single_rank_storage_hit(world_config, tmp_path_factory):
    summary = run_world(storage_world(world_config), tmp_path_factory.mktemp("one"), verbose=False)
    assert summary["completed"] and summary["outputs_match_reference"], summary["error"]
    return storage_hit(summary)


def test_flushed_caches_hit_from_storage_with_exact_outputs(single_rank_storage_hit):
    assert single_rank_storage_hit > 0.6  # every later round finds its whole history in storage


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_every_prefetch_policy_keeps_outputs_exact(world_config, tmp_path, policy):
    cfg = storage_world(world_config)
    cfg.cache.prefetch_policy = policy
    summary = run_world(cfg, tmp_path, verbose=False)
    assert summary["completed"] and summary["outputs_match_reference"], summary["error"]


@pytest.mark.spawns
def test_cp_peers_with_fixed_keys_hit_like_one_rank(world_config, tmp_path, single_rank_storage_hit):
    summary = run_world(storage_world(world_config, cp=2), tmp_path, verbose=False)
    assert summary["completed"] and not summary["diverged"] and summary["outputs_match_reference"]
    assert storage_hit(summary) == pytest.approx(single_rank_storage_hit)


@pytest.mark.spawns
def test_cp_rank_in_storage_keys_collapses_the_hit_rate_only_with_one_writer(world_config, tmp_path):
    """With one writer per CP group (CP rank 0) the peer looks for keys nobody wrote: the MIN of hits is 0. With
    every rank writing its own copy (SGLang's MHA keys) the CP rank in the key changes nothing."""
    hits = {}
    for writers in ("one", "every-rank"):
        cfg = storage_world(world_config, cp=2, disable_fixes=("storage_keys",))
        cfg.cache.storage_writers = writers
        summary = run_world(cfg, tmp_path / writers, verbose=False)
        assert summary["completed"] and not summary["diverged"]
        hits[writers] = storage_hit(summary)
    assert hits["one"] == 0.0 and hits["every-rank"] > 0.5


@pytest.mark.spawns
def test_legacy_cp_storage_sync_diverges(world_config, tmp_path):
    summary = run_world(storage_world(world_config, cp=2, sync="legacy"), tmp_path, verbose=False)
    assert summary["diverged"]


@pytest.mark.spawns
def test_real_prefetch_and_backup_threads_keep_cp_peers_together(world_config, tmp_path, single_rank_storage_hit):
    cfg = storage_world(world_config, cp=2)
    cfg.cache.latency = "real"  # a backup thread and a prefetch thread per rank, agreeing on their own groups
    summary = run_world(cfg, tmp_path, verbose=False)
    assert summary["completed"] and not summary["diverged"] and summary["outputs_match_reference"]
    # wait_complete: what storage holds all arrives; with real threads a backup still in flight when the next
    # round looks is a (rare) miss, so the rate may fall a little short of the virtual single rank's
    assert storage_hit(summary) == pytest.approx(single_rank_storage_hit, rel=0.05)


@pytest.mark.spawns
def test_a_wall_clock_timeout_decided_by_pp_rank_0_keeps_the_stages_together(world_config, tmp_path):
    """`timeout` under real latency counts wall time (SGLang 0.5.23: 1 s + 0.25 s per Ki tokens): the stages'
    clocks differ, so PP rank 0 decides and relays; both stages cut the same prefetches short, take the same
    pages and agree to the end. Which deadline both cuts prefetches short and lets pages arrive depends on the
    machine's load (10 ms does on an idle laptop; on a loaded one no batch arrives in 10 ms), so deadlines from
    10 ms up are tried until one does, and every run on the way must agree."""
    for deadline_s in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0):
        cfg = storage_world(world_config, pp=2)
        cfg.cache.latency, cfg.cache.prefetch_policy = "real", "timeout"
        cfg.cache.prefetch_timeout_base_s, cfg.cache.prefetch_timeout_per_ki_token_s = deadline_s, 0.0
        out = tmp_path / f"{deadline_s:g}s"
        summary = run_world(cfg, out, verbose=False)
        assert summary["completed"] and not summary["diverged"] and summary["outputs_match_reference"], summary["error"]
        storage = [json.loads((out / f"rank{r}.json").read_text())["storage"] for r in (0, 1)]
        taken = [(s["cut_short"], s["pages_prefetched"]) for s in storage]
        assert taken[0] == taken[1], f"deadline {deadline_s:g} s: the stages cut and took (prefetches, pages) {taken}"
        if min(taken[0]) > 0:
            return
    pytest.fail(f"no deadline from 10 ms to 3 s both cut a prefetch short and took a page: {taken}")


def test_write_back_backs_evicted_nodes_up_to_storage(world_config, tmp_path):
    """write_back copies a node to the host only when the device evicts it; that copy then goes to storage too
    (SGLang's `_evict_write_back` -> `write_backup_storage`), so a flushed cache finds pages there."""
    cfg = storage_world(world_config)
    cfg.cache.write_policy = "write_back"
    summary = run_world(cfg, tmp_path, verbose=False)
    assert summary["completed"] and summary["outputs_match_reference"], summary["error"]
    assert json.loads((tmp_path / "rank0.json").read_text())["storage"]["pages_backed_up"] > 0
    assert sum(r["cached_storage"] for r in summary["rounds"] if r["round"] > 0) > 0


def test_a_prefetch_the_host_cannot_hold_is_revoked_at_once_and_its_request_keeps_its_host_prefix(tmp_path):
    """SGLang 0.5.23's `_try_alloc_storage_hit`: no host room for the threshold revokes the prefetch there, so its
    request is admitted on what the tree holds (notebook 04's round 3: 63 tokens still on the host). Kept in
    flight instead (the `alloc_agreement` proposal's way, which must keep every rank in the read's collectives),
    it waits for an empty read while the host drops that prefix."""
    found = {}
    for name, fixes in (("released", ()), ("kept in flight", ("alloc_agreement",))):
        cfg = tier_config(**TIER_CACHES["L1 + L2 + L3"])
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, enable_fixes=fixes))
        summary = run_world(cfg, tmp_path / name.replace(" ", "_"), verbose=False)
        assert summary["completed"] and summary["outputs_match_reference"] is not False, summary["error"]
        storage = json.loads((tmp_path / name.replace(" ", "_") / "rank0.json").read_text())["storage"]
        found[name] = (storage["no_host_room"], summary["rounds"][3]["cached_host"])
    assert found["released"][0] == found["kept in flight"][0] > 0  # the same prefetch finds no room
    assert found["released"][1] > found["kept in flight"][1]


def test_a_split_during_a_host_write_backs_up_both_halves(groups, tmp_path):
    """A node split while its host write is in flight: at the ack both halves go to storage (SGLang's
    publish_node_ids), so the node's leading pages are there; backing up only the lower half would leave the
    head missing and a prefetch of the whole prefix would find nothing."""
    cfg = CacheConfig(
        max_total_tokens=64,
        enable_hierarchical_cache=True,
        storage_backend="file",
        prefetch_threshold=4,
        max_copy_delay_steps=0,
    )
    sync = CacheSync(groups, ParallelConfig(), storage=True)
    backend = FileStorage(tmp_path, "test")
    _, cache = build_cache(cfg, KVShape(1, 1, 2), sync, backend=backend)
    whole = tuple(range(16))
    cache.insert(whole, cache.alloc_device(16))  # write-through: its host write is queued
    cache.flush_pending_backups()  # ... and started
    cache.insert(whole[:8] + (99,) * 8, cache.alloc_device(16))  # splits the node after 8 tokens
    for step in range(1, 4):  # the ack, then the backups
        cache.advance(step)
        cache.check_hicache_events()
    upper = cache.match_prefix(whole).last_device_node.parent
    assert len(upper.key) == 8 and upper.parent is cache.tree.root
    lower = cache.match_prefix(whole).last_device_node
    assert backend.batch_exists(node_hashes(upper, cfg.page_size) + node_hashes(lower, cfg.page_size)) == 16
    cache.close()


def test_a_write_back_that_finds_the_host_full_keeps_a_subtree_storage_still_reads(file_cache):
    """write_back, a file L3, a host held full by copies whose L3 backups are still being written: evicting the
    device leaf above one of them finds no host room for its own copy. SGLang's `drop_subtree_no_host`
    declines to drop a subtree that holds a host lock (the node stays on the device); dropping it would free host
    slots the backup is still reading, and a later host write would put other bytes under the backup's key
    (review N4)."""
    cache = file_cache(
        max_total_tokens=64,
        hicache_ratio=1.5,  # 96 host tokens: six 16-token copies
        write_policy="write_back",
        prefetch_threshold=4,
        max_copy_delay_steps=3,
    )
    head, tail = tuple(range(16)), tuple(range(100, 116))
    held = cache.alloc_device(16)
    cache.insert(head, held)
    cache.insert(head + tail, torch.cat([held, cache.alloc_device(16)]))  # a node for each
    assert cache.evict(16) == 16  # the tail: written back to the host, its L3 backup pending (never advanced)
    for i in range(5):  # five more copies fill the host, each with its backup pending
        cache.insert(tuple(range(200 + 16 * i, 216 + 16 * i)), cache.alloc_device(16))
        cache.match_prefix(head)  # the head stays the most recently used device leaf
        assert cache.evict(16) == 16
    assert cache.host_alloc.available_size() == 0
    before = cache.match_prefix(head + tail)
    assert before.host_hit_length == 16
    cache.evict(16)  # only the head is left to evict, and the host has no room for its copy
    after = cache.match_prefix(head + tail)
    assert len(after.device_indices) == 16 and after.host_hit_length == 16  # head on the device, tail on the host
    assert torch.equal(after.device_indices, before.device_indices)
    cache.close()


def test_a_finished_prefetch_ends_at_its_last_ack_before_admission(file_cache):
    """SGLang 0.5.23's `_drain_ack_prefetch`: the read thread's per-batch agreements are acks that the step's
    check drains by an agreed count; the last one ends the prefetch there (pages inserted, rate-limit share and
    anchor released), so the request, admitted later, finds it done without a vote."""
    cache = file_cache(
        max_total_tokens=64,
        prefetch_policy="wait_complete",
        prefetch_threshold=4,
        max_copy_delay_steps=0,
    )
    prompt = tuple(range(16))
    cache.insert(prompt, cache.alloc_device(16))
    cache.flush()  # the host copy went to storage; device and host are empty now
    cache.prefetch_from_storage(7, list(prompt))
    assert 7 in cache.storage.prefetches
    for step in range(1, 4):  # the hit query's answer, then the batch read and its ack
        cache.advance(step)
        cache.check_hicache_events()
    # the prompt's last token is left to compute (match_key): 15 tokens fetched, inserted at the drain, host-only
    assert 7 not in cache.storage.prefetches and cache.prefetch_loaded == {7: 15}
    assert cache.match_prefix(prompt).host_hit_length == 15
    assert cache.check_prefetch_progress(7) == 15 and not cache.prefetch_loaded  # admission: no vote
    cache.close()
