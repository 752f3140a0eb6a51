"""HiRadixCache: the radix cache plus the host tier (SGLang's `HiRadixCache`, `--enable-hierarchical-cache`).

Write policies: `write_through` backs a node up when inserted, `write_through_selective` on its 2nd hit (both
with its ancestors that have no host copy, top down, so host copies stay contiguous from the root; a batch's
writes start together when it ends), `write_back` only when evicted. An in-flight copy locks its node until its ack is
consumed, by a count every rank agreed on (`check_hicache_events`). A copy's slots are reserved on every rank or
on none (`reserve`). Eviction is hiradix_eviction.py's; load back and the insertion of prefetched pages are
hiradix_load_back.py's. The storage tier moves pages; only this class and its mixins change the tree. Each of
these is checked against SGLang 0.5.23's own cache (lab/sglang/conformance.py).
"""

from __future__ import annotations

import torch

from ..config import CacheConfig
from ..distributed.cache_sync import CacheSync
from ..errors import AllocationError
from .base import BaseHiCache
from .cache_controller import HiCacheController
from .hiradix_eviction import HiRadixEviction, make_room
from .hiradix_load_back import HiRadixLoadBack
from .memory_pool import PageAllocator
from .radix_cache import RadixCache
from .radix_tree import InsertResult
from .storage_tier import StorageTier
from .tree_node import TreeNode

WRITE_THRESHOLD = {"write_through": 1, "write_through_selective": 2}


# The mixins, then BaseHiCache before RadixCache: BaseHiCache's abstract methods must be met here or in a mixin
# (the device-only cache's empty defaults do not count).
class HiRadixCache(HiRadixEviction, HiRadixLoadBack, BaseHiCache, RadixCache):
    def __init__(
        self,
        cfg: CacheConfig,
        device_alloc: PageAllocator,
        sync: CacheSync,
        controller: HiCacheController,
        storage: StorageTier | None = None,
    ):
        super().__init__(cfg, device_alloc)
        self.sync, self.controller, self.storage = sync, controller, storage
        self.host_alloc = controller.host_alloc
        self.ongoing_write_through: dict[int, TreeNode] = {}
        self.ongoing_load_back: dict[int, TreeNode] = {}
        self.prefetch_loaded: dict[int, int] = {}
        self.ready = (0, 0)  # this rank's own view: leading (write, load) acks finished at the last check
        self._observed_writes = self._observed_loads = 0  # write and load tokens started as of the last step record
        self._traced_unlocks: list[list[int]] = []  # [node id, tokens] unlocked by consumed acks since then
        self._traced_evictions: list[list[int]] = []  # [node id, tokens] evicted from the device since then

    # -- insertion and write-through -----------------------------------------------------------------

    def _insert(self, key: tuple[int, ...], value: torch.Tensor, inserted_len: int = 0) -> InsertResult:
        """Insert; every node on the path ending beyond `inserted_len` counts a hit (SGLang 0.5.23: the nodes a
        request inserted before were counted then)."""
        result = self.tree.insert(key, value)
        end = 0
        for node in result.touched:
            end += len(node.key)
            if end > inserted_len:
                self._inc_hit_count(node)
        return result

    def _inc_hit_count(self, node: TreeNode) -> None:
        if self.cfg.write_policy == "write_back" or node.backuped:
            return
        node.hit_count += 1
        if node.hit_count >= WRITE_THRESHOLD[self.cfg.write_policy]:
            self.write_backup(node)

    def write_backup(self, node: TreeNode) -> int:
        """Start backing `node` up to the host, after each ancestor without a host copy, top down (SGLang 0.5.23's
        `_build_backup_kv_action`: host copies stay contiguous from the root), stopping at the first that finds
        no room. Each stays locked until its write ack is consumed. Returns the tokens of `node`'s copy (0: none)."""
        chain = [node]
        while chain[-1].parent is not self.tree.root and not chain[-1].parent.backuped:
            chain.append(chain[-1].parent)
        written = 0
        for part in reversed(chain):
            written = self._start_write(part)
            if not written:
                return 0
        return written

    def _start_write(self, node: TreeNode) -> int:
        make_room(self.host_alloc, len(node.key), self.evict_host)
        host_indices = self.reserve(self.host_alloc, len(node.key), f"the host write of node {node.id}")
        if host_indices is None:
            return 0
        self.controller.write(host_indices, node.value, node.id)
        node.host_value, node.write_pending = host_indices, node.id
        self.ongoing_write_through[node.id] = node
        self.inc_lock_ref(node)
        return len(host_indices)

    def _write_back(self, node: TreeNode) -> None:
        """write_back: copy an evicting node to the host now and wait for it (if the host has room)."""
        make_room(self.host_alloc, len(node.key), self.evict_host)
        host_indices = self.reserve(self.host_alloc, len(node.key), f"the write-back of node {node.id}")
        if host_indices is not None:
            node.host_value = host_indices
            ack = self.controller.write(host_indices, node.value, node.id, False)
            ack.finish_event.synchronize()
            self.controller.verify(ack, "write-back")
            self.tree.track_duplicate(node)  # for the moment until its device copy goes
            if self.storage is not None:  # SGLang's _evict_write_back -> write_backup_storage
                self.storage.backup(node)
                self.tree.protect_host(node)

    # -- slots for copies ----------------------------------------------------------------------------

    def allocate(self, alloc: PageAllocator, num_tokens: int) -> torch.Tensor | None:
        """This rank's own allocation for a copy (where `--fault alloc-fail` makes one fail)."""
        return alloc.alloc(num_tokens)

    def reserve(self, alloc: PageAllocator, num_tokens: int, what: str) -> torch.Tensor | None:
        """Slots for a copy, on every rank or on none (`CacheSync.agree_allocation`; SGLang #31425's reserve,
        agree, then commit or abort): where a peer failed, this rank frees what it got. A later stage told to
        go ahead by PP rank 0 while its own allocation failed retries once, and otherwise stops the run."""
        slots = self.allocate(alloc, num_tokens)
        if self.sync.agree_allocation(slots is not None) == (slots is not None):
            return slots
        if slots is not None:
            alloc.free(slots)
            return None
        slots = self.allocate(alloc, num_tokens)
        if slots is None:
            raise AllocationError(
                f"{alloc.name} has no room for {what} ({num_tokens} tokens, {alloc.available_size()} free), which "
                "PP rank 0 and its peers agreed to start; a later stage cannot refuse it (the pool is full here alone: "
                "a fault, or pools of different sizes; give every rank the same --max-total-tokens and --hicache-ratio)"
            )
        return slots

    # -- acks ----------------------------------------------------------------------------------------

    def _consume_acks(self, queue: list, name: str, ongoing: dict[int, TreeNode], count: int) -> list[TreeNode]:
        """The agreed `count` acks of `queue`: their nodes lose the lock the copy held."""
        nodes = [ongoing.pop(i) for ack in self.controller.pop_acks(queue, name, count) for i in ack.node_ids]
        for node in nodes:
            self.dec_lock_ref(node)
        self._traced_unlocks.extend([n.id, len(n.key)] for n in nodes)
        return nodes

    def writing_check(self, count: int) -> None:
        """Consume `count` write acks: their nodes become unlocked (and evictable to host-only) and are
        published (`publish_write`). A `--sync-impl writing_check=...` replaces this method (notebook 06)."""
        for node in self._consume_acks(self.controller.ack_write_queue, "write", self.ongoing_write_through, count):
            self.publish_write(node)

    def publish_write(self, node: TreeNode) -> None:
        """A node whose host write is acknowledged, and every upper half split off it while the write was in
        flight (SGLang's publish_node_ids: the whole pre-split chain, prefix first): settled on the host and, with
        a storage tier, backed up to it."""
        chain = [node]
        while chain[-1].parent.write_pending == node.id:
            chain.append(chain[-1].parent)
        for part in reversed(chain):
            part.write_pending = None
            self.tree.track_duplicate(part)
            if self.storage is not None:
                self.storage.backup(part)

    def _consume_writes(self, count: int) -> None:
        """`writing_check` (a `--sync-impl` may replace it), then protect the host copy of each node it handed to
        the storage tier from host eviction, until that backup is consumed."""
        queued = len(self.storage.backups) if self.storage is not None else 0
        self.writing_check(count)
        for op in self.storage.backups[queued:] if self.storage is not None else ():
            self.tree.protect_host(op.node)

    def loading_check(self, count: int) -> None:
        """Consume `count` load acks: loaded nodes lose the lock their load held, and the nodes each load
        filled are settled on both tiers, bottom up (SGLang's `finish_load_back`)."""
        for last_hit in self._consume_acks(self.controller.ack_load_queue, "load", self.ongoing_load_back, count):
            node = last_hit
            while node is not self.tree.root:
                if node.load_pending == last_hit.id:
                    node.load_pending = None
                    self.tree.track_duplicate(node)
                node = node.parent

    def flush_pending_backups(self) -> None:
        self.controller.start_writing()

    def check_hicache_events(self) -> tuple[int, int]:
        """Every step: wait for the previous step's relay sends (SGLang's `_drain_async_work`, #28916), start
        the writes still queued, agree in one collective how many leading write, load (and, with storage, hit
        query, prefetch batch and backup) acks every rank consumes (only PP rank 0's polls count with the PP
        fix), then consume exactly that many."""
        self.sync.drain_async_work()
        self.flush_pending_backups()
        self.ready = (
            self.controller.finished_acks(self.controller.ack_write_queue),
            self.controller.finished_acks(self.controller.ack_load_queue),
        )
        local = {"write": self.ready[0], "load": self.ready[1]}
        in_flight = {"write": len(self.ongoing_write_through), "load": len(self.ongoing_load_back)}
        if self.storage is not None:
            local["prefetch_hit"] = self.storage.queries_done()
            local["prefetch"] = self.storage.prefetch_acks_done()
            local["backup"] = self.storage.backups_done()
            reading = sum(len(op.batches()) - op.drained for op in self.storage.reading)
            in_flight.update(prefetch_hit=len(self.storage.queries), prefetch=reading, backup=len(self.storage.backups))
        if not self.sync.polls_locally():
            local = dict.fromkeys(local, 0)
        agreed = self.sync.agree_ack_counts(local, in_flight)
        self._consume_writes(agreed["write"])
        self.loading_check(agreed["load"])
        if self.storage is not None:
            revoked = self.storage.take_queries(agreed["prefetch_hit"], self.evict_host, self.allocate)
            for op in self.storage.take_prefetch_acks(agreed["prefetch"]):  # SGLang's _drain_ack_prefetch
                self.prefetch_loaded[op.rid] = self.insert_prefetched(op)
            for node in revoked + self.storage.release_backups(agreed["backup"]):
                self.tree.release_host(node)
        return agreed["write"], agreed["load"]

    def ready_acks(self) -> tuple[int, int]:
        return self.ready

    def copies_in_flight(self) -> bool:
        c = self.controller
        return self.waits_on_storage() or bool(c.write_queue or c.ack_write_queue or c.ack_load_queue)

    def waits_on_storage(self) -> bool:
        return self.storage is not None and self.storage.busy()

    # -- flush, time and observation -----------------------------------------------------------------

    def flush(self) -> None:
        """Copies in flight are finished and consumed first, alike on every rank; then host and device go."""
        self.flush_pending_backups()
        self._consume_writes(len(self.controller.ack_write_queue))
        self.loading_check(len(self.controller.ack_load_queue))
        if self.storage is not None:
            for node in self.storage.finish_all():
                self.tree.release_host(node)
            self.sync.leave_flush_together()
        super().flush()

    def _free_node(self, node: TreeNode) -> None:
        if not node.evicted:
            self.device_alloc.free(node.value)
        if node.backuped:
            self.host_alloc.free(node.host_value)

    def advance(self, step: int) -> None:
        self.controller.engine.advance(step)
        if self.storage is not None:
            self.storage.advance(step)

    def check_integrity(self, held_by_requests: int = 0) -> None:
        super().check_integrity(held_by_requests)
        assert self.host_alloc.available_size() + self.tree.host_size() == self.host_alloc.size, "host slots leaked"

    def host_free(self) -> int:
        return self.host_alloc.available_size()

    def observe(self) -> dict:
        c = self.controller
        written, self._observed_writes = c.write_tokens_started - self._observed_writes, c.write_tokens_started
        loaded, self._observed_loads = c.load_tokens_started - self._observed_loads, c.load_tokens_started
        unlocked, evicted = self._traced_unlocks, self._traced_evictions
        self._traced_unlocks, self._traced_evictions = [], []
        return {
            **super().observe(),
            "host_write_tokens": written,
            "host_load_tokens": loaded,
            "unlocked_nodes": unlocked,
            "evicted_nodes": evicted,
        }

    def copy_check(self):
        return self.controller.copy_check

    def summary(self) -> dict:
        return {"storage": {**self.storage.summary(), **self.storage.backend.stats}} if self.storage else {}

    def close(self) -> None:
        self.controller.engine.close()
        if self.storage is not None:
            self.storage.close()
