"""HiRadixCache: the radix cache plus the host tier (SGLang's `HiRadixCache`, `--enable-hierarchical-cache`).

* **Writes** - `write_through` backs a node up when inserted, `write_through_selective` on its 2nd hit (both with
  its ancestors that have no host copy, top down, so host copies stay contiguous from the root; a batch's writes
  start together when it ends), `write_back` only when evicted. An in-flight copy locks its node until its ack is
  consumed, by a count every rank agreed on (`check_hicache_events`). A copy's slots are reserved on every rank
  or on none (`reserve`).
* **Eviction** - a backed-up leaf evicted from the device loses only its device copy and stays in the tree,
  host-only, for a load back; one not backed up leaves the tree, with its host-only subtree (under write_back it
  is written to the host first). Host eviction removes host-only leaves, least recently used first; under
  write_back it first drops the host copies of nodes also on the device. `make_room` evicts only what a pool
  lacks for a copy, as SGLang does.
* **Load back** - a match whose tail only the host holds loads that chain back to the device, all or nothing,
  from `load_back_threshold` tokens; its nodes are locked until the load ack is consumed (`loading_check`).
* **Prefetch** - a request whose prompt the tree lacks at least `prefetch_threshold` tokens of, below a node with
  a host copy, starts a storage prefetch (storage_tier.py); at admission the pages every rank holds go into the
  tree as host-only nodes below that anchor.

The storage tier moves pages; only this class changes the tree. Each of these is checked against SGLang 0.5.23's
own cache (lab/sglang/replay.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import CacheConfig
from ..distributed.cache_sync import CacheSync
from ..errors import AllocationError
from .base import BaseHiCache
from .cache_controller import HiCacheController
from .memory_pool import PageAllocator
from .radix_cache import RadixCache
from .radix_tree import InsertResult, evict_lru
from .storage_tier import PrefetchOp, StorageTier
from .tree_node import TreeNode
from .utils import match_key

WRITE_THRESHOLD = {"write_through": 1, "write_through_selective": 2}


def make_room(alloc: PageAllocator, num_tokens: int, evict: Callable[[int], int]) -> None:
    """Evict what `alloc` lacks for `num_tokens` (the shortfall, as SGLang's `_execute_kv_backup` and
    `_load_back_transfers` do)."""
    shortfall = num_tokens - alloc.available_size()
    if shortfall > 0:
        evict(shortfall)


# BaseHiCache before RadixCache: BaseHiCache's abstract methods must be met here (the device-only cache's empty
# defaults do not count).
class HiRadixCache(BaseHiCache, RadixCache):
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

    # -- eviction: from the device and from the host -------------------------------------------------

    def _evict_leaf(self, node: TreeNode) -> int:
        """A backed-up leaf loses only its device copy; write_back copies it to the host first. One that still has
        no host copy leaves the tree with its host-only subtree, unless a host copy there is protected (storage
        reads or writes it, or it anchors a prefetch: `host_ref` counts them up to the root): then it stays on the
        device and frees nothing, as SGLang 0.5.23's `drop_subtree_no_host` declines."""
        if not node.backuped and self.cfg.write_policy == "write_back":
            self._write_back(node)
        if not node.backuped and node.host_ref > 0:
            return 0
        freed = len(node.value)
        self._traced_evictions.append([node.id, freed])
        self.device_alloc.free(node.value)
        if node.backuped:
            self.tree.set_device(node, None)
        else:
            self._delete_subtree(node)
        return freed

    def _delete_subtree(self, node: TreeNode) -> None:
        """Remove a node whose device copy is gone and which has no host copy, with its host-only subtree."""
        for child in list(node.children.values()):
            self._delete_subtree(child)
        if node.backuped:
            self.host_alloc.free(node.host_value)
        self.tree.delete_leaf(node)

    def evict_host(self, num_tokens: int) -> int:
        """Free host slots: under write_back, host copies of nodes also on the device first (SGLang 0.5.23's
        `_reclaim_full_host_duplicates`), then host-only leaves, least recently used first."""
        freed = self._reclaim_host_duplicates(num_tokens) if self.cfg.write_policy == "write_back" else 0
        return freed + evict_lru(self.tree.evictable_host_leaves, num_tokens - freed, self._evict_host_leaf)

    def _reclaim_host_duplicates(self, num_tokens: int) -> int:
        """Drop host copies of nodes also on the device, in the order they became duplicates: a first pass
        spares device leaves (the next device eviction would keep their host copy), a second takes them. A node
        a load is filling, or whose own host copy is protected, keeps it."""
        freed, swept = 0, []
        for spare_leaves in (True, False):
            leaves = self.tree.evictable_leaves if spare_leaves else set()
            for node in self.tree.host_duplicates.values():
                if freed >= num_tokens:
                    break
                if node.evicted or not node.backuped:
                    swept.append(node.id)  # lost a tier since it registered
                    continue
                own_protection = node.host_ref - sum(c.host_ref for c in node.children.values())
                if node in leaves or node.load_pending is not None or own_protection > 0:
                    continue
                freed += len(node.host_value)
                self.host_alloc.free(node.host_value)
                node.host_value = None
                swept.append(node.id)
        for node_id in swept:
            self.tree.host_duplicates.pop(node_id, None)
        return freed

    def _evict_host_leaf(self, node: TreeNode) -> int:
        freed = len(node.host_value)
        self.host_alloc.free(node.host_value)
        self.tree.delete_leaf(node)
        return freed

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
        """The agreed `count` acks off the head of `queue`, each once this rank's own copy has finished, checked
        against its source (`verify`): their nodes lose the lock the copy held. More than the queue holds fails as
        SGLang did: "pop from empty list"."""
        acks = []
        for _ in range(count):
            acks.append(queue.pop(0))
            acks[-1].finish_event.synchronize()
            self.controller.verify(acks[-1], name)
        nodes = [ongoing.pop(i) for ack in acks for i in ack.node_ids]
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

    # -- load back -----------------------------------------------------------------------------------

    def load_back(self, node: TreeNode) -> torch.Tensor | None:
        """Queue a load of the evicted chain ending at `node`; its device slots, or None if not worth it."""
        nodes_to_load = []
        while node.evicted:
            nodes_to_load.insert(0, node)
            node = node.parent
        ancestor, last_hit = node, nodes_to_load[-1]
        host_indices = torch.cat([n.host_value for n in nodes_to_load])
        if len(host_indices) < self.cfg.load_back_threshold:
            return None
        # Making room may evict, and a write-back eviction may evict from the host: neither may take the chain.
        self.inc_lock_ref(ancestor)
        for n in nodes_to_load:
            self.tree.protect_host(n)
        make_room(self.device_alloc, len(host_indices), self.evict)
        device_indices = self.reserve(self.device_alloc, len(host_indices), f"the load back of node {last_hit.id}")
        for n in nodes_to_load:
            self.tree.release_host(n)
        self.dec_lock_ref(ancestor)
        if device_indices is None:
            return None
        self.controller.load(host_indices, device_indices, last_hit.id)
        offset = 0
        for n in nodes_to_load:
            self.tree.set_device(n, device_indices[offset : offset + len(n.host_value)])
            n.load_pending = last_hit.id
            offset += len(n.host_value)
        self.ongoing_load_back[last_hit.id] = last_hit
        self.inc_lock_ref(last_hit)
        return device_indices

    def init_load_back(self, last_node: TreeNode) -> tuple[torch.Tensor, TreeNode]:
        if last_node.evicted:
            loaded = self.load_back(last_node)
            if loaded is not None:
                return loaded, last_node
            while last_node.evicted:
                last_node = last_node.parent
        return self.tree.root.value, last_node

    def lock_match(self, match) -> tuple[torch.Tensor, TreeNode]:
        if match.host_hit_length == 0:
            return super().lock_match(match)
        loaded, last = self.init_load_back(match.last_host_node)
        self.inc_lock_ref(last)
        self.dec_lock_ref(match.last_device_node)
        return torch.cat([match.device_indices, loaded]), last

    def start_loading(self):
        return self.controller.start_loading()

    # -- prefetch from storage -----------------------------------------------------------------------

    def prefetch_from_storage(self, rid: int, prompt: list[int]) -> None:
        """Worth it (at least `prefetch_threshold` tokens beyond what the tree holds, below a node with a host
        copy, as SGLang's `_prefetch_kvcache` asks): the tier starts the fetch; the anchor the pages will hang
        below keeps its host copy (host-protected, not locked: the device may evict it) until it ends."""
        if self.storage is None:
            return
        key = match_key(prompt, self.cfg.page_size)
        match = self.match_prefix(key)
        anchor = match.last_host_node
        held = len(match.device_indices) + match.host_hit_length
        if anchor is not self.tree.root and not anchor.backuped:
            return  # storage is written from the host: nothing below an unbacked node can be there
        if len(key) - held >= self.cfg.prefetch_threshold and self.storage.prefetch(rid, anchor, key[held:]):
            self.tree.protect_host(anchor)

    def check_prefetch_progress(self, rid: int) -> int | None:
        """None while request `rid`'s prefetch must still run (agreed); else the tokens it inserted: the pages
        every rank holds, as host-only nodes below its anchor (0 without a prefetch)."""
        if self.storage is None:
            return 0
        if not self.storage.prefetch_ready(rid):
            return None
        op = self.storage.take_prefetch(rid)
        return self.prefetch_loaded.pop(rid, 0) if op is None else self.insert_prefetched(op)

    def insert_prefetched(self, op: PrefetchOp) -> int:
        """An ended prefetch's pages, those every rank counts as arrived, into the tree below its anchor (host
        slots it does not use freed, the anchor released): its tokens."""
        n = op.pages * self.cfg.page_size
        if op.host_slots is not None:
            inserted = self.tree.insert_host(op.anchor, op.tokens[:n], op.host_slots[:n])
            unused = torch.ones(len(op.host_slots), dtype=torch.bool)
            unused[inserted] = False
            if unused.any():
                self.host_alloc.free(op.host_slots[unused])
        self.tree.release_host(op.anchor)
        return n

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
