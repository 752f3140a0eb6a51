"""The Mooncake L3 backend: Mooncake's distributed KV store, the L3 that SGLang users run
(`mooncake-transfer-engine-non-cuda`; SGLang's `mem_cache/storage/mooncake_store/mooncake_store.py`), behind the
interface of hicache_storage.py; and whether this machine can run it (`mooncake_missing`)."""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import threading
from collections import Counter

import torch

from .memory_pool_host import HostKVPool

log = logging.getLogger(__name__)
MOONCAKE_RPC_FAIL = -900  # Mooncake's ErrorCode::RPC_FAIL: the master did not answer
MOONCAKE_MIN_SEGMENT = 16 << 20  # the smallest global segment a Mooncake client accepts (its setup refuses less)

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
