"""The L3 tier: backups from host to storage, and prefetches from storage to host.

* **Backup** - once a node's host write is acknowledged, its pages go to storage. The host copy is protected
  (`host_ref`) until the backup is acknowledged; acks are consumed by an agreed count, like write acks. CP
  peers hold identical KV, so page i is written by CP rank i mod cp only; the others skip it.
* **Prefetch** - when a request arrives, the part of its prompt beyond what the tree holds is looked up in
  storage: the hit count (leading pages present) is agreed by MIN, and below the threshold the prefetch is
  revoked. Otherwise host slots are reserved, the anchor node is protected, and pages are read in batches of
  128, in order.
  `check_prefetch_progress` (when the request is scheduled) agrees whether to stop waiting (MAX of "not
  ready") and how many pages arrived (MIN), inserts those as host-only nodes and frees the rest.

Storage work is step-driven: each batch read or backup completes a seeded number of steps after it was issued
(drawn per rank, like virtual copies), and really moves bytes through the backend when it completes; so runs
are deterministic and ranks see different progress, which is what the agreements are for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .config import CacheConfig
from .memory import HostKVPool, PageAllocator
from .radix import RadixTree, TreeNode, page_hashes
from .storage import FileStorage, MooncakeStorage
from .sync import MAX, CacheSync

STORAGE_BATCH_PAGES = 128  # pages per storage read (SGLang's default I/O batch)


@dataclass(eq=False)
class BackupOp:
    node: TreeNode
    due: int


@dataclass(eq=False)
class PrefetchOp:
    anchor: TreeNode  # the deepest matched node: fetched pages hang below it
    tokens: tuple[int, ...]  # the prompt tokens beyond the anchor that storage holds
    hashes: list[str]
    host_slots: torch.Tensor
    created: int
    due: list[int]  # per batch of STORAGE_BATCH_PAGES pages: the step its read completes (non-decreasing)
    arrived: int = 0  # leading pages read into host slots
    failed: bool = False  # a page could not be read: no more arrive


@dataclass
class StorageStats:
    prefetches: int = 0
    revoked: int = 0
    pages_prefetched: int = 0
    pages_backed_up: int = 0
    per_request: dict[int, int] = field(default_factory=dict)  # rid -> tokens inserted from storage


class StorageTier:
    def __init__(
        self,
        cfg: CacheConfig,
        backend: FileStorage | MooncakeStorage,
        tree: RadixTree,
        host_pool: HostKVPool,
        host_alloc: PageAllocator,
        sync: CacheSync,
        cp_rank: int,
        cp_size: int,
        seed: int,
        rank: int,
    ):
        self.cfg, self.backend, self.tree = cfg, backend, tree
        self.host_pool, self.host_alloc, self.sync = host_pool, host_alloc, sync
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.rng = np.random.default_rng([seed, rank, 3])
        self.step = 0
        self.backups: list[BackupOp] = []  # FIFO, acknowledged by an agreed count
        self.prefetches: dict[int, PrefetchOp] = {}  # by request id
        self.stats = StorageStats()

    def _pages(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return list(slots.split(self.cfg.page_size))

    def _due(self, previous: int) -> int:
        return max(previous, self.step + int(self.rng.integers(0, self.cfg.max_copy_delay_steps + 1)))

    # -- backup ------------------------------------------------------------------------------------

    def backup(self, node: TreeNode) -> None:
        """Queue `node`'s pages for storage; its host copy stays protected until the ack is consumed."""
        self.tree.protect_host(node)
        self.backups.append(BackupOp(node, self._due(self.backups[-1].due if self.backups else 0)))

    def _write(self, op: BackupOp) -> None:
        pages = self._pages(op.node.host_value)
        mine = [i for i in range(len(pages)) if i % self.cp_size == self.cp_rank]
        written = self.backend.batch_set([op.node.hashes[i] for i in mine], self.host_pool, [pages[i] for i in mine])
        self.stats.pages_backed_up += written
        op.due = -1  # done

    def drain_backups(self) -> int:
        """Consume the agreed number of finished backups (waiting for this rank's own where needed)."""
        done = 0
        while done < len(self.backups) and self.backups[done].due < 0:
            done += 1
        count = self.sync.agree_ack_count(done if self.sync.polls_locally() else 0, "backup")
        for _ in range(count):
            op = self.backups.pop(0)
            if op.due >= 0:
                self._write(op)
            self.tree.release_host(op.node)
        return count

    # -- prefetch ----------------------------------------------------------------------------------

    def prefetch(self, rid: int, anchor: TreeNode, tokens: tuple[int, ...], make_room) -> None:
        """Start fetching `tokens` (page-aligned, following `anchor`) if storage holds enough of them."""
        ps = self.cfg.page_size
        hashes = page_hashes(tokens, ps, anchor.hashes[-1] if anchor.hashes else "")
        local_hits = self.backend.batch_exists(hashes)
        (hits,) = self.sync.agree_storage([local_hits])
        if hits * ps < self.cfg.prefetch_threshold:
            self.stats.revoked += 1
            return
        slots = self.host_alloc.alloc(hits * ps)
        if slots is None:
            make_room(hits * ps)
            slots = self.host_alloc.alloc(hits * ps)
        if slots is None:
            self.stats.revoked += 1
            return
        self.tree.protect_host(anchor)
        self.tree.inc_lock_ref(anchor)
        due, previous = [], 0
        for _ in range(0, hits, STORAGE_BATCH_PAGES):
            previous = self._due(previous)
            due.append(previous)
        self.prefetches[rid] = PrefetchOp(anchor, tokens[: hits * ps], hashes[:hits], slots, self.step, due)
        self.stats.prefetches += 1

    def _read_due(self, op: PrefetchOp) -> None:
        pages = self._pages(op.host_slots)
        while not op.failed and op.arrived < len(pages) and op.due[op.arrived // STORAGE_BATCH_PAGES] <= self.step:
            batch = slice(op.arrived, op.arrived + STORAGE_BATCH_PAGES)
            read = self.backend.batch_get(op.hashes[batch], self.host_pool, pages[batch])
            op.arrived += read
            op.failed = read < len(pages[batch])  # a missing or damaged page ends the prefetch there

    def check_prefetch_progress(self, rid: int) -> bool:
        """Whether request `rid` may be scheduled: True once its prefetch (if any) has ended and the pages
        every rank holds are in the tree as host-only nodes."""
        op = self.prefetches.get(rid)
        if op is None:
            return True
        complete = op.failed or op.arrived == len(op.hashes)
        if self.cfg.prefetch_policy == "best_effort":
            ready = True
        elif self.cfg.prefetch_policy == "wait_complete":
            ready = complete
        else:
            ready = complete or self.step - op.created >= self.cfg.prefetch_timeout_steps
        (not_ready,) = self.sync.agree_storage([int(not ready)], MAX)
        if not_ready:
            return False
        (pages,) = self.sync.agree_storage([op.arrived])
        del self.prefetches[rid]
        self._insert(op, pages)
        self.stats.per_request[rid] = pages * self.cfg.page_size
        return True

    def _insert(self, op: PrefetchOp, pages: int) -> None:
        ps = self.cfg.page_size
        inserted = self.tree.insert_host(op.anchor, op.tokens[: pages * ps], op.host_slots[: pages * ps])
        unused = torch.ones(len(op.host_slots), dtype=torch.bool)
        unused[inserted] = False
        if unused.any():
            self.host_alloc.free(op.host_slots[unused])
        self.tree.release_host(op.anchor)
        self.tree.dec_lock_ref(op.anchor)
        self.stats.pages_prefetched += pages

    def summary(self) -> dict:
        return {
            "prefetches": self.stats.prefetches,
            "revoked": self.stats.revoked,
            "pages_prefetched": self.stats.pages_prefetched,
            "pages_backed_up": self.stats.pages_backed_up,
        }

    # -- time --------------------------------------------------------------------------------------

    def advance(self, step: int) -> None:
        """Complete every storage read and write due by `step`."""
        self.step = step
        for op in self.backups:
            if 0 <= op.due <= step:
                self._write(op)
        for op in self.prefetches.values():
            self._read_due(op)

    def finish_all(self) -> None:
        """Between rounds (no request waiting): complete and release every backup."""
        assert not self.prefetches, "prefetches outlive their requests"
        for op in self.backups:
            if op.due >= 0:
                self._write(op)
            self.tree.release_host(op.node)
        self.backups = []
