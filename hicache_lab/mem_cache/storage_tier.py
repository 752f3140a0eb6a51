"""The L3 tier: backups from host to storage, and prefetches from storage to host.

* **Backup** - once a node's host write is acknowledged, its pages go to storage. The host copy is protected
  (`host_ref`) until the backup is acknowledged; acks are consumed by an agreed count, like write acks. CP
  peers hold identical KV, so page i is written by CP rank i mod cp only; the others skip it.
* **Prefetch** - when a request arrives, host slots are reserved for the part of its prompt the tree does
  not hold (the cache locks the node they hang below, its anchor). The prefetch worker asks storage how many
  leading pages it holds, agrees on the MIN with its peers over its own gloo groups (below the threshold:
  revoked), and reads them in batches of 128. At admission (on the scheduler's own groups) `prefetch_ready`
  agrees whether to stop waiting (MAX of "not ready"), `take_prefetch` how many pages arrived (MIN).

The tier never changes the tree: `HiRadixCache` protects what a backup reads and locks a prefetch's anchor,
inserts the pages that arrived, and releases both when the tier hands the operation back.

Two ways to run the workers, chosen by the latency model:

* `virtual` - step-driven, deterministic: the hit query runs when the prefetch is issued; every batch read
  and backup completes a seeded number of steps later (drawn per rank), really moving bytes then.
* `real` - a backup thread and a prefetch thread, as in SGLang; the prefetch thread runs the hit-count
  agreement on its own groups, which is the point of the CP fix's `_create_prefetch_sync_groups`.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import CacheConfig
from ..distributed.cache_sync import MAX, CacheSync
from .base import StorageBackend
from .memory_pool import PageAllocator
from .memory_pool_host import HostKVPool
from .radix_tree import TreeNode, page_hashes

STORAGE_BATCH_PAGES = 128  # pages per storage read (SGLang's default I/O batch)


@dataclass(eq=False)
class BackupOp:
    node: TreeNode
    hashes: list[str]  # captured at issue: a later split of the node must not change what is written
    pages: list[torch.Tensor]
    due: int = 0  # virtual: the step it completes
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class PrefetchOp:
    anchor: TreeNode  # the deepest matched node: fetched pages hang below it
    tokens: tuple[int, ...]  # page-aligned prompt tokens beyond the anchor
    hashes: list[str]
    host_slots: torch.Tensor
    created: int
    hits: int | None = None  # agreed leading pages in storage (0: revoked); None until the query ran
    due: list[int] = field(default_factory=list)  # virtual: per batch, the step its read completes
    arrived: int = 0  # leading pages read into host slots
    failed: bool = False  # a page could not be read: no more arrive
    terminated: bool = False  # the scheduler took what arrived: the worker must not write any more
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class StorageStats:
    prefetches: int = 0
    revoked: int = 0
    rate_limited: int = 0
    pages_prefetched: int = 0
    pages_backed_up: int = 0


class StorageTier:
    def __init__(
        self,
        cfg: CacheConfig,
        backend: StorageBackend,
        host_pool: HostKVPool,
        host_alloc: PageAllocator,
        sync: CacheSync,
        *,
        cp_rank: int,
        cp_size: int,
        seed: int,
        rank: int,
    ):
        self.cfg, self.backend = cfg, backend
        self.host_pool, self.host_alloc, self.sync = host_pool, host_alloc, sync
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.rng = np.random.default_rng([seed, rank, 3])
        self.step = 0
        self.backups: list[BackupOp] = []  # FIFO, acknowledged by an agreed count
        self.prefetches: dict[int, PrefetchOp] = {}  # by request id
        self.stats = StorageStats()
        # SGLang's limit: prefetches in flight may hold at most 80% of what the host pool has beyond the device's
        self.prefetch_capacity = int(0.8 * (host_alloc.size - cfg.max_total_tokens))
        self.error: BaseException | None = None  # from a worker thread, raised on the scheduler's next call
        self.threads: list[threading.Thread] = []
        if cfg.latency == "real":
            self.queues = {"backup": queue.Queue(), "prefetch": queue.Queue()}
            for name, work in (("backup", self._write), ("prefetch", self._fetch)):
                thread = threading.Thread(target=self._worker, args=(self.queues[name], work), daemon=True)
                thread.start()
                self.threads.append(thread)

    @property
    def threaded(self) -> bool:
        return bool(self.threads)

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
        op = BackupOp(node, list(node.hashes), pages)
        self.backups.append(op)
        if self.threaded:
            self.queues["backup"].put(op)
        else:
            op.due = self._due(self.backups[-2].due if len(self.backups) > 1 else 0)

    def _write(self, op: BackupOp) -> None:
        mine = range(self.cp_rank, len(op.pages), self.cp_size)
        written = self.backend.batch_set([op.hashes[i] for i in mine], self.host_pool, [op.pages[i] for i in mine])
        self.stats.pages_backed_up += written
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
        return bool(self.prefetches or self.backups)

    # -- prefetch ----------------------------------------------------------------------------------

    def prefetch(self, rid: int, anchor: TreeNode, tokens: tuple[int, ...], make_room) -> bool:
        """Start fetching `tokens` (page-aligned, following `anchor`): reserve host slots, hand the rest to the
        prefetch worker. Skipped (False) while prefetches in flight would exceed the rate limit, or without room."""
        in_flight = sum(len(op.tokens) for op in self.prefetches.values())
        if in_flight + len(tokens) > self.prefetch_capacity:
            self.stats.rate_limited += 1
            return False
        slots = self.host_alloc.alloc(len(tokens))
        if slots is None:
            make_room(len(tokens))
            slots = self.host_alloc.alloc(len(tokens))
        if slots is None:
            return False
        hashes = page_hashes(tokens, self.cfg.page_size, anchor.hashes[-1] if anchor.hashes else "")
        op = PrefetchOp(anchor, tokens, hashes, slots, self.step)
        self.prefetches[rid] = op
        self.stats.prefetches += 1
        if self.threaded:
            self.queues["prefetch"].put(op)
            return True
        self._query(op)
        previous = 0
        for _ in range(0, op.hits, STORAGE_BATCH_PAGES):
            previous = self._due(previous)
            op.due.append(previous)
        return True

    def _query(self, op: PrefetchOp) -> None:
        """How many leading pages storage holds, agreed (MIN) over the prefetch groups; too few: revoked."""
        (hits,) = self.sync.agree_storage([self.backend.batch_exists(op.hashes)])
        if hits * self.cfg.page_size < self.cfg.prefetch_threshold:
            hits = 0
            self.stats.revoked += 1
        op.hits = hits

    def _fetch(self, op: PrefetchOp) -> None:
        """The prefetch thread: query, then read batch after batch until done or terminated."""
        self._query(op)
        while op.arrived < op.hits and not op.failed:
            if not self._read_batch(op):
                return

    def _read_batch(self, op: PrefetchOp) -> bool:
        """Read the next batch into its host slots, unless the scheduler has already ended the prefetch."""
        pages = list(op.host_slots.split(self.cfg.page_size))
        batch = slice(op.arrived, min(op.arrived + STORAGE_BATCH_PAGES, op.hits))
        with op.lock:
            if op.terminated:  # its host slots may be freed already
                return False
            read = self.backend.batch_get(op.hashes[batch], self.host_pool, pages[batch])
            op.arrived += read
            op.failed = read < batch.stop - batch.start  # a missing or damaged page ends the prefetch there
        return True

    def prefetch_ready(self, rid: int) -> bool:
        """Whether request `rid` may stop waiting for its prefetch (True without one), agreed: no rank stops
        while another, by its policy, still waits."""
        self._check_worker()
        op = self.prefetches.get(rid)
        if op is None:
            return True
        complete = op.hits is not None and (op.failed or op.arrived >= op.hits)
        if self.cfg.prefetch_policy == "best_effort":
            ready = True
        elif self.cfg.prefetch_policy == "wait_complete":
            ready = complete
        else:
            ready = complete or self.step - op.created >= self.cfg.prefetch_timeout_steps
        (not_ready,) = self.sync.agree_prefetch_progress([int(not ready)], MAX)
        return not not_ready

    def take_prefetch(self, rid: int) -> tuple[PrefetchOp, int] | None:
        """End request `rid`'s prefetch (after `prefetch_ready`): the op and the pages every rank holds, which the
        worker no longer touches; None without a prefetch."""
        op = self.prefetches.pop(rid, None)
        if op is None:
            return None
        (pages,) = self.sync.agree_prefetch_progress([op.arrived])
        self._wait_for_pages(op, pages)  # a later stage may hold fewer than stage 0 saw arrive
        with op.lock:
            op.terminated = True
        self.stats.pages_prefetched += pages
        return op, pages

    def _wait_for_pages(self, op: PrefetchOp, pages: int) -> None:
        while op.arrived < pages:
            self._check_worker()
            if op.failed or (op.hits is not None and op.hits < pages):
                raise RuntimeError(f"{pages} prefetched pages were agreed, but only {op.arrived} can arrive here")
            if self.threaded:
                threading.Event().wait(0.001)
            else:
                self._read_batch(op)

    def summary(self) -> dict:
        s = self.stats
        return {
            "prefetches": s.prefetches,
            "revoked": s.revoked,
            "rate_limited": s.rate_limited,
            "pages_prefetched": s.pages_prefetched,
            "pages_backed_up": s.pages_backed_up,
        }

    # -- time --------------------------------------------------------------------------------------

    def advance(self, step: int) -> None:
        """Virtual latency: complete every storage read and write due by `step`."""
        self.step = step
        if self.threaded:
            return
        for op in self.backups:
            if not op.done.is_set() and op.due <= step:
                self._write(op)
        for op in self.prefetches.values():
            while op.arrived < op.hits and not op.failed and op.due[op.arrived // STORAGE_BATCH_PAGES] <= step:
                self._read_batch(op)

    def finish_all(self) -> list[TreeNode]:
        """Between rounds (no request waiting): complete every backup; their nodes."""
        assert not self.prefetches, "prefetches outlive their requests"
        return self.release_backups(len(self.backups))

    def close(self) -> None:
        if self.threaded:
            for jobs in self.queues.values():
                jobs.put(None)
            for thread in self.threads:
                thread.join()
        self.backend.close()
