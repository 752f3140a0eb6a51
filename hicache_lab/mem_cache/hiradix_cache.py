"""HiRadixCache: the radix tree plus the host tier, its write policies, eviction and load-back.

Without a controller this is plain SGLang `RadixCache` (device only: evicted nodes are deleted). With one it
is `HiRadixCache`:

* write policies - `write_through` backs a node up when it is inserted, `write_through_selective` on its
  2nd hit, `write_back` only when it is evicted. An in-flight write locks its node until its ack is consumed.
  A node is backed up only under a backed-up parent, so host copies stay contiguous from the root.
* `evict` - device LRU over unlocked device leaves; a backed-up node keeps its host copy (host-only).
* `evict_host` - host LRU over unprotected host-only leaves; they leave the tree.
* `load_back` - a prefix held only on the host is copied back, all or nothing, if it is at least
  `load_back_threshold` tokens; it stays locked until its load ack is consumed.
* `check_hicache_events` - agree (one collective) how many of the leading finished acks every rank consumes;
  `writing_check` / `loading_check` consume them.
"""

from __future__ import annotations

import heapq

import torch

from ..config import CacheConfig
from ..distributed.cache_sync import CacheSync
from ..errors import PoolExhaustedError
from .cache_controller import HiCacheController
from .memory_pool import PageAllocator
from .radix_tree import MatchResult, RadixTree, TreeNode

WRITE_THRESHOLD = {"write_through": 1, "write_through_selective": 2}


class HiRadixCache:
    def __init__(
        self,
        cfg: CacheConfig,
        device_alloc: PageAllocator,
        sync: CacheSync,
        controller: HiCacheController | None = None,
    ):
        self.cfg = cfg
        self.tree = RadixTree(cfg.page_size)
        self.device_alloc = device_alloc
        self.sync = sync
        self.controller = controller
        self.ongoing_write_through: dict[int, TreeNode] = {}
        self.ongoing_load_back: dict[int, TreeNode] = {}
        self.ready = {"write": 0, "load": 0}  # this rank's own view: leading acks finished at the last check
        self.storage = None  # the L3 tier (l3.StorageTier), attached once built around this tree

    @property
    def enabled(self) -> bool:
        return self.controller is not None

    # -- lookup and insertion ----------------------------------------------------------------------

    def match_prefix(self, key: tuple[int, ...]) -> MatchResult:
        return self.tree.match_prefix(key)

    def insert(self, key: tuple[int, ...], value: torch.Tensor) -> int:
        """Insert a page-aligned key; returns how many leading tokens the tree already held on the device."""
        result = self.tree.insert(key, value)
        if self.enabled:
            for node in result.touched:
                self._inc_hit_count(node)
        return result.prefix_len

    def _inc_hit_count(self, node: TreeNode) -> None:
        if self.cfg.write_policy == "write_back" or node.backuped:
            return
        node.hit_count += 1
        if node.hit_count >= WRITE_THRESHOLD[self.cfg.write_policy]:
            self.write_backup(node)

    def write_backup(self, node: TreeNode) -> int:
        """Start backing `node` up to the host; it stays locked until the write ack is consumed."""
        if node.parent is not self.tree.root and not node.parent.backuped:
            return 0
        host_indices = self._retry(lambda: self.controller.write(node.value, node.id), self.evict_host, len(node.key))
        if host_indices is None:
            return 0
        node.host_value = host_indices
        self.ongoing_write_through[node.id] = node
        self.tree.inc_lock_ref(node)
        return len(host_indices)

    def _write_back(self, node: TreeNode) -> bool:
        """write_back: copy an evicting node to the host now and wait for it."""
        written = self._retry(
            lambda: self.controller.write(node.value, node.id, queue_ack=False),
            self.evict_host,
            len(node.key),
        )
        if written is None:
            return False
        node.host_value, ack = written
        ack.finish_event.synchronize()
        self.controller.verify(ack, "write-back")
        return True

    @staticmethod
    def _retry(attempt, make_room, size: int):
        """Try once, make room for `size` tokens, try again (SGLang's evict-and-retry)."""
        result = attempt()
        if result is None:
            make_room(size)
            result = attempt()
        return result

    # -- acks --------------------------------------------------------------------------------------

    @staticmethod
    def _leading_finished(queue) -> int:
        """Finished acks at the head of a FIFO queue; the first unfinished one stops the count."""
        count = 0
        while count < len(queue) and queue[count].finish_event.query():
            count += 1
        return count

    def _consume_acks(self, queue: list, name: str, ongoing: dict[int, TreeNode], count: int) -> list[TreeNode]:
        nodes = []
        for _ in range(count):  # more than this rank holds fails as SGLang did: "pop from empty list"
            ack = queue.pop(0)
            ack.finish_event.synchronize()  # where this rank's own copy is not done yet, wait for it
            self.controller.verify(ack, name)
            for node_id in ack.node_ids:
                nodes.append(ongoing.pop(node_id))
                self.tree.dec_lock_ref(nodes[-1])
        return nodes

    def writing_check(self, count: int) -> None:
        """Consume `count` write acks: their nodes become unlocked (and evictable to host-only) and, with a
        storage tier, are backed up to it."""
        for node in self._consume_acks(self.controller.ack_write_queue, "write", self.ongoing_write_through, count):
            if self.storage is not None:
                self.storage.backup(node)

    def loading_check(self, count: int) -> None:
        """Consume `count` load acks: loaded nodes lose the lock their load held."""
        self._consume_acks(self.controller.ack_load_queue, "load", self.ongoing_load_back, count)

    def copies_in_flight(self) -> bool:
        """Unconsumed acks hold locks and prefetches hold requests back: until they end, a stalled schedule
        may still move."""
        if not self.enabled:
            return False
        storage_busy = self.storage is not None and bool(self.storage.prefetches or self.storage.backups)
        return storage_busy or bool(self.controller.ack_write_queue or self.controller.ack_load_queue)

    def check_hicache_events(self) -> tuple[int, int]:
        """Start of every step: how many write acks, load acks (and storage backups) every rank consumes, agreed
        in one collective; then consume them. Returns (write, load) consumed."""
        if not self.enabled:
            return 0, 0
        self.ready = {
            "write": self._leading_finished(self.controller.ack_write_queue),
            "load": self._leading_finished(self.controller.ack_load_queue),
        }
        local = dict(self.ready)
        if self.storage is not None:
            local["backup"] = self.storage.backups_done()
        if not self.sync.polls_locally():
            local = dict.fromkeys(local, 0)
        agreed = self.sync.agree_ack_counts(local)
        self.writing_check(agreed["write"])
        self.loading_check(agreed["load"])
        if self.storage is not None:
            self.storage.release_backups(agreed["backup"])
        return agreed["write"], agreed["load"]

    def prefetch_from_storage(self, rid: int, prompt: list[int]) -> None:
        """A request arrived: fetch from storage what of its prompt the tree does not hold (if worth it)."""
        ps = self.cfg.page_size
        key = tuple(prompt[: (len(prompt) - 1) // ps * ps])
        match = self.match_prefix(key)
        anchor = match.last_host_node if match.host_hit_length else match.last_device_node
        held = len(match.device_indices) + match.host_hit_length
        if len(key) - held >= self.cfg.prefetch_threshold:
            self.storage.prefetch(rid, anchor, key[held:], self.evict_host)

    def flush(self) -> None:
        """Drop every cached prefix from device and host (between rounds, nothing running): later hits must
        come from storage. Copies in flight are finished and consumed first, alike on every rank."""
        if self.enabled:
            self.writing_check(len(self.controller.ack_write_queue))
            self.loading_check(len(self.controller.ack_load_queue))
        if self.storage is not None:
            self.storage.finish_all()
        for node in list(self.tree.nodes()):
            assert node.lock_ref == 0 and node.host_ref == 0, "flush while a request or copy holds the cache"
            if not node.evicted:
                self.device_alloc.free(node.value)
            if node.backuped:
                self.controller.host_alloc.free(node.host_value)
        self.tree.reset()

    # -- eviction ----------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots if unlocked nodes allow; returns how many were freed."""
        leaves = self.tree.device_leaves()
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            parent = node.parent
            if self.enabled and not node.backuped and self.cfg.write_policy == "write_back":
                self._write_back(node)
            freed += len(node.value)
            self.device_alloc.free(node.value)
            if node.backuped:
                node.value = None
            else:
                self._delete_subtree(node)
            if (
                parent is not self.tree.root
                and parent.lock_ref == 0
                and all(c.evicted for c in parent.children.values())
            ):
                heapq.heappush(leaves, parent)
        return freed

    def _delete_subtree(self, node: TreeNode) -> None:
        """Remove a node whose device copy is gone and which has no host copy, with its host-only subtree."""
        for child in list(node.children.values()):
            self._delete_subtree(child)
        if node.backuped:
            self.controller.host_alloc.free(node.host_value)
        self.tree.delete_leaf(node)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots from host-only leaves; returns how many were freed."""
        leaves = self.tree.host_leaves()
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            freed += len(node.host_value)
            self.controller.host_alloc.free(node.host_value)
            self.tree.delete_leaf(node)
            parent = node.parent
            if parent is not self.tree.root and parent.evicted and not parent.children and parent.host_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def alloc_device(self, num_tokens: int) -> torch.Tensor:
        """Device slots for `num_tokens` (whole pages), evicting if needed; PoolExhaustedError if impossible."""
        slots = self.device_alloc.alloc(num_tokens)
        if slots is None:
            self.evict(num_tokens - self.device_alloc.available_size())
            slots = self.device_alloc.alloc(num_tokens)
        if slots is None:
            raise PoolExhaustedError(
                f"device pool: {num_tokens} tokens asked, {self.device_alloc.available_size()} free and "
                f"{self.tree.evictable_size()} evictable: raise --max-total-tokens or lower --max-running-requests"
            )
        return slots

    # -- load back ---------------------------------------------------------------------------------

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
        self.tree.inc_lock_ref(ancestor)
        for n in nodes_to_load:
            self.tree.protect_host(n)
        device_indices = self._retry(
            lambda: self.controller.load(host_indices, last_hit.id), self.evict, len(host_indices)
        )
        for n in nodes_to_load:
            self.tree.release_host(n)
        self.tree.dec_lock_ref(ancestor)
        if device_indices is None:
            return None
        offset = 0
        for n in nodes_to_load:
            n.value = device_indices[offset : offset + len(n.host_value)]
            offset += len(n.host_value)
        self.ongoing_load_back[last_hit.id] = last_hit
        self.tree.inc_lock_ref(last_hit)
        return device_indices

    def init_load_back(self, last_node: TreeNode) -> tuple[torch.Tensor, TreeNode]:
        """Load back the host-only tail of a match ending at `last_node` (a match's `last_host_node`)."""
        if last_node.evicted:
            loaded = self.load_back(last_node)
            if loaded is not None:
                return loaded, last_node
            while last_node.evicted:
                last_node = last_node.parent
        return self.tree.root.value, last_node

    # -- checks ------------------------------------------------------------------------------------

    def check_integrity(self, held_by_requests: int = 0) -> None:
        """Tree invariants, plus: every device slot is free, in the tree, or held by a running request."""
        self.tree.check_integrity()
        alloc = self.device_alloc
        accounted = alloc.available_size() + self.tree.device_size() + held_by_requests
        assert accounted == alloc.size, f"device slots leaked: {accounted} accounted of {alloc.size}"
        if self.enabled:
            host = self.controller.host_alloc
            assert host.available_size() + self.tree.host_size() == host.size, "host slots leaked"
