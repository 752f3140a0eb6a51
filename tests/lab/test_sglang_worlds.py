"""SGLang 0.5.23's own cache in the lab's worlds (`run --cache-impl sglang`): its own agreement across real
ranks. Released, it completes with exact outputs; with the PP and CP fixes reverted in its own objects (`--sync
legacy`), it diverges on the same seed. (`compare` against the lab's cache: test_sglang_compare.py.) Needs
sglang 0.5.23 (make installs it); skipped with the reason where it is missing.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from hicache_lab.distributed.parallel_state import stage_layers
from hicache_lab.errors import ConfigError
from hicache_lab.lab.binders import run
from hicache_lab.lab.presets import WORLD, config
from hicache_lab.lab.sglang import reverts
from hicache_lab.lab.sglang.binder import SGLANG_CACHE, refusals
from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, sglang_version
from hicache_lab.lab.sglang.modules import sglang_modules
from hicache_lab.lab.sglang.world import served_model_name

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
        "host_capacity_min",
    }
    described = reverts.described(reverts.REVERTS)
    assert "UnifiedRadixCache._all_reduce (#27285 undone)" in described
    assert "mem_cache.pool_host.base.sync_fixed_hicache_size (#29258 undone)" in described
    assert reverts.reverts_for(config(WORLD).parallel.fixes) == []


def test_stage_layers_split_a_model_as_sglangs_get_pp_indices():
    sglang_modules()
    from sglang.srt.distributed.utils import get_pp_indices

    for layers in range(1, 9):
        for pp in range(1, layers + 1):
            ours = [stage_layers(layers, pp, rank) for rank in range(pp)]
            assert [(r.start, r.stop) for r in ours] == [get_pp_indices(layers, rank, pp) for rank in range(pp)]


@pytest.mark.spawns
def test_a_one_rank_legacy_run_reverts_its_own_cache_only(tmp_path):
    """A one-rank run of SGLang's cache runs in a process of its own (launch.runs_unbounded_code): the reverts
    live in that run's objects, and the caller's classes stay 0.5.23's."""
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


def test_a_special_file_in_sglangs_store_is_refused_before_any_rank_starts(tmp_path):
    """SGLang's file backend opens a page with a blocking open(): a FIFO, a device or a socket there is refused,
    naming the file; regular files, directories and dangling links are not."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "page_m_0_1.bin").write_bytes(b"x")
    (store / "sub").mkdir()
    (store / "gone").symlink_to(tmp_path / "nowhere")
    cfg = config(WORLD, SGLANG, L3, f"--hicache-storage-dir {store}")
    SGLANG_CACHE.check(cfg)
    os.mkfifo(store / "fifo_m_0_1.bin")
    with pytest.raises(ConfigError, match=r"fifo_m_0_1.bin in --hicache-storage-dir is a FIFO .*choose another"):
        SGLANG_CACHE.check(cfg)
    os.unlink(store / "fifo_m_0_1.bin")
    (store / "zero_m_0_1.bin").symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="zero_m_0_1.bin in --hicache-storage-dir is a character device"):
        SGLANG_CACHE.check(cfg)


def test_sglangs_model_name_is_the_labs_model_identity():
    """Every model flag that changes a page's bytes changes the name SGLang's keys carry; nothing else does."""
    name = served_model_name(config(WORLD).model)
    for flags in ("--model-seed 7", "--mlp-size 64", "--vocab-size 200", "--dtype bfloat16"):
        assert served_model_name(config(WORLD, flags).model) != name, flags
    assert served_model_name(config(WORLD, "--num-clients 2 --pp 2").model) == name


@pytest.mark.spawns
def test_two_models_on_one_sglang_store_never_read_each_others_pages(tmp_path):
    """The second model finds nothing in the first's store and answers exactly; the first, run again, finds its own
    pages (wait_complete: every prefetch is waited for)."""
    store = tmp_path / "store"
    flags = (WORLD, SGLANG, L3, "--num-rounds 2 --hicache-storage-prefetch-policy wait_complete")
    flags += (f"--hicache-storage-dir {store}",)
    runs = {}
    for name, model in (("first", ""), ("other", "--model-seed 7"), ("again", "")):
        runs[name] = run(config(*flags, model), tmp_path / name, verbose=False)
        assert runs[name]["completed"] and runs[name]["outputs_match_reference"] is True, name
    assert runs["other"]["rounds"][0]["cached_storage"] == 0
    assert runs["again"]["rounds"][0]["cached_storage"] > 0
    names = {served_model_name(config(*flags, model).model).replace("/", "-") for model in ("", "--model-seed 7")}
    assert {path.stem.split("_", 1)[1].rsplit("_", 2)[0] for path in store.glob("*.bin")} == names
