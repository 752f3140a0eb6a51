"""The L3 tier: backups from host to storage, and prefetches from storage to host.

* **Backup** - once a node's host write is acknowledged (with the upper halves split off it meanwhile), or a
  write_back eviction has copied it to the host, its pages go to storage. The host copy is protected
  (`host_ref`) until the backup is acknowledged; acks are consumed by an agreed count, like write acks. Every
  rank writes its own copy (`--hicache-storage-writers every-rank`, SGLang's MHA path), or CP rank 0 alone for
  its CP group (`one`, SGLang's `is_storage_writer` for rank-replicated KV): the others queue and acknowledge
  the backup without writing (SGLang's `backup_skip`).
* **Prefetch** - when a request arrives, the prefetch thread asks storage how many leading pages of the part of
  its prompt the tree does not hold it has, and agrees on the MIN with its peers on its own gloo groups, across
  stages too (a background thread is not held by the pipeline). The scheduler takes the answers in issue order,
  by a count agreed in the step's check (SGLang's `prefetch_hit_queue`): below the threshold the prefetch is
  revoked (and ends: its rate-limit share and its anchor's protection are released then), else host slots are
  allocated for the hit (evicting from the host; a shorter prefix when the host cannot hold it all) and the read
  thread reads the pages in batches of 128. After every batch it agrees how many pages have arrived (SGLang
  0.5.23's progressive prefetch acks, on their own `prefetch_completion_sync_groups`): with
  `prefetch_completion` the MIN over every rank that reads them, across stages too, so a page damaged on one
  rank is a miss on all. Each batch's agreement is an ack; the step's check agrees how many of them every rank
  consumes (SGLang's `ack_prefetch_queue`), and a prefetch whose last ack is consumed ends there, its pages
  inserted, before its request is admitted (`_drain_ack_prefetch` -> `_handle_prefetch_result`). Admission
  (`prefetch_ready`) votes only under `timeout`: PP rank 0 and its attention peers, MAX of "deadline expired",
  relayed; the pages kept are those the consumed acks counted, the same on every rank. Prefetches in flight may
  ask for at most `prefetch_capacity` tokens (`CacheConfig.prefetch_capacity_fraction` of the host pool;
  SGLang 0.5.23: half); one more is skipped.

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
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import CacheConfig
from ..distributed.cache_sync import MAX, CacheSync
from .base import StorageBackend
from .memory_pool import PageAllocator
from .memory_pool_host import HostKVPool
from .tree_node import TreeNode, node_hashes
from .utils import page_hashes

log = logging.getLogger(__name__)
STORAGE_BATCH_PAGES = 128  # pages per storage read (SGLang's default I/O batch)


@dataclass(eq=False)
class PrefetchOp:
    rid: int  # the request it fetches for
    anchor: TreeNode  # the deepest matched node: fetched pages hang below it
    tokens: tuple[int, ...]  # page-aligned prompt tokens beyond the anchor
    hashes: list[str]
    created: int  # the step it was issued
    query_due: int = 0  # virtual: the step its hit query counts as answered
    found: int = 0  # leading pages storage holds, agreed by the query thread
    queried: threading.Event = field(default_factory=threading.Event)
    host_slots: torch.Tensor | None = None  # allocated once the hit is known, sized to it
    plan: int = 0  # pages the read thread goes through, batch by batch, on every rank: the agreed hit (0: revoked)
    hits: int | None = None  # pages this rank reads (<= plan, 0: no host room); None until the query is taken
    due: list[int] = field(default_factory=list)  # virtual: per batch, the step its read counts as done
    waiting_since: float | None = None  # real `timeout`: when admission first had to wait for it
    arrived: int = 0  # leading pages read into host slots on this rank
    failed: bool = False  # a page could not be read here: no more arrive
    agreed: list[int] = field(default_factory=list)  # per batch read, the pages arrived as the ranks agreed
    drained: int = 0  # its batch acks consumed (by agreed counts): the same on every rank
    pages: int = 0  # pages arrived as the last consumed ack says: what an ending now keeps, on every rank
    terminated: bool = False  # the scheduler took what arrived: the worker must not write any more
    progress: threading.Condition = field(default_factory=threading.Condition)  # guards the fields above

    def batches(self) -> list[slice]:
        """The page ranges of its storage reads, the same on every rank."""
        return [slice(i, min(i + STORAGE_BATCH_PAGES, self.plan)) for i in range(0, self.plan, STORAGE_BATCH_PAGES)]


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


class StorageTier:
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

    # -- prefetch ----------------------------------------------------------------------------------

    def prefetch(self, rid: int, anchor: TreeNode, tokens: tuple[int, ...]) -> bool:
        """Start fetching `tokens` (page-aligned, following `anchor`): the query thread asks storage. Skipped
        (False) while prefetches in flight ask for `prefetch_capacity` tokens of the host pool (SGLang's rate
        limit)."""
        if sum(len(op.tokens) for op in self.prefetches.values()) >= self.prefetch_capacity:
            self.stats.rate_limited += 1
            return False
        chain = node_hashes(anchor, self.cfg.page_size)
        hashes = page_hashes(tokens, self.cfg.page_size, chain[-1] if chain else "")
        op = PrefetchOp(rid, anchor, tokens, hashes, self.step)
        op.query_due = self._due(self.queries[-1].query_due if self.queries else 0)
        self.prefetches[rid] = op
        self.queries.append(op)
        self.stats.prefetches += 1
        self.queues["query"].put(op)
        return True

    def _query(self, op: PrefetchOp) -> None:
        """The query thread: leading pages in storage, agreed (MIN) over the prefetch groups."""
        try:
            found = self.backend.batch_exists(op.hashes)
        except Exception as exc:  # a store gone away: nothing found, and this rank still votes
            log.warning("storage lookup of %d pages failed: %s", len(op.hashes), exc)
            found = 0
        (op.found,) = self.sync.agree_storage([found])
        op.queried.set()

    def queries_done(self) -> int:
        """Answered hit queries at the head of the queue (this rank's own view)."""
        self._check_worker()
        done = 0
        for op in self.queries:
            if not (op.query_due <= self.step if not self.threaded else op.queried.is_set()):
                break
            done += 1
        return done

    def take_queries(self, count: int, make_room, allocate) -> list[TreeNode]:
        """The agreed `count` answers, in issue order (waiting for this rank's own where needed): a prefetch
        whose hit is below the threshold is revoked, and ends there (SGLang's `_retire_ongoing_prefetch`): it no
        longer counts toward the rate limit, and its anchor is returned for the tree to release; one already
        ended is passed over. The others get host slots for their
        hit (`make_room` evicts from the host; if the host cannot hold all of it, a shorter prefix, down to
        the threshold) and start reading; one whose host cannot hold the threshold is revoked there, as 0.5.23
        revokes it. With identical trees every rank decides alike; an allocation that fails on one rank alone
        (`--fault alloc-fail`) has no answer in any release, and the `alloc_agreement` proposal keeps such a
        prefetch in flight instead: the read thread goes through the agreed hit's batches on every rank, the
        rank without slots reads nothing there, and the pages agreed arrived are only those every rank holds."""
        ps, revoked = self.cfg.page_size, []
        for op in self.queries[:count]:
            while not op.queried.wait(0.05):
                self._check_worker()
            pages = op.found
            if op.terminated or pages * ps < self.cfg.prefetch_threshold:
                op.hits = 0
                if not op.terminated:
                    self.stats.revoked += 1
                    del self.prefetches[op.rid]
                    revoked.append(op.anchor)
                continue
            if self.host_alloc.available_size() < pages * ps:
                make_room(pages * ps - self.host_alloc.available_size())
            op.plan, pages = pages, min(pages, self.host_alloc.available_size() // ps)
            slots = allocate(self.host_alloc, pages * ps) if pages * ps >= self.cfg.prefetch_threshold else None
            op.host_slots, op.hits = slots, pages if slots is not None else 0
            self.stats.no_host_room += slots is None
            if slots is None and "alloc_agreement" not in self.sync.fixes:
                del self.prefetches[op.rid]  # revoked at once, as 0.5.23's `_try_alloc_storage_hit` (host_capacity)
                revoked.append(op.anchor)
                continue
            previous = self.step
            for _ in op.batches() if not self.threaded else ():
                previous = self._due(previous)
                op.due.append(previous)
            self.reading.append(op)
            self.queues["read"].put(op)
        self.queries = self.queries[count:]
        return revoked

    def _read(self, op: PrefetchOp) -> None:
        """The read thread: every batch in turn, then the pages arrived so far agreed (`agree_prefetch_completion`).
        A batch after a failure, or after the scheduler ended the prefetch (its host slots may be freed), reads
        nothing but is agreed all the same: every rank enters as many collectives."""
        pages = list(op.host_slots.split(self.cfg.page_size)) if op.hits else []
        for batch in op.batches():
            with op.progress:
                if not (op.terminated or op.failed):
                    mine = slice(batch.start, min(batch.stop, op.hits))  # what this rank has host slots for
                    read = self._read_pages(op.hashes[mine], pages[mine]) if mine.stop > mine.start else 0
                    op.arrived += read
                    op.failed = read < batch.stop - batch.start  # a missing or damaged page ends it there
                arrived = op.arrived
            (agreed,) = self.sync.agree_prefetch_completion([arrived])
            with op.progress:
                op.agreed.append(agreed)
                op.progress.notify_all()

    def _read_pages(self, hashes: list[str], pages: list[torch.Tensor]) -> int:
        try:
            return self.backend.batch_get(hashes, self.host_pool, pages)
        except Exception as exc:  # a store gone away mid-read: what did not arrive is a miss
            log.warning("storage read of %d pages failed: %s", len(hashes), exc)
            return 0

    def prefetch_acks_done(self) -> int:
        """Leading batch acks of the read FIFO done on this rank: under real latency those the read thread has
        agreed; under virtual latency those due by now (waiting for the thread's agreement of them)."""
        self._check_worker()
        done = 0
        for op in self.reading:
            with op.progress:
                due = len(op.agreed) if self.threaded else sum(d <= self.step for d in op.due)
                while len(op.agreed) < due:
                    self._check_worker()
                    op.progress.wait(0.05)
            done += due - op.drained
            if due < len(op.batches()):
                break
        return done

    def take_prefetch_acks(self, count: int) -> list[PrefetchOp]:
        """Consume the agreed `count` batch acks in order: each sets its prefetch's `pages`; a prefetch whose
        last one is consumed leaves the FIFO and, where its request still waits for it, ends (returned, for the
        cache to insert its pages). On a later stage the count is PP rank 0's: this rank's read thread may
        still be appending the agreement of a batch every rank has entered, so it is waited for."""
        done = []
        while count:
            op = self.reading[0]
            taken = min(count, len(op.batches()) - op.drained)
            op.drained, count = op.drained + taken, count - taken
            with op.progress:
                while len(op.agreed) < op.drained:
                    self._check_worker()
                    op.progress.wait(0.05)
            op.pages = op.agreed[op.drained - 1]
            if op.drained == len(op.batches()):
                self.reading.pop(0)
                if self.prefetches.get(op.rid) is op:
                    del self.prefetches[op.rid]
                    self._end(op)
                    done.append(op)
        return done

    def _timed_out(self, op: PrefetchOp) -> bool:
        """`timeout`: steps since issue under virtual latency; under real latency wall time since admission
        first waited for it, past SGLang 0.5.23's 1 s plus 0.25 s per 1,024 tokens asked."""
        if not self.threaded:
            return self.step - op.created >= self.cfg.prefetch_timeout_steps
        now = time.monotonic()
        if op.waiting_since is None:
            op.waiting_since = now
        limit = self.cfg.prefetch_timeout_base_s + self.cfg.prefetch_timeout_per_ki_token_s * len(op.tokens) / 1024
        return now - op.waiting_since > limit

    def prefetch_ready(self, rid: int) -> bool:
        """Whether request `rid` may stop waiting for its prefetch (True without one: it ended, or there was
        none), as SGLang 0.5.23's `_can_terminate_prefetch`: `best_effort` at once and `wait_complete` never
        (its last ack ends it), neither voting; `timeout` as soon as any peer's deadline has expired (MAX over
        PP rank 0's attention peers, relayed: later stages' clocks never decide). With `prefetch_vote` a rank
        without this prefetch votes too (not expired, #38273's dummy vote): without it, a peer that has the
        prefetch waits in the collective alone."""
        self._check_worker()
        op, policy = self.prefetches.get(rid), self.cfg.prefetch_policy
        if op is None:
            if policy == "timeout" and "prefetch_vote" in self.sync.fixes:
                self.sync.agree_prefetch_progress([0], MAX)
            return True
        if policy != "timeout":
            return policy == "best_effort"
        (expired,) = self.sync.agree_prefetch_progress([int(self._timed_out(op))], MAX)
        return bool(expired)

    def take_prefetch(self, rid: int) -> PrefetchOp | None:
        """End request `rid`'s prefetch before its last ack (after `prefetch_ready`): the op, whose `pages` are
        what every rank keeps, and which the read thread no longer writes; None without one."""
        op = self.prefetches.pop(rid, None)
        if op is not None:
            self._end(op)
        return op

    def _end(self, op: PrefetchOp) -> None:
        with op.progress:  # a batch being read finishes first; no later one writes
            op.terminated = True
        self.stats.pages_prefetched += op.pages
        self.stats.cut_short += op.hits is None or (op.pages < op.hits and not op.failed)

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
