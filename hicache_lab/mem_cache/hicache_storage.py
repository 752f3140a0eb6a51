"""L3 storage backends: where host pages go to outlive the host pool (and the process).

A page is stored under its key: the page's sha256 chain hash (utils.page_hashes) plus a suffix naming the
model (a fingerprint of everything in its config that changes the bytes, and the dtype: SGLang's keys leave the
dtype out, #33268), the TP shard and the PP stage's layers. Who writes (`is_storage_writer`,
`--hicache-storage-writers`):

* `every-rank` (SGLang's MHA path) - every rank writes its own copy under its *global* TP rank (cp_rank x T +
  tp_rank of T x C), so CP peers keep separate copies although their KV is identical here;
* `one` (SGLang's path for rank-replicated KV, MLA's `is_storage_writer`) - CP peers share one key set, which
  CP rank 0 writes and all of them read. `storage_suffix(..., cp_rank=...)` then puts the CP rank in, as the
  seed document describes SGLang's Mooncake keys before #20460: the peers look for keys nobody wrote.

Interface (SGLang's HiCacheStorage, batched):

* `batch_exists(hashes)` - how many *leading* pages are present (a prefix is useful only up to a gap);
* `batch_get(hashes, host, page_slots)` - read leading pages into host slots; how many arrived intact;
* `batch_set(hashes, host, page_slots)` - write pages from host slots; how many were written;
* `clear()`, `stats`.

`FileStorage` keeps one file per page and shard, written atomically (temporary file, then rename) with a
sha256 of its key and payload, so a page proves both its bytes and whose they are: a missing, truncated,
corrupted or misnamed file (a valid page copied over another), or one that is not a regular file, is a miss
(logged), never wrong data, and never a blocking read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import torch

from ..config import CacheConfig, ModelConfig
from ..distributed.parallel_state import RankLayout
from .memory_pool_host import HostKVPool

log = logging.getLogger(__name__)
MAGIC = b"HCLP2"  # file format tag: magic, 32-byte sha256 of key and payload, payload (K/V of one page, pool dtype)
MOONCAKE_RPC_FAIL = -900  # Mooncake's ErrorCode::RPC_FAIL: the master did not answer
MOONCAKE_MIN_SEGMENT = 16 << 20  # the smallest global segment a Mooncake client accepts (its setup refuses less)


def model_fingerprint(model: ModelConfig) -> str:
    """12 hex digits naming the weights and shape of `model` and the KV dtype (`--dtype`): two models share keys
    only if every field that changes a page's bytes is equal, so a float32 run never reads a bfloat16 run's pages.
    The dtype goes in as `kv_dtype`, the name it had when it was a constant: float32 keys stay as they were."""
    fields = dataclasses.asdict(model)
    fields["kv_dtype"] = fields.pop("dtype")
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def storage_suffix(model: ModelConfig, tp_rank: int, tp: int, layers: range, cp_rank: int | None = None) -> str:
    """What distinguishes one rank's copy of a page from another's; `cp_rank` only to reproduce the bug."""
    suffix = f"m{model_fingerprint(model)}_tp{tp_rank}of{tp}_L{layers.start}-{layers.stop}"
    return suffix if cp_rank is None else f"{suffix}_cp{cp_rank}"


def is_storage_writer(cfg: CacheConfig, layout: RankLayout) -> bool:
    """Whether this rank writes its backups to storage (with `one` writer, CP rank 0 of each CP group)."""
    return cfg.storage_writers == "every-rank" or layout.cp_rank == 0


class FileStorage:
    def __init__(self, directory: Path, suffix: str):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.suffix = suffix
        self.stats: Counter[str] = Counter()

    def _path(self, page_hash: str) -> Path:
        return self.directory / f"{page_hash}_{self.suffix}.bin"

    def batch_exists(self, hashes: list[str]) -> int:
        count = 0
        try:
            while count < len(hashes) and self._path(hashes[count]).exists():
                count += 1
        except OSError as exc:  # an unreadable directory: what cannot be looked up is a miss
            log.warning("storage lookup of %s failed: %s", hashes[count][:12], exc)
            self.stats["lookup_failures"] += 1
        return count

    def batch_get(self, hashes: list[str], host: HostKVPool, page_slots: list[torch.Tensor]) -> int:
        for i, (page_hash, slots) in enumerate(zip(hashes, page_slots, strict=True)):
            data = self._read(page_hash, host.page_shape(len(slots)), host.dtype)
            if data is None:
                self.stats["read_misses"] += 1
                return i
            host.set_page_data(slots, data)
            self.stats["pages_read"] += 1
        return len(hashes)

    def batch_set(self, hashes: list[str], host: HostKVPool, page_slots: list[torch.Tensor]) -> int:
        for i, (page_hash, slots) in enumerate(zip(hashes, page_slots, strict=True)):
            try:
                self._write(page_hash, host.page_data(slots))
            except OSError as exc:  # disk full, unwritable directory: the page is simply not stored
                log.warning("storage write of %s failed: %s", page_hash[:12], exc)
                self.stats["write_failures"] += 1
                return i
            self.stats["pages_written"] += 1
        return len(hashes)

    def clear(self) -> None:
        for path in self.directory.glob(f"*_{self.suffix}.bin"):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        pass

    def damage(self, page_hash: str) -> None:
        """Flip one payload byte of a stored page in place (`--fault damage-page`); a page not stored stays so."""
        path = self._path(page_hash)
        if path.is_file():
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))

    def _key(self, page_hash: str) -> bytes:
        return f"{page_hash}_{self.suffix}".encode()

    def _write(self, page_hash: str, data: torch.Tensor) -> None:
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()  # numpy has no bfloat16: the raw bytes
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(self._key(page_hash) + payload).digest() + payload)
            os.replace(tmp, self._path(page_hash))  # atomic: a reader sees the old file, the new one, or none
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read(self, page_hash: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        path, expected = self._path(page_hash), len(MAGIC) + 32 + dtype.itemsize * torch.Size(shape).numel()
        try:  # non-blocking, and regular files only: a FIFO or device under a page's name must not stall a read
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.warning("storage page %s is not a regular file: treated as a miss", path.name)
                self.stats["corrupted"] += 1
                return None
            raw = f.read(expected + 1)
        start = len(MAGIC) + 32
        payload, checksum = raw[start:], raw[len(MAGIC) : start]
        if raw[: len(MAGIC)] != MAGIC or len(raw) != expected:
            log.warning("storage page %s is truncated or not a page file: treated as a miss", path.name)
        elif hashlib.sha256(self._key(page_hash) + payload).digest() != checksum:
            log.warning("storage page %s is corrupted, or another page's: treated as a miss", path.name)
        else:
            return torch.frombuffer(bytearray(payload), dtype=dtype).view(shape)
        self.stats["corrupted"] += 1
        return None


MOONCAKE_INSTALL = (
    "pip install mooncake-transfer-engine-non-cuda, and the system library libibverbs1 (apt-get install libibverbs1)"
)


@functools.cache
def mooncake_missing() -> str | None:
    """Why Mooncake cannot run on this machine (None: it can). Its package may be installed while its import
    fails: the client and `mooncake_master` need the system library libibverbs1. Probed in a subprocess, so
    that a library that loads half-way never stays in this process."""
    probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"]
    return f"`import mooncake.store` fails here ({lines[-1]}): {MOONCAKE_INSTALL}"


class MooncakeStorage:
    """Mooncake's distributed KV store, the L3 that SGLang users run (`mooncake-transfer-engine-non-cuda`;
    its import needs the system library `libibverbs1`). Pages travel zero-copy through one registered
    staging buffer with the store's batch calls, one batch at a time (the read and backup threads share it).
    A master that stops answering (RPC_FAIL) takes the store with it: its index of what the store holds lives
    in its memory, so the rank counts the store as lost and answers every later call at once with a miss (a
    failed put to a dead master takes seconds). Mooncake clients listen on every interface, so the lab runs
    them inside a loopback-only network namespace (see tests/mem_cache/test_mooncake_storage.py)."""

    def __init__(self, master: str, metadata_url: str, suffix: str, page_bytes: int, batch_pages: int = 128):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise RuntimeError(f"--hicache-storage-backend mooncake needs {MOONCAKE_INSTALL}: {exc}") from exc
        self.store = MooncakeDistributedStore()
        segment = 2 * page_bytes * batch_pages
        global_segment = max(MOONCAKE_MIN_SEGMENT, 64 * segment)
        if self.store.setup("127.0.0.1", metadata_url, global_segment, segment, "tcp", "", master) != 0:
            raise RuntimeError(f"could not join the Mooncake store at master {master}: is mooncake_master running?")
        self.suffix, self.page_bytes, self.batch_pages = suffix, page_bytes, batch_pages
        self.staging = torch.zeros(batch_pages * page_bytes, dtype=torch.uint8)  # bytes: any pool dtype fits
        if self.store.register_buffer(self.staging.data_ptr(), self.staging.numel()) != 0:
            raise RuntimeError("Mooncake refused to register the staging buffer")
        self.staging_lock = threading.Lock()
        self.master, self.lost = master, False
        self.stats: Counter[str] = Counter()

    def _chunks(self, hashes: list[str], page_slots: list[torch.Tensor]):
        """(keys, host slots per page, staging addresses, sizes) for each batch the staging buffer holds."""
        base = self.staging.data_ptr()
        for start in range(0, len(hashes), self.batch_pages):
            keys = [f"{h}_{self.suffix}" for h in hashes[start : start + self.batch_pages]]
            addresses = [base + i * self.page_bytes for i in range(len(keys))]
            yield keys, page_slots[start : start + self.batch_pages], addresses, [self.page_bytes] * len(keys)

    def _staged(self, i: int, host: HostKVPool) -> torch.Tensor:
        """The staging bytes of the batch's page i, as elements of the host pool's dtype."""
        return self.staging[i * self.page_bytes : (i + 1) * self.page_bytes].view(host.dtype)

    def _answered(self, codes: list[int]) -> bool:
        """Whether the master answered the call that returned `codes`; if not, the store is lost from now on."""
        if MOONCAKE_RPC_FAIL in codes and not self.lost:
            log.warning("the Mooncake master at %s does not answer: its store is lost, later calls miss", self.master)
            self.lost = True
        return not self.lost

    def batch_exists(self, hashes: list[str]) -> int:
        if self.lost:
            return 0
        found = self.store.batch_is_exist([f"{h}_{self.suffix}" for h in hashes])
        if not self._answered(found):
            return 0
        return next((i for i, present in enumerate(found) if present != 1), len(found))

    def batch_get(self, hashes: list[str], host: HostKVPool, page_slots: list[torch.Tensor]) -> int:
        done = 0
        for keys, slots, addresses, sizes in self._chunks(hashes, page_slots):
            if self.lost:
                return done
            with self.staging_lock:
                read = self.store.batch_get_into(keys, addresses, sizes)
                for i, (size, page) in enumerate(zip(read, slots, strict=True)):
                    if size != self.page_bytes or not self._answered(read):
                        self.stats["read_misses"] += 1
                        return done
                    host.set_page_data(page, self._staged(i, host).view(host.page_shape(len(page))))
                    done += 1
                    self.stats["pages_read"] += 1
        return done

    def batch_set(self, hashes: list[str], host: HostKVPool, page_slots: list[torch.Tensor]) -> int:
        done = 0
        for keys, slots, addresses, sizes in self._chunks(hashes, page_slots):
            if self.lost:
                return done
            with self.staging_lock:
                for i, page in enumerate(slots):
                    self._staged(i, host).copy_(host.page_data(page).flatten())
                results = self.store.batch_put_from(keys, addresses, sizes)
            self._answered(results)
            ok = next((i for i, rc in enumerate(results) if rc != 0), len(results))
            done += ok
            self.stats["pages_written"] += ok
            if ok < len(results):
                log.warning("Mooncake put failed (rc %s): the page is not stored", results[ok])
                self.stats["write_failures"] += 1
                return done
        return done

    def clear(self) -> None:
        self.store.remove_by_regex(f".*_{self.suffix}$")

    def close(self) -> None:
        self.store.close()
