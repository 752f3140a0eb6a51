"""L3 storage: where host pages go to outlive the host pool (and the process). The keys, and the file backend;
the Mooncake backend is mooncake_store.py.

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
import hashlib
import json
import logging
import os
import stat
import tempfile
from collections import Counter
from pathlib import Path

import torch

from ..config import CacheConfig, ModelConfig
from ..distributed.parallel_state import RankLayout
from .memory_pool_host import HostKVPool

log = logging.getLogger(__name__)
MAGIC = b"HCLP2"  # file format tag: magic, 32-byte sha256 of key and payload, payload (K/V of one page, pool dtype)


def model_fingerprint(model: ModelConfig) -> str:
    """12 hex digits naming the weights and shape of `model` and the KV dtype (`--dtype`): two models share keys
    only if every field that changes a page's bytes is equal, so a float32 run never reads a bfloat16 run's pages.
    The dtype goes in as `kv_dtype`, the name it had when it was a constant: float32 keys stay as they were."""
    fields = dataclasses.asdict(model)
    fields["kv_dtype"] = fields.pop("dtype")
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def storage_suffix(
    model: ModelConfig, tp_rank: int, tp: int, heads: range, layers: range, cp_rank: int | None = None
) -> str:
    """What distinguishes one rank's copy of a page from another's: the model, the writer's rank of how many,
    the heads and layers the page holds (a `--tp 2` rank and a `--cp 2` rank are both `tp1of2`, holding
    different heads); `cp_rank` only to reproduce the bug."""
    where = f"tp{tp_rank}of{tp}_h{heads.start}-{heads.stop}_L{layers.start}-{layers.stop}"
    suffix = f"m{model_fingerprint(model)}_{where}"
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
        # a store this process cannot write (a shared, pre-filled cache on a read-only mount) is read, never written
        self.read_only = not os.access(self.directory, os.W_OK) or bool(
            os.statvfs(self.directory).f_flag & os.ST_RDONLY
        )
        if self.read_only:
            log.warning("storage directory %s is read-only: its pages are read, none is written", self.directory)

    def stored_hashes(self) -> set[str]:
        """The page hashes this key set holds now (what a store filled before the run offers it)."""
        tail = f"_{self.suffix}.bin"
        return {p.name[: -len(tail)] for p in self.directory.glob(f"*{tail}")}

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
        if self.read_only:
            return 0
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
        if self.read_only:
            return
        for path in self.directory.glob(f"*_{self.suffix}.bin"):
            path.unlink(missing_ok=True)

    def close(self) -> None:
        pass

    def damage(self, page_hash: str) -> None:
        """Replace a stored page by a copy with its last byte flipped (`--fault damage-page`): a new file, so a
        hard link to the page (a backup) or a link's target keeps the good one; a page not stored stays so."""
        path = self._path(page_hash)
        if path.is_file():
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, path)

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
        except FileNotFoundError:
            return None
        except OSError as exc:  # no permission, no file descriptor left: a miss, said aloud
            log.warning("storage page %s cannot be opened (%s): treated as a miss", path.name, exc.strerror)
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # before a file object exists: a directory would raise there
            os.close(fd)
            log.warning("storage page %s is not a regular file: treated as a miss", path.name)
            self.stats["corrupted"] += 1
            return None
        with os.fdopen(fd, "rb") as f:
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
