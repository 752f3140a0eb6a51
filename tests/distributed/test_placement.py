"""Where ranks run on CUDA and how their compute groups talk: ranks beyond the visible GPUs share them,
round-robin (torchrun's LOCAL_RANK first); a compute group whose ranks sit on distinct GPUs uses NCCL, one where
two share a GPU uses gloo with its CUDA tensors staged through host memory (NCCL refuses two ranks on one device).
Checked here with a faked GPU count; tests/mem_cache/test_pools_and_copies.py runs such worlds on a GPU."""

from __future__ import annotations

import pytest
import torch

from hicache_lab.config import RunConfig
from hicache_lab.distributed.parallel_state import compute_backend, local_device, placement_words
from hicache_lab.parallel_config import ParallelConfig


@pytest.fixture
def gpus(monkeypatch):
    def visible(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return visible


def test_ranks_share_the_visible_gpus_round_robin_and_torchrun_places_by_local_rank(gpus, monkeypatch):
    gpus(2)
    assert [local_device(rank) for rank in range(5)] == [0, 1, 0, 1, 0]
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_device(7) == 1  # torchrun's local rank, not the world rank


def test_a_compute_group_uses_nccl_only_where_its_ranks_sit_on_distinct_gpus():
    places = [("a", 0), ("a", 1), ("a", 0), ("b", 0)]
    assert compute_backend([0, 1], places, "cuda") == "nccl"
    assert compute_backend([0, 2], places, "cuda") == "gloo"  # both on host a's GPU 0
    assert compute_backend([0, 3], places, "cuda") == "nccl"  # GPU 0 of two hosts
    assert compute_backend([0, 2], places, "cpu") == "gloo"
    assert compute_backend([0, 2], None, "cuda") == "nccl"  # no placement known: a GPU each, as before


def test_the_placement_is_said_as_a_world_starts(gpus):
    tp2pp2 = RunConfig(parallel=ParallelConfig(tp=2, pp=2), device="cuda")
    gpus(1)
    words = placement_words(tp2pp2)
    assert words.startswith("4 rank(s) on 1 GPU(s)") and "attn_tp over gloo" in words and "staged" in words
    gpus(4)
    words = placement_words(tp2pp2)
    assert "attn_tp over nccl; pp over nccl" in words and "staged" not in words
    gpus(2)  # ranks 0-3 on GPUs 0, 1, 0, 1: each TP pair spans both GPUs, each PP pair shares one
    assert "attn_tp over nccl; pp over gloo" in placement_words(
        RunConfig(parallel=ParallelConfig(tp=2, pp=2), device="cuda")
    )
    assert placement_words(RunConfig(parallel=ParallelConfig(pp=2))) is None
