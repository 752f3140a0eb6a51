"""RadixCache: the device-only prefix cache (SGLang's `RadixCache`; `--enable-hierarchical-cache` off).

The radix tree (radix_tree.py) keeps the structure; this class adds the device pool's slots and the operations
the scheduler calls: match, lock, insert a finished request, evict least recently used leaves (an evicted node
leaves the tree), allocate with eviction. `HiRadixCache` (hiradix_cache.py) extends it with the host tier, at
the points `BasePrefixCache` leaves empty (mem_cache/base.py).
"""

from __future__ import annotations

import torch

from ..config import CacheConfig
from ..errors import PoolExhaustedError
from .base import BasePrefixCache
from .memory_pool import PageAllocator
from .radix_tree import InsertResult, MatchResult, RadixTree, evict_lru
from .tree_node import TreeNode
from .utils import page_floor


class RadixCache(BasePrefixCache):
    def __init__(self, cfg: CacheConfig, device_alloc: PageAllocator):
        self.cfg = cfg
        self.tree = RadixTree(cfg.page_size)
        self.device_alloc = device_alloc

    # -- lookup, locks and insertion -----------------------------------------------------------------

    def match_prefix(self, key: tuple[int, ...]) -> MatchResult:
        return self.tree.match_prefix(key)

    def insert(self, key: tuple[int, ...], value: torch.Tensor, inserted_len: int = 0) -> int:
        return self._insert(key, value, inserted_len).prefix_len

    def _insert(self, key: tuple[int, ...], value: torch.Tensor, inserted_len: int = 0) -> InsertResult:
        return self.tree.insert(key, value)

    def inc_lock_ref(self, node: TreeNode) -> None:
        self.tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        self.tree.dec_lock_ref(node)

    def device_room(self) -> int:
        return self.device_alloc.available_size() + self.tree.evictable_size()

    def lock_match(self, match: MatchResult) -> tuple[torch.Tensor, TreeNode]:
        return match.device_indices, match.last_device_node

    def _insert_req(self, tokens, slots, prefix_len: int, inserted_len: int) -> InsertResult:
        """Insert a request's whole pages `tokens` (its `slots` for them first, `prefix_len` cached ones leading);
        free its copies of the tokens the tree already held beyond those."""
        inserted = self._insert(tokens, slots[: len(tokens)], inserted_len)
        if inserted.prefix_len > prefix_len:
            self.device_alloc.free(slots[prefix_len : inserted.prefix_len])
        return inserted

    def cache_unfinished_req(self, tokens, slots, prefix_len: int, last_node, inserted_len: int):
        inserted = self._insert_req(tokens, slots, prefix_len, inserted_len)
        node = inserted.touched[-1] if inserted.touched else self.tree.root
        self.inc_lock_ref(node)
        self.dec_lock_ref(last_node)
        return self.tree.path_slots(node), node

    def free_request(self, slots: torch.Tensor, prefix_len: int, last_node) -> None:
        if len(slots) > prefix_len:
            self.device_alloc.free(slots[prefix_len:])
        self.dec_lock_ref(last_node)

    def cache_finished_req(self, tokens, slots, prefix_len: int, last_node, inserted_len: int = 0, prompt_len: int = 0):
        aligned = len(tokens)
        inserted = self._insert_req(tokens, slots, prefix_len, inserted_len)
        prompt = page_floor(prompt_len, self.cfg.page_size)
        if 0 < prompt < aligned:  # the answer's own leaf; nothing to free, nothing counts
            self._insert(tokens[:prompt], slots[:prompt], prompt)
        if len(slots) > aligned:
            self.device_alloc.free(slots[aligned:])
        self.dec_lock_ref(last_node)
        return inserted.matched

    # -- eviction and allocation ---------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        return evict_lru(self.tree.evictable_leaves, num_tokens, self._evict_leaf)

    def _evict_leaf(self, node: TreeNode) -> int:
        """Free a device leaf's slots; here it leaves the tree. Returns the slots freed."""
        freed = len(node.key)  # a slot per token
        self.device_alloc.free(node.value)
        self.tree.delete_leaf(node)
        return freed

    def evict_to_free(self, num_tokens: int) -> bool:
        shortfall = num_tokens - self.device_alloc.available_size()
        if shortfall > 0:
            self.evict(shortfall)
        return self.device_alloc.available_size() >= num_tokens

    def alloc_device(self, num_tokens: int, demand: int | None = None) -> torch.Tensor:
        self.evict_to_free(max(num_tokens, demand or 0))
        slots = self.device_alloc.alloc(num_tokens)
        if slots is None:
            raise PoolExhaustedError(
                f"device pool: {num_tokens} tokens asked, {self.device_alloc.available_size()} free and "
                f"{self.tree.evictable_size()} evictable: raise --max-total-tokens or lower --max-running-requests"
            )
        return slots

    def flush(self) -> None:
        """Drop every cached prefix (between rounds, nothing running): later hits must come from storage."""
        for node in list(self.tree.nodes()):
            assert node.lock_ref == 0 and node.host_ref == 0, "flush while a request or copy holds the cache"
            self._free_node(node)
        self.tree.reset()

    def _free_node(self, node: TreeNode) -> None:
        self.device_alloc.free(node.value)

    # -- checks and observation ----------------------------------------------------------------------

    def check_integrity(self, held_by_requests: int = 0) -> None:
        """Tree invariants, plus: every device slot is free, in the tree, or held by a running request."""
        self.tree.check_integrity()
        alloc = self.device_alloc
        accounted = alloc.available_size() + self.tree.device_size() + held_by_requests
        assert accounted == alloc.size, f"device slots leaked: {accounted} accounted of {alloc.size}"

    def observe(self) -> dict:
        ready = self.ready_acks()
        return {
            "ready_write": ready[0],
            "ready_load": ready[1],
            "digest": self.tree.digest(),
            "device_free": self.device_alloc.available_size(),
            "host_free": self.host_free(),
        }

    def ready_acks(self) -> tuple[int, int]:
        """Leading acks this rank saw finished at the last check (its own view): (write, load)."""
        return 0, 0

    def host_free(self) -> int:
        return 0
