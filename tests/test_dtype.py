"""`--dtype bfloat16`: the model, both KV pools and the storage tier hold bf16, a bf16 run's outputs still match
its reference, and a float32 run never reads a bf16 run's stored pages."""

from __future__ import annotations

import ctypes
import sys
import types

import pytest
import torch
import torch.distributed as dist

from hicache_lab.config import ModelConfig, ParallelConfig
from hicache_lab.distributed.parallel_state import RankLayout, build_groups
from hicache_lab.entrypoints.launch import run
from hicache_lab.entrypoints.rank import build_stage
from hicache_lab.errors import ConfigError
from hicache_lab.lab.presets import WORKLOAD, config
from hicache_lab.mem_cache.hicache_storage import FileStorage, MooncakeStorage, storage_suffix
from hicache_lab.mem_cache.memory_pool import DeviceKVPool
from hicache_lab.mem_cache.memory_pool_host import HostKVPool
from hicache_lab.mem_cache.radix_tree import page_hashes
from hicache_lab.model import TinyModel

SMALL = f"{WORKLOAD} --num-layers 2 --collective-timeout 30"
FILE_STORE = "--enable-hierarchical-cache --hicache-storage-backend file --flush-cache-between-rounds"
FILE_STORE += " --storage-prefetch-threshold 16"


def with_dtype(dtype: str, *flags: str):
    return config(SMALL, f"--dtype {dtype}", *flags)


def test_a_bf16_run_matches_its_reference_from_every_tier():
    summary = run(with_dtype("bfloat16", "--enable-hierarchical-cache --check-outputs"), verbose=False)
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
        stage = build_stage(with_dtype(dtype, "--enable-hierarchical-cache"), groups, tmp_path / dtype)
        host = stage.cache.controller.host_pool
        pools[dtype] = stage.loop.pool, host
        assert stage.loop.model.weights[0]["wq"].dtype == stage.loop.pool.kv.dtype == host.kv.dtype
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


def bf16_host(layout="page_first") -> HostKVPool:
    device = DeviceKVPool(16, num_layers=2, num_heads=2, head_dim=4, device="cpu", dtype=torch.bfloat16)
    host = HostKVPool(32, device, layout)
    host.kv.copy_(torch.randn_like(host.kv))
    return host


def pages(count, page_size=4):
    return [torch.arange(i * page_size, (i + 1) * page_size) for i in range(count)]


def test_bf16_pages_round_trip_exactly_through_the_file_store(tmp_path):
    host, store = bf16_host(), FileStorage(tmp_path, "s")
    hashes = page_hashes(tuple(range(12)), 4)
    assert store.batch_set(hashes, host, pages(3)) == 3
    assert store.batch_get(hashes, host, [p + 16 for p in pages(3)]) == 3
    for src in pages(3):
        assert torch.equal(host.page_data(src), host.page_data(src + 16))


def test_a_float32_pool_reads_a_bf16_page_as_a_miss_not_as_data(tmp_path):
    """Under their own keys the two dtypes never meet; a bf16 page under a float32 key is still a miss."""
    suffix = {d: storage_suffix(ModelConfig(dtype=d), 0, 1, range(0, 2)) for d in ("float32", "bfloat16")}
    assert suffix["float32"] != suffix["bfloat16"]
    hashes = page_hashes(tuple(range(8)), 4)
    FileStorage(tmp_path, suffix["bfloat16"]).batch_set(hashes, bf16_host(), pages(2))
    device32 = DeviceKVPool(16, num_layers=2, num_heads=2, head_dim=4, device="cpu")
    host32 = HostKVPool(32, device32, "page_first")
    store32 = FileStorage(tmp_path, suffix["float32"])
    assert store32.batch_exists(hashes) == 0 and store32.batch_get(hashes, host32, pages(2)) == 0
    for path in tmp_path.glob(f"*_{suffix['bfloat16']}.bin"):  # the same bytes under the float32 keys
        path.rename(path.with_name(path.name.replace(suffix["bfloat16"], suffix["float32"])))
    assert store32.batch_exists(hashes) == 2, "the files are there"
    assert store32.batch_get(hashes, host32, pages(2)) == 0, "and half a page's bytes are a miss"
    assert not host32.kv.any(), "nothing written"


def test_a_float32_run_beside_a_bf16_run_on_one_store_keeps_to_its_own_pages(tmp_path):
    """The bf16 run fills the store first. The float32 run on it writes its pages under other names (the bf16
    pages stay byte for byte), and hits and answers exactly as on an empty store."""
    store = tmp_path / "store"
    bf16 = run(with_dtype("bfloat16", FILE_STORE, f"--hicache-storage-dir {store}"), verbose=False)
    assert sum(r["cached_storage"] for r in bf16["rounds"]) > 0, "the bf16 run must have stored and read pages"
    bf16_pages = {path.name: path.read_bytes() for path in store.iterdir()}
    shared = run(with_dtype("float32", FILE_STORE, f"--hicache-storage-dir {store}", "--check-outputs"), verbose=False)
    alone = run(with_dtype("float32", FILE_STORE, f"--hicache-storage-dir {tmp_path / 'empty'}"), verbose=False)
    assert shared["oracle"]["ok"], shared["oracle"]
    assert {path.name: path.read_bytes() for path in store.iterdir() if path.name in bf16_pages} == bf16_pages
    assert len(list(store.iterdir())) == 2 * len(bf16_pages), "each run its own key set"
    tiers = ("cached_device", "cached_host", "cached_storage")
    assert [[r[t] for t in tiers] for r in shared["rounds"]] == [[r[t] for t in tiers] for r in alone["rounds"]]


class FakeMooncakeStore:
    """Mooncake's store in one process: puts copy registered bytes out by address, gets copy them back."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    def setup(self, *args) -> int:
        return 0

    def register_buffer(self, address: int, size: int) -> int:
        return 0

    def batch_put_from(self, keys, addresses, sizes) -> list[int]:
        self.objects |= {k: ctypes.string_at(a, n) for k, a, n in zip(keys, addresses, sizes, strict=True)}
        return [0] * len(keys)

    def batch_get_into(self, keys, addresses, sizes) -> list[int]:
        for key, address, size in zip(keys, addresses, sizes, strict=True):
            ctypes.memmove(address, self.objects[key], size)
        return [len(self.objects[k]) for k in keys]


def test_bf16_pages_round_trip_exactly_through_mooncake_staging(monkeypatch):
    module = types.SimpleNamespace(MooncakeDistributedStore=FakeMooncakeStore)
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.store", module)
    host = bf16_host()
    store = MooncakeStorage("127.0.0.1:1", "http://127.0.0.1:2/metadata", "s", host.bytes_per_token * 4, batch_pages=2)
    hashes = page_hashes(tuple(range(12)), 4)
    assert store.batch_set(hashes, host, pages(3)) == 3  # two staging batches
    assert store.batch_get(hashes, host, [p + 16 for p in pages(3)]) == 3
    for src in pages(3):
        assert torch.equal(host.page_data(src), host.page_data(src + 16))


def test_bf16_weights_are_the_float32_weights_rounded():
    fp32, bf16 = (TinyModel(ModelConfig(dtype=d), "cpu") for d in ("float32", "bfloat16"))
    for name, weight in fp32.weights[0].items():
        assert torch.equal(weight.to(torch.bfloat16), bf16.weights[0][name]), name
    assert torch.equal(fp32.lm_head, bf16.lm_head), "lm_head stays float32"
