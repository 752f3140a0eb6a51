"""SGLang 0.5.23's own cache in the lab's worlds (`run --cache-impl sglang`): its own agreement across real
ranks. Released, it completes with exact outputs; with the PP and CP fixes reverted in its own objects (`--sync
legacy`), it diverges on the same seed. (`compare` against the lab's cache: test_sglang_compare.py.) Needs
sglang 0.5.23 (make installs it); skipped with the reason where it is missing.
"""

from __future__ import annotations

import dataclasses

import pytest

from hicache_lab.distributed.parallel_state import stage_layers
from hicache_lab.errors import ConfigError
from hicache_lab.lab.binders import run
from hicache_lab.lab.presets import WORLD, config
from hicache_lab.lab.sglang import reverts
from hicache_lab.lab.sglang.binder import SGLANG_CACHE, refusals
from hicache_lab.lab.sglang.cache import sglang_modules
from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, sglang_version

pytestmark = pytest.mark.skipif(
    sglang_version() != SGLANG_VERSION,
    reason=f"sglang {SGLANG_VERSION} is not installed (make installs it; see requirements-sglang-cpu.txt)",
)
SGLANG = "--cache-impl sglang"
L3 = "--hicache-storage-backend file --flush-cache-between-rounds --storage-prefetch-threshold 16"


def test_what_sglangs_cache_cannot_run_is_refused_before_any_rank_starts():
    for flags, words in (
        ("--device cuda", "--device cuda"),
        ("--sync off", "SGLang always agrees"),
        ("--hicache-storage-backend mooncake", "file backend only"),
        ("--pp 2 --fault kill-rank:0@3", "--fault"),
        ("--disable-fix alloc_agreement", "no site for it to revert"),
        ("--record-cache-ops", "use `compare`"),
        ("--load-back-threshold 20", "fixed at 10"),
        ("--storage-prefetch-timeout-steps 9", "waits in seconds"),
    ):
        cfg = config(WORLD, SGLANG, flags)
        assert any(words in reason for reason in refusals(cfg)), flags
        with pytest.raises(ConfigError, match="--cache-impl sglang cannot run this"):
            SGLANG_CACHE.check(cfg)
    assert refusals(config(WORLD, SGLANG, "--pp 2 --sync legacy")) == []


def test_a_revert_refuses_a_function_that_no_longer_holds_the_lines_it_undoes():
    revert = reverts.REVERTS[0]
    assert revert.target()[1] is not None  # 0.5.23 holds them
    moved = dataclasses.replace(revert, holds=("a line no release has",))
    with pytest.raises(RuntimeError, match="no longer holds"):
        moved.target()
    assert {r.fix for r in reverts.reverts_for(frozenset())} == {
        "pp_relay",
        "cp_groups",
        "prefetch_groups",
        "agree_loads",
        "bounded_drain",
    }
    assert "UnifiedRadixCache._all_reduce (#27285 undone)" in reverts.described(reverts.REVERTS)
    assert reverts.reverts_for(config(WORLD).parallel.fixes) == []


def test_stage_layers_split_a_model_as_sglangs_get_pp_indices():
    sglang_modules()
    from sglang.srt.distributed.utils import get_pp_indices

    for layers in range(1, 9):
        for pp in range(1, layers + 1):
            ours = [stage_layers(layers, pp, rank) for rank in range(pp)]
            assert [(r.start, r.stop) for r in ours] == [get_pp_indices(layers, rank, pp) for rank in range(pp)]


def test_a_one_rank_legacy_run_reverts_its_own_cache_only(tmp_path):
    """A one-rank run shares the caller's process: the reverts live in that run's objects, the classes stay."""
    summary = run(config(WORLD, SGLANG, "--sync legacy"), tmp_path, verbose=False)
    assert summary["completed"]
    for revert in reverts.REVERTS:
        owner, function = revert.target()  # still 0.5.23's own, holding the lines the revert undoes
        assert function is not revert.replacement


@pytest.mark.spawns
def test_sglangs_cache_on_pp2_released_is_exact_and_reverted_diverges(tmp_path):
    fixed = run(config(WORLD, SGLANG, "--pp 2"), tmp_path / "fixed", verbose=False)
    assert fixed["completed"] and not fixed["diverged"] and fixed["outputs_match_reference"] is True
    legacy = run(config(WORLD, SGLANG, "--pp 2 --sync legacy"), tmp_path / "legacy", verbose=False)
    assert legacy["diverged"] and legacy["first_divergence"]["quantity"] == "acks_write"
    assert legacy["crashed"]


@pytest.mark.spawns
def test_sglangs_cache_on_cp2_with_a_file_store_reads_it_and_reverted_diverges(tmp_path):
    fixed = run(config(WORLD, SGLANG, "--cp 2 --num-rounds 2", L3), tmp_path / "fixed", verbose=False)
    assert fixed["completed"] and fixed["outputs_match_reference"] is True
    assert sum(r["cached_storage"] for r in fixed["rounds"]) > 0
    legacy = run(config(WORLD, SGLANG, "--cp 2 --num-rounds 2 --sync legacy", L3), tmp_path / "legacy", verbose=False)
    assert legacy["diverged"]
