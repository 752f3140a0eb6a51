"""HiRadixCache's eviction (`HiRadixEviction`, a mixin of `HiRadixCache`): from the device and from the host.

A backed-up leaf evicted from the device loses only its device copy and stays in the tree, host-only, for a
load back; one not backed up leaves the tree, with its host-only subtree (under write_back it is written to the
host first, `HiRadixCache._write_back`). Host eviction removes host-only leaves, least recently used first;
under write_back it first drops the host copies of nodes also on the device. `make_room` evicts only what a
pool lacks for a copy, as SGLang does.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import CacheConfig
from .memory_pool import PageAllocator
from .radix_tree import RadixTree, evict_lru
from .tree_node import TreeNode


def make_room(alloc: PageAllocator, num_tokens: int, evict: Callable[[int], int]) -> None:
    """Evict what `alloc` lacks for `num_tokens` (the shortfall, as SGLang's `_execute_kv_backup` and
    `_load_back_transfers` do)."""
    shortfall = num_tokens - alloc.available_size()
    if shortfall > 0:
        evict(shortfall)


class HiRadixEviction:
    """`HiRadixCache`'s eviction; the cache sets the attributes below and supplies `_write_back`."""

    cfg: CacheConfig
    tree: RadixTree
    device_alloc: PageAllocator
    host_alloc: PageAllocator
    _traced_evictions: list[list[int]]  # [node id, tokens] evicted from the device since the last step record

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
