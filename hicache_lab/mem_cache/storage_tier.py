"""The L3 tier: backups from host to storage, and prefetches from storage to host.

* **Backup** - once a node's host write is acknowledged (with the upper halves split off it meanwhile), or a
  write_back eviction has copied it to the host, its pages go to storage. The host copy is protected
  (`host_ref`) until the backup is acknowledged; acks are consumed by an agreed count, like write acks. Every
  rank writes its own copy (`--hicache-storage-writers every-rank`, SGLang's MHA path), or CP rank 0 alone for
  its CP group (`one`, SGLang's `is_storage_writer` for rank-replicated KV): the others queue and acknowledge
  the backup without writing (SGLang's `backup_skip`).
* **Prefetch** - when a request arrives, the pages of its prompt the tree does not hold are asked of storage,
  agreed, read into host slots in batches and agreed again (`StoragePrefetch`, storage_prefetch.py).

The tier never changes the tree: `HiRadixCache` protects the host copy of a prefetch's anchor and of what a
backup reads, inserts the pages that arrived, and releases both when the tier hands the operation back.

Two ways to run the workers, chosen by the latency model:

* `virtual` - step-driven, deterministic: a hit query counts as answered a seeded number of steps after it was
  issued, a batch read a seeded number of steps after its prefetch started (drawn per rank; the threads work at
  once, and the scheduler waits for them where they have not), and a backup completes a seeded number of steps
  later, really moving bytes then; `timeout` counts steps.
* `real` - a backup thread besides the query and read threads, as in SGLang; what counts is what the threads
  have done; `timeout` is wall time.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import CacheConfig
from ..distributed.cache_sync import CacheSync
from .base import StorageBackend
from .memory_pool import PageAllocator
from .memory_pool_host import HostKVPool
from .storage_prefetch import PrefetchOp, StoragePrefetch
from .tree_node import TreeNode, node_hashes

log = logging.getLogger(__name__)


@dataclass(eq=False)
class BackupOp:
    node: TreeNode
    hashes: list[str]  # captured at issue: a later split of the node must not change what is written
    pages: list[torch.Tensor]
    due: int = 0  # virtual: the step it completes
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class StorageStats:
    prefetches: int = 0
    revoked: int = 0  # storage held less than the threshold
    no_host_room: int = 0  # the host could not hold the threshold
    rate_limited: int = 0
    cut_short: int = 0  # admission took them before every page arrived (best_effort, or a timeout)
    pages_prefetched: int = 0
    pages_backed_up: int = 0


class StorageTier(StoragePrefetch):
    def __init__(
        self,
        cfg: CacheConfig,
        backend: StorageBackend,
        host_pool: HostKVPool,
        host_alloc: PageAllocator,
        sync: CacheSync,
        *,
        writer: bool,
        seed: int,
        rank: int,
    ):
        self.cfg, self.backend = cfg, backend
        self.host_pool, self.host_alloc, self.sync = host_pool, host_alloc, sync
        self.writer = writer  # whether this rank's backups write (is_storage_writer)
        self.rng = np.random.default_rng([seed, rank, 3])
        self.step = 0
        self.backups: list[BackupOp] = []  # FIFO, acknowledged by an agreed count
        self.prefetches: dict[int, PrefetchOp] = {}  # by request id, until they end
        self.queries: list[PrefetchOp] = []  # FIFO of hit queries whose answer the scheduler has not taken
        self.reading: list[PrefetchOp] = []  # FIFO of the read thread's prefetches, until their last ack
        self.stats = StorageStats()
        # prefetches in flight may ask for at most this share of the host pool (SGLang 0.5.23: half)
        self.prefetch_capacity = int(cfg.prefetch_capacity_fraction * host_alloc.size)
        self.error: BaseException | None = None  # from a worker thread, raised on the scheduler's next call
        workers = {"query": self._query, "read": self._read} | (
            {"backup": self._write} if cfg.latency == "real" else {}
        )
        self.queues = {name: queue.Queue() for name in workers}
        self.threads = [
            threading.Thread(target=self._worker, args=(self.queues[name], work), daemon=True, name=f"storage-{name}")
            for name, work in workers.items()
        ]
        for thread in self.threads:
            thread.start()

    @property
    def threaded(self) -> bool:
        """Whether what the threads have done counts (real latency), not the due steps (virtual)."""
        return "backup" in self.queues

    def _worker(self, jobs: queue.Queue, work) -> None:
        while (op := jobs.get()) is not None:
            try:
                work(op)
            except BaseException as exc:  # surfaced to the scheduler thread by _check_worker
                self.error = exc
                return

    def _check_worker(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a storage worker failed: {self.error}") from self.error

    def _due(self, previous: int) -> int:
        return max(previous, self.step + int(self.rng.integers(0, self.cfg.max_copy_delay_steps + 1)))

    # -- backup ------------------------------------------------------------------------------------

    def backup(self, node: TreeNode) -> None:
        """Queue `node`'s pages for storage (the cache protects its host copy until the ack is consumed)."""
        pages = list(node.host_value.split(self.cfg.page_size))
        op = BackupOp(node, list(node_hashes(node, self.cfg.page_size)), pages)
        self.backups.append(op)
        if self.threaded:
            self.queues["backup"].put(op)
        else:
            op.due = self._due(self.backups[-2].due if len(self.backups) > 1 else 0)

    def _write(self, op: BackupOp) -> None:
        if self.writer:
            try:
                self.stats.pages_backed_up += self.backend.batch_set(op.hashes, self.host_pool, op.pages)
            except Exception as exc:  # a store gone away: the pages are simply not stored
                log.warning("storage write of %d pages failed: %s", len(op.hashes), exc)
        op.done.set()

    def backups_done(self) -> int:
        """Finished backups at the head of the queue (this rank's own view)."""
        self._check_worker()
        done = 0
        while done < len(self.backups) and self.backups[done].done.is_set():
            done += 1
        return done

    def release_backups(self, count: int) -> list[TreeNode]:
        """Consume the agreed number of backups (waiting for this rank's own where needed); their nodes."""
        return [self._complete_backup(self.backups.pop(0)) for _ in range(count)]

    def _complete_backup(self, op: BackupOp) -> TreeNode:
        if not op.done.is_set():
            if self.threaded:
                op.done.wait()
            else:
                self._write(op)
        return op.node

    def busy(self) -> bool:
        """Backups or prefetches in flight (they hold host protection, locks or requests)."""
        return bool(self.prefetches or self.backups or self.queries)

    def summary(self) -> dict:
        s = self.stats
        return {
            "prefetches": s.prefetches,
            "revoked": s.revoked,
            "no_host_room": s.no_host_room,
            "rate_limited": s.rate_limited,
            "cut_short": s.cut_short,
            "pages_prefetched": s.pages_prefetched,
            "pages_backed_up": s.pages_backed_up,
        }

    # -- time --------------------------------------------------------------------------------------

    def advance(self, step: int) -> None:
        """Virtual latency: complete every storage write due by `step` (reads count by their due steps)."""
        self.step = step
        if self.threaded:
            return
        for op in self.backups:
            if not op.done.is_set() and op.due <= step:
                self._write(op)

    def finish_all(self) -> list[TreeNode]:
        """Between rounds (no request waiting): take the answers of ended prefetches' queries, complete every
        backup; the backups' nodes."""
        assert not self.prefetches, "prefetches outlive their requests"
        self.take_queries(len(self.queries), make_room=None, allocate=None)
        self.reading.clear()  # every one ended: their acks, still to come, count for nothing, alike on every rank
        return self.release_backups(len(self.backups))

    def close(self) -> None:
        """Stop the workers once they have done what is queued (the read thread's last agreements need every
        rank), then their groups. One still in a collective whose peers are gone (a crashed world) is left to
        die with the process (daemon threads), so that this rank can still write its result."""
        for jobs in self.queues.values():
            jobs.put(None)
        for thread in self.threads:
            thread.join(timeout=5)
        if busy := [thread.name for thread in self.threads if thread.is_alive()]:
            log.warning("%s still busy at the end (a store or a peer gone?): the store is left open", busy)
            return  # closing a store under a call in flight can crash the process (Mooncake's client does)
        self.sync.destroy_storage_groups()
        self.backend.close()
