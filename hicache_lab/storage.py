"""L3 storage backends: where host pages go to outlive the host pool (and the process).

A page is stored under its key: the page's sha256 chain hash (radix.page_hashes) plus a suffix naming what
really differs between ranks' data — the model, the TP shard and the PP stage's layers. Not the CP rank: CP
peers hold identical KV, so exactly one of them writes each page and all of them read it. (SGLang's Mooncake
keys carried the CP rank, so peers never found each other's pages; `storage_suffix(..., cp_rank=...)`
reproduces that.)

Interface (SGLang's HiCacheStorage, batched):

* `batch_exists(hashes)` - how many *leading* pages are present (a prefix is useful only up to a gap);
* `batch_get(hashes, host, page_slots)` - read leading pages into host slots; how many arrived intact;
* `batch_set(hashes, host, page_slots)` - write pages from host slots; how many were written;
* `clear()`, `stats`.

`FileStorage` keeps one file per page and shard, written atomically (temporary file, then rename) with a
sha256 of its payload; a missing, truncated or corrupted file is a miss (logged), never wrong data.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections import Counter
from pathlib import Path

import torch

from .memory import HostKVPool

log = logging.getLogger(__name__)
MAGIC = b"HCLP1"  # file format tag: magic, 32-byte sha256 of the payload, payload (float32 K/V of one page)


def storage_suffix(model_seed: int, tp_rank: int, tp: int, layers: range, cp_rank: int | None = None) -> str:
    """What distinguishes one rank's copy of a page from another's; `cp_rank` only to reproduce the bug."""
    suffix = f"m{model_seed}_tp{tp_rank}of{tp}_L{layers.start}-{layers.stop}"
    return suffix if cp_rank is None else f"{suffix}_cp{cp_rank}"


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
        while count < len(hashes) and self._path(hashes[count]).exists():
            count += 1
        return count

    def batch_get(self, hashes: list[str], host: HostKVPool, page_slots: list[torch.Tensor]) -> int:
        for i, (page_hash, slots) in enumerate(zip(hashes, page_slots, strict=True)):
            data = self._read(self._path(page_hash), host.page_shape(len(slots)))
            if data is None:
                self.stats["read_misses"] += 1
                return i
            host.set_page_data(slots, data)
            self.stats["pages_read"] += 1
        return len(hashes)

    def batch_set(self, hashes: list[str], host: HostKVPool, page_slots: list[torch.Tensor]) -> int:
        for i, (page_hash, slots) in enumerate(zip(hashes, page_slots, strict=True)):
            try:
                self._write(self._path(page_hash), host.page_data(slots))
            except OSError as exc:  # disk full, unwritable directory: the page is simply not stored
                log.warning("storage write of %s failed: %s", page_hash[:12], exc)
                self.stats["write_failures"] += 1
                return i
            self.stats["pages_written"] += 1
        return len(hashes)

    def clear(self) -> None:
        for path in self.directory.glob(f"*_{self.suffix}.bin"):
            path.unlink(missing_ok=True)

    def _write(self, path: Path, data: torch.Tensor) -> None:
        payload = data.contiguous().numpy().tobytes()
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)  # atomic: a reader sees the old file, the new one, or none
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read(self, path: Path, shape: tuple[int, ...]) -> torch.Tensor | None:
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        start = len(MAGIC) + 32
        payload, checksum = raw[start:], raw[len(MAGIC) : start]
        expected = 4 * torch.Size(shape).numel()
        if raw[: len(MAGIC)] != MAGIC or len(payload) != expected or hashlib.sha256(payload).digest() != checksum:
            log.warning("storage page %s is truncated or corrupted: treated as a miss", path.name)
            self.stats["corrupted"] += 1
            return None
        return torch.frombuffer(bytearray(payload), dtype=torch.float32).view(shape)
