"""The file backend: exact round trips, leading-page semantics, and damaged, misnamed or special files read as
misses."""

from __future__ import annotations

import os
import shutil

import torch

from hicache_lab.config import ModelConfig
from hicache_lab.mem_cache.hicache_storage import FileStorage, model_fingerprint, storage_suffix
from hicache_lab.mem_cache.memory_pool import DeviceKVPool
from hicache_lab.mem_cache.memory_pool_host import HostKVPool
from hicache_lab.mem_cache.utils import page_hashes


def host_pool(layout="layer_first", dtype=torch.float32):
    device = DeviceKVPool(16, num_layers=2, num_heads=2, head_dim=4, device="cpu", dtype=dtype)
    host = HostKVPool(32, device, layout)
    host.kv.copy_(torch.randn_like(host.kv))
    return host


def pages(count, page_size=4):
    return [torch.arange(i * page_size, (i + 1) * page_size) for i in range(count)]


def test_pages_round_trip_exactly_into_other_slots(tmp_path):
    host = host_pool("page_first")
    store = FileStorage(tmp_path, "s")
    hashes = page_hashes(tuple(range(12)), 4)
    assert store.batch_set(hashes, host, pages(3)) == 3
    elsewhere = [p + 16 for p in pages(3)]
    assert store.batch_get(hashes, host, elsewhere) == 3
    for src, dst in zip(pages(3), elsewhere, strict=True):
        assert torch.equal(host.page_data(src), host.page_data(dst))


def test_exists_counts_only_the_leading_run(tmp_path):
    host, store = host_pool(), FileStorage(tmp_path, "s")
    hashes = page_hashes(tuple(range(16)), 4)
    store.batch_set([hashes[0], hashes[1], hashes[3]], host, pages(3))
    assert store.batch_exists(hashes) == 2


def test_damaged_files_are_misses_not_data(tmp_path):
    host, store = host_pool(), FileStorage(tmp_path, "s")
    hashes = page_hashes(tuple(range(12)), 4)
    store.batch_set(hashes, host, pages(3))
    before = host.page_data(torch.arange(20, 24)).clone()
    (tmp_path / f"{hashes[1]}_s.bin").write_bytes(b"HCLP2" + b"\0" * 40)  # truncated
    assert store.batch_get(hashes, host, [p + 16 for p in pages(3)]) == 1
    assert torch.equal(host.page_data(torch.arange(20, 24)), before), "nothing written past the damage"
    path = tmp_path / f"{hashes[0]}_s.bin"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # one flipped byte
    path.write_bytes(bytes(raw))
    assert store.batch_get(hashes, host, [p + 16 for p in pages(3)]) == 0
    assert store.stats["corrupted"] == 2


def test_keys_name_model_shard_and_stage_but_not_the_cp_rank():
    model = ModelConfig()
    fixed = storage_suffix(model, tp_rank=1, tp=2, heads=range(2, 4), layers=range(0, 2))
    assert fixed == f"m{model_fingerprint(model)}_tp1of2_h2-4_L0-2"
    assert storage_suffix(model, 1, 2, range(2, 4), range(0, 2), cp_rank=1).endswith("_cp1")
    assert storage_suffix(model, 1, 2, range(2, 4), range(2, 4)) != fixed
    # CP rank 1 of `--cp 2` writes under the global TP rank 1 of 2 too, holding every head: another page
    assert storage_suffix(model, 1, 2, range(0, 4), range(0, 2)) != fixed


def test_every_field_that_changes_the_bytes_changes_the_key():
    base = model_fingerprint(ModelConfig())
    for change in ({"mlp_size": 64}, {"seed": 1}, {"rope_theta": 500.0}, {"num_layers": 2}, {"vocab_size": 128}):
        assert model_fingerprint(ModelConfig(**change)) != base, change
    assert model_fingerprint(ModelConfig()) == base, "the same model keeps its keys"


def test_a_valid_page_under_another_pages_name_is_a_miss(tmp_path):
    host, store = host_pool(), FileStorage(tmp_path, "s")
    hashes = page_hashes(tuple(range(8)), 4)
    store.batch_set(hashes, host, pages(2))
    shutil.copy(tmp_path / f"{hashes[0]}_s.bin", tmp_path / f"{hashes[1]}_s.bin")  # intact bytes, wrong key
    assert store.batch_get(hashes, host, [p + 16 for p in pages(2)]) == 1
    assert store.stats["corrupted"] == 1


def test_a_fifo_under_a_pages_name_is_a_miss_not_a_blocking_read(tmp_path):
    host, store = host_pool(), FileStorage(tmp_path, "s")
    hashes = page_hashes(tuple(range(8)), 4)
    store.batch_set(hashes[:1], host, pages(1))
    os.mkfifo(tmp_path / f"{hashes[1]}_s.bin")  # nobody ever writes to it: a blocking open would wait forever
    assert store.batch_get(hashes, host, [p + 16 for p in pages(2)]) == 1


def test_bf16_pages_round_trip_exactly_through_the_file_store(tmp_path):
    host, store = host_pool("page_first", torch.bfloat16), FileStorage(tmp_path, "s")
    hashes = page_hashes(tuple(range(12)), 4)
    assert store.batch_set(hashes, host, pages(3)) == 3
    assert store.batch_get(hashes, host, [p + 16 for p in pages(3)]) == 3
    for src in pages(3):
        assert torch.equal(host.page_data(src), host.page_data(src + 16))


def test_a_float32_pool_reads_a_bf16_page_as_a_miss_not_as_data(tmp_path):
    """Under their own keys the two dtypes never meet; a bf16 page under a float32 key is still a miss."""
    suffix = {d: storage_suffix(ModelConfig(dtype=d), 0, 1, range(0, 4), range(0, 2)) for d in ("float32", "bfloat16")}
    assert suffix["float32"] != suffix["bfloat16"]
    hashes = page_hashes(tuple(range(8)), 4)
    FileStorage(tmp_path, suffix["bfloat16"]).batch_set(hashes, host_pool("page_first", torch.bfloat16), pages(2))
    host32 = host_pool("page_first")
    host32.kv.zero_()
    store32 = FileStorage(tmp_path, suffix["float32"])
    assert store32.batch_exists(hashes) == 0 and store32.batch_get(hashes, host32, pages(2)) == 0
    for path in tmp_path.glob(f"*_{suffix['bfloat16']}.bin"):  # the same bytes under the float32 keys
        path.rename(path.with_name(path.name.replace(suffix["bfloat16"], suffix["float32"])))
    assert store32.batch_exists(hashes) == 2, "the files are there"
    assert store32.batch_get(hashes, host32, pages(2)) == 0, "and half a page's bytes are a miss"
    assert not host32.kv.any(), "nothing written"


def test_a_directory_under_a_pages_name_costs_that_page_and_no_file_descriptor(tmp_path):
    host, store = host_pool(), FileStorage(tmp_path, "s")
    hashes = page_hashes(tuple(range(12)), 4)
    store.batch_set(hashes, host, pages(3))
    (tmp_path / f"{hashes[1]}_s.bin").unlink()
    (tmp_path / f"{hashes[1]}_s.bin").mkdir()
    for _ in range(50):
        assert store.batch_get(hashes, host, pages(3)) == 1  # the page before it arrives; the rest is a miss
    assert not _open_in(tmp_path)  # not a count of every descriptor: the process's other threads open and close some
    assert store.stats["corrupted"] == 50


def _open_in(directory) -> list[str]:
    """What this process holds open under `directory`."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(str(directory)):
            held.append(target)
    return held


def test_a_store_this_process_cannot_write_is_read_and_never_written(tmp_path, monkeypatch):
    """A pre-filled store shared read-only (a read-only mount; here os.access says so, as it would for root
    there): its pages are read, and a backup writes nothing rather than failing page by page."""
    host = host_pool()
    hashes = page_hashes(tuple(range(12)), 4)
    FileStorage(tmp_path, "s").batch_set(hashes[:2], host, pages(2))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    shared = FileStorage(tmp_path, "s")
    assert shared.read_only and shared.batch_get(hashes, host, pages(3)) == 2
    assert shared.batch_set(hashes[2:], host, pages(1)) == 0 and shared.batch_exists(hashes) == 2
    shared.clear()
    assert shared.batch_exists(hashes) == 2
