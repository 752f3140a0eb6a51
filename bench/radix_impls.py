"""The prefix caches bench/radix_speed.py compares: the lab's tree driven directly and a naive dict of prefixes
(SGLang's RadixCache, the third, is in radix_sglang.py).

Each one has `name`, `size` (tokens held), prepare_key(tuple) -> its key type (untimed), match(key) -> slots of
the longest cached prefix, insert(key, slots) and evict(num_tokens) -> tokens freed.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from hicache_lab.mem_cache.radix_tree import Key, RadixTree, TreeNode, evict_lru

EMPTY = torch.empty(0, dtype=torch.int64)


def same_key(key: Key) -> Key:
    """The lab's tree and the naive dict take the tuple of token ids as it is."""
    return key


class LabTree:
    """The lab's `RadixTree` driven directly, not through `RadixCache`: this benchmark measures the bare tree.

    `RadixCache.evict` runs the loop below and also frees each evicted leaf's slots into its `PageAllocator`,
    which neither the naive dict nor SGLang's counting sink pays, and that allocator would have to own the key
    stream's slots. So `evict` is `RadixCache.evict` without the free: the same `evict_lru` over the tree's
    evictable leaves, each leaving the tree.
    """

    name = "lab"
    prepare_key = staticmethod(same_key)

    def __init__(self, page_size: int):
        self.tree = RadixTree(page_size)
        self.size = 0

    def match(self, key: Key) -> torch.Tensor:
        return self.tree.match_prefix(key).device_indices

    def insert(self, key: Key, value: torch.Tensor) -> None:
        self.size += len(key) - self.tree.insert(key, value).prefix_len

    def evict(self, num_tokens: int) -> int:
        freed = evict_lru(self.tree.evictable_leaves, num_tokens, self._drop)
        self.size -= freed
        return freed

    def _drop(self, node: TreeNode) -> int:
        self.tree.delete_leaf(node)
        return len(node.key)  # a slot per token


class NaivePrefixDict:
    """The baseline: a dict from every page-aligned prefix of every inserted sequence to its slots."""

    name = "naive"
    prepare_key = staticmethod(same_key)

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.prefixes: dict[Key, list] = {}  # every page-aligned prefix held -> [slots, sequences holding it]
        self.sequences: OrderedDict[Key, None] = OrderedDict()  # inserted sequences, least recent first
        self.size = 0

    def match(self, key: Key) -> torch.Tensor:
        """The longest held prefix first."""
        prefixes, ps = self.prefixes, self.page_size
        for n in range(len(key) // ps * ps, 0, -ps):
            entry = prefixes.get(key[:n])
            if entry is not None:
                return entry[0]
        return EMPTY

    def insert(self, key: Key, value: torch.Tensor) -> None:
        if key in self.sequences:
            self.sequences.move_to_end(key)
            return
        prefixes, ps = self.prefixes, self.page_size
        held = len(key)
        while held and key[:held] not in prefixes:
            held -= ps
        # Slots already cached stay (the tree keeps its own copy of a shared prefix, as a radix tree does).
        slots = torch.cat([prefixes[key[:held]][0], value[held:]]) if held else value
        for n in range(ps, len(key) + 1, ps):
            prefix = key[:n]
            entry = prefixes.get(prefix)
            if entry is None:
                prefixes[prefix] = [slots[:n], 1]
            else:
                entry[1] += 1
        self.size += len(key) - held
        self.sequences[key] = None

    def evict(self, num_tokens: int) -> int:
        """Least recently inserted whole sequences go; a prefix goes when no remaining sequence holds it."""
        prefixes, ps = self.prefixes, self.page_size
        freed = 0
        while freed < num_tokens and self.sequences:
            key, _ = self.sequences.popitem(last=False)
            for n in range(ps, len(key) + 1, ps):
                prefix = key[:n]
                entry = prefixes[prefix]
                entry[1] -= 1
                if not entry[1]:
                    del prefixes[prefix]
                    freed += ps
        self.size -= freed
        return freed
