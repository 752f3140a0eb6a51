"""What the host tier brings back (`HiRadixLoadBack`, a mixin of `HiRadixCache`): host to device, storage to host.

* **Load back** - a match whose tail only the host holds loads that chain back to the device, all or nothing,
  from `load_back_threshold` tokens: device slots are reserved on every rank or none (`HiRadixCache.reserve`),
  the copy is queued (`HiCacheController.load`, started with the batch by `start_loading`) and its nodes are
  locked until the load ack is consumed (`HiRadixCache.loading_check`).
* **Prefetch** - a request whose prompt the tree lacks at least `prefetch_threshold` tokens of, below a node with
  a host copy, starts a storage prefetch (storage_prefetch.py); at admission the pages every rank holds go into
  the tree as host-only nodes below that anchor. The storage tier moves pages; only this class inserts them.
"""

from __future__ import annotations

import torch

from ..config import CacheConfig
from .cache_controller import HiCacheController
from .hiradix_eviction import make_room
from .memory_pool import PageAllocator
from .radix_tree import RadixTree
from .storage_prefetch import PrefetchOp
from .storage_tier import StorageTier
from .tree_node import TreeNode
from .utils import match_key


class HiRadixLoadBack:
    """`HiRadixCache`'s load back and prefetch insertion; the cache sets the attributes below and supplies
    `reserve`, `evict`, `match_prefix` and the locks."""

    cfg: CacheConfig
    tree: RadixTree
    device_alloc: PageAllocator
    host_alloc: PageAllocator
    controller: HiCacheController
    storage: StorageTier | None
    ongoing_load_back: dict[int, TreeNode]  # by the id of a load's last node, until its ack is consumed
    prefetch_loaded: dict[int, int]  # by request id: tokens its prefetch inserted when its last ack was consumed

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
