"""CacheSync alone, on real gloo worlds (no cache, no model): every agreement point of SYNC.md that it holds,
fed rank-dependent values, with the fixes on and off. Each "fixed agrees" has its twin "without the fix, ranks
keep different values" on the same inputs.

Two worlds run every scenario once: `pp3` (three stages) and `tp2cp2` (world rank = cp_rank * 2 + tp_rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from hicache_lab.distributed.cache_sync import MAX, CacheSync
from hicache_lab.distributed.parallel_state import RankLayout, build_groups
from hicache_lab.entrypoints.launch import join_world, spawn_ranks
from hicache_lab.errors import ConsensusError
from hicache_lab.parallel_config import PROPOSALS, ParallelConfig

pytestmark = pytest.mark.spawns

TIMEOUT_S = 30
WORLDS = {"pp3": (1, 1, 3), "tp2cp2": (2, 2, 1)}


def _parallel(sync: str, off: tuple[str, ...] = ()) -> ParallelConfig:
    """The mode less the fixes `off`; `fixed` with the proposals on too (the allocation vote is checked here)."""
    proposals = tuple(PROPOSALS) if sync == "fixed" else ()
    return ParallelConfig(sync=sync, enable_fixes=proposals, disable_fixes=off)


def _scenarios(rank: int, groups) -> dict[str, object]:
    """What this rank ends up with in each scenario (collective: every rank runs them in the same order)."""
    local = {"write": rank + 1, "load": 10 + rank, "backup": 20 + rank}
    out = {}
    for name, mode, off in (
        ("fixed", "fixed", ()),
        ("legacy", "legacy", ()),
        ("no_multi_hop", "fixed", ("multi_hop_relay",)),
        ("no_cp_groups", "fixed", ("cp_groups",)),
        ("no_capacity_min", "fixed", ("host_capacity_min",)),
        ("no_storage_keys", "fixed", ("storage_keys",)),
        ("no_prefetch_groups", "fixed", ("prefetch_groups",)),
    ):
        sync = CacheSync(groups, _parallel(mode, off), storage=True)
        out[f"acks/{name}"] = sync.agree_ack_counts(local, in_flight=local)
        last = groups.layout.tp * groups.layout.cp * groups.layout.pp - 1
        out[f"allocated/{name}"] = sync.agree_allocation(rank != last)  # the last rank's allocation failed
        out[f"host_capacity/{name}"] = sync.agree_host_capacity(100 * (rank + 1))
        out[f"storage_key/{name}"] = sync.storage_key_cp_rank()
        out[f"storage_hits/{name}"] = sync.agree_storage([7 + rank])
        out[f"not_ready/{name}"] = sync.agree_prefetch_progress(
            [int(rank == groups.layout.tp * groups.layout.cp - 1)], MAX
        )
        out[f"pages/{name}"] = sync.agree_prefetch_progress([5 + rank])
        sync.finish()
    for name, off in (("bounded", ()), ("polled", ("bounded_drain",))):
        sync = CacheSync(groups, _parallel("fixed", off))
        for _ in range(3):
            sync.agree_ack_counts(local, in_flight=local)
        held = len(sync.work_list)
        sync.drain_async_work()
        out[f"drain/{name}"] = [held, len(sync.work_list)]
        sync.finish()
    if groups.layout.tp > 1:
        out.update(_early_return(rank, groups))
    for name, values in (("equal", {"acks_write": 4, "digest": 99}), ("differ", {"acks_write": 4, "digest": rank})):
        try:
            CacheSync.check_consensus(7, values)
            out[f"consensus/{name}"] = "agree"
        except ConsensusError as exc:
            out[f"consensus/{name}"] = str(exc)
    return out


def _early_return(rank: int, groups) -> dict[str, list]:
    """Rank 0 has nothing in flight. With `always_agree` every rank enters the agreement; without it rank 0
    returns early (SGLang 0.5.10-0.5.13), and its next agreement (here, with 1 write finished) meets the one its
    attention-TP peer (2 writes) is waiting in: rank 1 consumes the MIN with rank 0's next step (#26921, #28429;
    in the scheduler loop, a deadlock)."""
    out = {}
    for name, on in (("kept", ("always_agree",)), ("dropped", ())):
        sync = CacheSync(groups, ParallelConfig(sync="legacy", enable_fixes=on))
        calls = [{"write": 0, "load": 0}] if rank == 0 else [{"write": rank + 1, "load": 0}]
        if rank == 0 and not on:
            calls.append({"write": 1, "load": 0})
        out[f"early_return/{name}"] = [sync.agree_ack_counts(local, in_flight=local)["write"] for local in calls]
        sync.finish()
    return out


def _rank(rank: int, size: int, port: int, layout: tuple[int, int, int], out: Path) -> None:
    join_world(rank, size, port, TIMEOUT_S)
    tp, cp, pp = layout
    groups = build_groups(
        RankLayout(tp, cp, pp, rank), ParallelConfig(tp=tp, cp=cp, pp=pp, collective_timeout_s=TIMEOUT_S)
    )
    (out / f"rank{rank}.json").write_text(json.dumps(_scenarios(rank, groups)))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request, tmp_path_factory) -> tuple[str, dict[str, list]]:
    """(world name, {scenario: [what rank 0 got, what rank 1 got, ...]})."""
    tp, cp, pp = WORLDS[request.param]
    size, out = tp * cp * pp, tmp_path_factory.mktemp(request.param)
    codes = spawn_ranks(_rank, size, ((tp, cp, pp), out), TIMEOUT_S * 3)
    assert codes == [0] * size, f"a rank failed: exit codes {codes}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(size)]
    return request.param, {key: [r[key] for r in ranks] for key in ranks[0]}


def _writes(values: list[dict]) -> list[int]:
    return [v["write"] for v in values]


def test_ack_counts_agree_with_every_fix_and_part_without_one(world):
    name, got = world
    if name == "pp3":  # stage 0 counts; the count is relayed to every stage
        assert got["acks/fixed"] == [{"write": 1, "load": 10, "backup": 20}] * 3
        assert _writes(got["acks/legacy"]) == [1, 2, 3]  # each stage its own poll (#22607)
        assert _writes(got["acks/no_multi_hop"]) == [1, 1, 3]  # the relay reaches stage 1 only (#22878)
    else:  # MIN over attention-CP, then attention-TP: one value for the stage
        assert got["acks/fixed"] == [{"write": 1, "load": 10, "backup": 20}] * 4
        assert _writes(got["acks/no_cp_groups"]) == [1, 1, 3, 3]  # attention-TP alone: CP peers part (#20460)
        assert [v["load"] for v in got["acks/legacy"]] == [10, 11, 12, 13]  # legacy does not agree on loads


def test_host_capacity_is_the_world_minimum_only_with_the_fix(world):
    _, got = world
    size = len(got["host_capacity/fixed"])
    assert got["host_capacity/fixed"] == [100] * size
    assert got["host_capacity/no_capacity_min"] == [100 * (r + 1) for r in range(size)]  # #29258


def test_storage_keys_leave_the_cp_rank_out_only_with_the_fix(world):
    name, got = world
    size = len(got["storage_key/fixed"])
    assert got["storage_key/fixed"] == [None] * size
    assert got["storage_key/no_storage_keys"] == ([0, 0, 1, 1] if name == "tp2cp2" else [0, 0, 0])


def test_storage_hits_agree_over_the_prefetch_groups(world):
    name, got = world
    size = len(got["storage_hits/fixed"])
    assert got["storage_hits/fixed"] == [[7]] * size  # across CP, TP and (on the prefetch thread) PP
    without = got["storage_hits/no_prefetch_groups"]
    assert without == ([[7], [7], [9], [9]] if name == "tp2cp2" else [[7], [8], [9]])


def test_prefetch_progress_is_agreed_on_stage_0_and_relayed(world):
    name, got = world
    size = len(got["pages/fixed"])
    assert got["pages/fixed"] == [[5]] * size and got["not_ready/fixed"] == [[1]] * size
    if name == "pp3":
        assert got["pages/legacy"] == [[5], [6], [7]]  # no relay: each stage its own count
    else:
        assert got["not_ready/no_prefetch_groups"] == [[0], [0], [1], [1]]  # CP peers decide alone


def test_relay_sends_are_bounded_by_the_drain_and_grow_when_polled(world):
    name, got = world
    if name != "pp3":
        assert got["drain/bounded"] == [[0, 0]] * 4  # no pipeline: nothing is relayed
        return
    assert got["drain/bounded"][:2] == [[3, 0], [3, 0]]  # stages 0 and 1 send: drained
    assert got["drain/polled"][:2] == [[3, 3], [3, 3]]  # gloo's is_completed() stays False: never reaped (#28902)


def test_consensus_check_passes_equal_values_and_names_the_first_that_differs(world):
    _, got = world
    size = len(got["consensus/equal"])
    assert got["consensus/equal"] == ["agree"] * size
    assert got["consensus/differ"] == [f"ranks disagree on digest at step 7: min 0, max {size - 1}"] * size


def test_allocation_succeeds_everywhere_or_nowhere_only_with_the_fix(world):
    name, got = world
    if name == "pp3":  # stage 0 decides, later stages take its verdict (stage 2 then retries its own allocation)
        assert got["allocated/fixed"] == [True] * 3
        assert got["allocated/legacy"] == [True, True, False]  # each rank its own outcome (#28429)
    else:  # rank 3 failed: its CP peer (rank 1), then both attention-TP groups abort
        assert got["allocated/fixed"] == [False] * 4
        assert got["allocated/no_cp_groups"] == [True, True, False, False]
        assert got["allocated/legacy"] == [True, True, True, False]


def test_every_rank_enters_the_agreement_even_with_nothing_in_flight(world):
    name, got = world
    if name != "tp2cp2":
        return  # attention-TP groups of one rank: nothing to enter
    assert got["early_return/kept"] == [[0], [0], [3], [3]]  # the MIN of this step, on both peers
    assert got["early_return/dropped"] == [[0, 1], [1], [3], [3]]  # rank 1 met rank 0's next step
