"""`--dtype bfloat16`: the model, both KV pools and the storage tier hold bf16, a bf16 run's outputs still match
its reference, and a float32 run never reads a bf16 run's stored pages."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hicache_lab.config import ModelConfig
from hicache_lab.distributed.parallel_state import RankLayout, build_groups
from hicache_lab.entrypoints.launch import run_world
from hicache_lab.entrypoints.rank import build_rank
from hicache_lab.errors import ConfigError
from hicache_lab.lab.presets import WORKLOAD, config
from hicache_lab.model import TinyModel
from hicache_lab.parallel_config import ParallelConfig

SMALL = f"{WORKLOAD} --num-layers 2 --collective-timeout 30"
FILE_STORE = "--enable-hierarchical-cache --hicache-storage-backend file --flush-cache-between-rounds"
FILE_STORE += " --storage-prefetch-threshold 16"


def with_dtype(dtype: str, *flags: str):
    return config(SMALL, f"--dtype {dtype}", *flags)


def test_a_bf16_run_matches_its_reference_from_every_tier():
    summary = run_world(with_dtype("bfloat16", "--enable-hierarchical-cache --check-outputs"), verbose=False)
    assert summary["completed"], summary["error"]
    assert summary["oracle"]["ok"], summary["oracle"]
    assert summary["oracle"]["logit_atol"] == 0.25, "bf16's tolerance, not fp32's"
    assert sum(r["cached_host"] for r in summary["rounds"]) > 0, "the workload must exercise load-back"


@pytest.fixture
def world_of_one():
    """The process groups of a world of one, for this test only (conftest's `groups` lives for a module, and a
    `run` cannot start beside it)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield build_groups(RankLayout(1, 1, 1, 0), ParallelConfig())
    finally:
        dist.destroy_process_group()


def test_a_bf16_run_holds_bf16_kv_at_half_the_bytes_per_token(world_of_one, tmp_path):
    groups, pools = world_of_one, {}
    for dtype in ("float32", "bfloat16"):
        built = build_rank(with_dtype(dtype, "--enable-hierarchical-cache"), groups, tmp_path / dtype)
        host = built.cache.controller.host_pool
        pools[dtype] = built.loop.pool, host
        assert built.loop.model.weights[0]["wq"].dtype == built.loop.pool.kv.dtype == host.kv.dtype
    (device32, host32), (device16, host16) = pools["float32"], pools["bfloat16"]
    assert device16.kv.dtype == host16.kv.dtype == torch.bfloat16
    assert device16.bytes_per_token * 2 == device32.bytes_per_token == host32.bytes_per_token
    assert device16.kv.nbytes * 2 == device32.kv.nbytes and host16.kv.nbytes * 2 == host32.kv.nbytes


def test_logits_are_float32_in_bf16():
    model = TinyModel(ModelConfig(dtype="bfloat16"), "cpu")
    hidden = model.embed(torch.tensor([1, 2, 3]))
    assert hidden.dtype == torch.bfloat16 and model.logits(hidden).dtype == torch.float32


def test_an_unknown_dtype_names_the_flag():
    with pytest.raises(ConfigError, match="--dtype"):
        ModelConfig(dtype="float16")
    with pytest.raises(ConfigError, match="--check-outputs.*--tp"):
        with_dtype("bfloat16", "--tp 2 --check-outputs")


def test_a_float32_run_beside_a_bf16_run_on_one_store_keeps_to_its_own_pages(tmp_path):
    """The bf16 run fills the store first. The float32 run on it writes its pages under other names (the bf16
    pages stay byte for byte), and hits and answers exactly as on an empty store."""
    store = tmp_path / "store"
    bf16 = run_world(with_dtype("bfloat16", FILE_STORE, f"--hicache-storage-dir {store}"), verbose=False)
    assert sum(r["cached_storage"] for r in bf16["rounds"]) > 0, "the bf16 run must have stored and read pages"
    bf16_pages = {path.name: path.read_bytes() for path in store.iterdir()}
    shared = run_world(
        with_dtype("float32", FILE_STORE, f"--hicache-storage-dir {store}", "--check-outputs"), verbose=False
    )
    alone = run_world(with_dtype("float32", FILE_STORE, f"--hicache-storage-dir {tmp_path / 'empty'}"), verbose=False)
    assert shared["oracle"]["ok"], shared["oracle"]
    assert {path.name: path.read_bytes() for path in store.iterdir() if path.name in bf16_pages} == bf16_pages
    assert len(list(store.iterdir())) == 2 * len(bf16_pages), "each run its own key set"
    tiers = ("cached_device", "cached_host", "cached_storage")
    assert [[r[t] for t in tiers] for r in shared["rounds"]] == [[r[t] for t in tiers] for r in alone["rounds"]]


def test_bf16_weights_are_the_float32_weights_rounded():
    fp32, bf16 = (TinyModel(ModelConfig(dtype=d), "cpu") for d in ("float32", "bfloat16"))
    for name, weight in fp32.weights[0].items():
        assert torch.equal(weight.to(torch.bfloat16), bf16.weights[0][name]), name
    assert torch.equal(fp32.lm_head, bf16.lm_head), "lm_head stays float32"
