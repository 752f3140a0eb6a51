"""The radix tree of token prefixes, with a device tier (`value`) and a host tier (`host_value`).

Its nodes are `TreeNode`s (tree_node.py) and its keys are page-aligned. The tree knows nothing of pools or
copies: `HiRadixCache` (hiradix_cache.py) decides policy; this module keeps the structure and its invariants:

* every non-root node has a device copy or a host copy (evicted => backed up);
* the device tier is prefix-closed: an evicted node has only evicted children;
* `lock_ref > 0` => not evictable; locks propagate to the root, so a parent's lock_ref >= its child's;
* `hashes[i]` = sha256(previous page's hash + page i's tokens), chained from the root (utils.page_hashes),
  computed when first asked for (tree_node.node_hashes).

What eviction asks for the tree keeps up to date as it changes, as SGLang's `RadixCache` does, rather than
walking the tree at every eviction: the evictable device leaves (unlocked, on the device, no child on the
device), the evictable host leaves (host-only, unprotected, no children) and the evictable token count (device
tokens of unlocked nodes). Every change of a node's device copy, children, lock or host protection goes through
the methods that keep them right; `_check_bookkeeping` recomputes them by a walk. Locks (`lock_ref`) and host
protection (`host_ref`) propagate to the root, so a parent's count is at least its child's.

LRU uses a logical clock (one tick per access), never wall time, so ranks that take the same decisions
hold the same tree.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from .tree_node import TreeNode
from .utils import Key, page_floor, page_hashes, whole_pages


def lru_order(nodes: Iterable[TreeNode]) -> list[tuple[int, int, TreeNode]]:
    """Heap entries of `nodes` in eviction order: least recently used first, then the oldest node. Ids are unique,
    so no two entries tie and nodes are never compared: the entries compare as tuples of ints, in C."""
    return [(n.last_access, n.id, n) for n in nodes]


def evict_lru(leaves: set[TreeNode], num_tokens: int, evict_leaf: Callable[[TreeNode], int]) -> int:
    """Evict least recently used nodes of `leaves` (one of the leaf sets a `RadixTree` keeps) with `evict_leaf`
    (which returns the tokens it freed) until `num_tokens` are freed; a parent the eviction made a leaf joins.
    An entry that left the set meanwhile is skipped."""
    heap, pop, freed = lru_order(leaves), heapq.heappop, 0
    heapq.heapify(heap)
    while freed < num_tokens and heap:
        node = pop(heap)[2]
        if node not in leaves:
            continue
        parent = node.parent
        freed += evict_leaf(node)
        if parent in leaves:
            heapq.heappush(heap, *lru_order((parent,)))
    return freed


@dataclass(slots=True)
class MatchResult:
    device_indices: torch.Tensor  # device slots of the matched prefix held on the device
    last_device_node: TreeNode  # deepest matched node with a device copy
    last_host_node: TreeNode  # deepest matched node, on either tier (0.5.23's, = its best_match_node; the root if none)
    host_hit_length: int  # matched tokens beyond the device prefix, held on the host only


@dataclass(slots=True)
class InsertResult:
    prefix_len: int  # leading tokens the tree already held on the device (the caller frees its copies)
    touched: list[TreeNode]  # nodes on the key's path that hold the caller's data, deepest last
    matched: int = 0  # leading tokens the tree already held on either tier (SGLang's InsertResult.prefix_len)


class RadixTree:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.clock = 0
        self._next_id = 0
        self.reset()

    def reset(self) -> None:
        """Drop every node (node ids and the clock keep counting)."""
        empty = torch.empty(0, dtype=torch.int64)
        self.root = self._new_node(None, (), empty)
        self.root.host_value = empty
        self.root.hashes = []
        self.root.lock_ref = 1
        # Nodes on both tiers, in the order they became so (SGLang's `full_host_duplicates`): what write_back
        # reclaims first under host pressure. An entry whose node lost a tier stays until it is swept (as
        # SGLang's: a node that regains the tier keeps its place).
        self.host_duplicates: dict[int, TreeNode] = {}
        self.evictable_leaves: set[TreeNode] = set()  # unlocked, on the device, no child on the device
        self.evictable_host_leaves: set[TreeNode] = set()  # host-only, unprotected, no children
        self._evictable_tokens = 0  # device tokens of unlocked nodes

    # -- structure ---------------------------------------------------------------------------------

    def _new_node(self, parent: TreeNode | None, key: Key, value: torch.Tensor | None) -> TreeNode:
        node = TreeNode(self._next_id, parent, key, value)
        self._next_id += 1
        self.clock += 1
        node.last_access = self.clock
        return node

    def _add_leaf(self, parent: TreeNode, key: Key, value: torch.Tensor | None) -> TreeNode:
        """A new leaf under `parent`, on the device (`value`) or host-only (None: the caller sets its host copy), in
        its tier's evictable leaves; `parent` leaves the host leaves, and the device's if the leaf is on it."""
        leaf = self._new_node(parent, key, value)
        parent.children[key[: self.page_size]] = leaf
        self.evictable_host_leaves.discard(parent)
        if value is None:
            self.evictable_host_leaves.add(leaf)
        else:
            self._evictable_tokens += len(key)
            self.evictable_leaves.add(leaf)
            self.evictable_leaves.discard(parent)
        return leaf

    def _match_len(self, a: Key, key: Key, offset: int) -> int:
        """Tokens of `a` that `key[offset:]` starts with, in whole pages: one comparison where all match (the
        usual case), else a binary search for the first difference."""
        m = min(len(a), len(key) - offset)
        if a[:m] == key[offset : offset + m]:
            return m  # both lengths are whole pages
        lo, hi = 0, m  # a[:lo] matches; the first difference is in [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[lo:mid] == key[offset + lo : offset + mid]:
                lo = mid
            else:
                hi = mid
        return page_floor(lo, self.page_size)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after `n` tokens; the new upper node inherits its locks, protection and hits. Neither half
        is a leaf candidate that `child` was not, and the evictable token count is unchanged."""
        ps = self.page_size
        upper = TreeNode(
            self._next_id,
            child.parent,
            child.key[:n],
            None if child.value is None else child.value[:n],
            None if child.host_value is None else child.host_value[:n],
            hashes=None if child.hashes is None else child.hashes[: n // ps],
            lock_ref=child.lock_ref,
            host_ref=child.host_ref,
            hit_count=child.hit_count,
            last_access=child.last_access,
            load_pending=child.load_pending,
            write_pending=child.write_pending,
        )
        self._next_id += 1
        upper.children[child.key[n : n + ps]] = child
        child.parent.children[child.key[:ps]] = upper
        child.parent = upper
        child.key = child.key[n:]
        if child.hashes is not None:
            child.hashes = child.hashes[n // ps :]
        if child.value is not None:
            child.value = child.value[n:]
        if child.host_value is not None:
            child.host_value = child.host_value[n:]
        self.track_duplicate(upper)
        return upper

    def track_duplicate(self, node: TreeNode) -> None:
        """Register `node` if it is now settled on both tiers (no load filling it), else drop its entry."""
        if node is not self.root and not node.evicted and node.backuped and node.load_pending is None:
            self.host_duplicates.setdefault(node.id, node)
        else:
            self.host_duplicates.pop(node.id, None)

    def _walk(self, key: Key, node: TreeNode) -> tuple[list[TreeNode], int]:
        """The nodes down `key`'s path from `node` (touched; the node a match ends inside is split) and the
        tokens of `key` they hold."""
        ps, children = self.page_size, node.children
        clock = self.clock + 1
        node.last_access = clock
        path, done, end = [], 0, len(key)
        while done < end:
            child = children.get(key[done : done + ps])
            if child is None:
                break
            clock += 1
            child.last_access = clock
            n = len(child.key)
            if key[done : done + n] != child.key:  # the key ends or differs inside the child: split it there
                n = self._match_len(child.key, key, done)
                child = self._split(child, n)
            path.append(child)
            done += n
            children = child.children
        self.clock = clock
        return path, done

    def match_prefix(self, key: Key) -> MatchResult:
        """Longest page-aligned match of `key`."""
        path, _ = self._walk(whole_pages(key, self.page_size), self.root)
        if not path:  # a miss: nothing more to look at
            return MatchResult(self.root.value, self.root, self.root, 0)
        node = last_host_node = path[-1]
        host_hit = 0
        while node.value is None:
            host_hit += len(node.key)  # a slot per token
            node = node.parent
        values = [n.value for n in path if n.value is not None]
        indices = values[0] if len(values) == 1 else torch.cat(values) if values else self.root.value
        return MatchResult(indices, node, last_host_node, host_hit)

    def insert(self, key: Key, value: torch.Tensor) -> InsertResult:
        """Insert a page-aligned `key` with device slots `value`.

        An evicted node on the path adopts the caller's slots (its host copy stays); those tokens are not
        counted in `prefix_len`, so the caller keeps them allocated.
        """
        end = len(key)
        assert end % self.page_size == 0 and end == value.shape[0], "insert takes whole pages, a slot each"
        touched, done = self._walk(key, self.root)
        prefix_len, start = 0, 0
        for node in touched:
            n = len(node.key)
            if node.value is None:
                self.set_device(node, value.narrow_copy(0, start, n))  # a copy of its own (one op, not a slice's two)
                self.track_duplicate(node)
            else:
                prefix_len += n
            start += n
        if done < end:
            parent = touched[-1] if touched else self.root
            touched.append(self._add_leaf(parent, key[done:], value.narrow_copy(0, done, end - done)))
        return InsertResult(prefix_len, touched, done)

    def insert_host(self, anchor: TreeNode, key: Key, host_value: torch.Tensor) -> torch.Tensor:
        """Insert `key`, continuing the path ending at `anchor`, as a host-only node holding `host_value`
        (pages fetched from storage). Tokens the tree already holds are skipped; returns the positions of
        `host_value` now owned by the tree (the caller frees the rest)."""
        path, done = self._walk(key, anchor)
        if done < len(key):
            leaf = self._add_leaf(path[-1] if path else anchor, key[done:], None)
            leaf.host_value = host_value.narrow_copy(0, done, len(key) - done)
        return torch.arange(done, len(key))

    # -- what eviction may take: device copies, leaves, locks, host protection ---------------------

    def set_device(self, node: TreeNode, value: torch.Tensor | None) -> None:
        """Give `node` a device copy (`value`, slots) or take it away (None): a load back, an adoption at
        insert, an eviction that leaves the node host-only."""
        if node.lock_ref == 0:  # a tier holds a slot per token of the node's key
            self._evictable_tokens += len(node.key) * ((value is not None) - (node.value is not None))
        node.value = value
        self._update_leaf(node)
        self._update_leaf(node.parent)

    def delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert not node.children and parent is not None and node.lock_ref == 0, "only an unlocked leaf goes"
        del parent.children[node.key[: self.page_size]]
        self.host_duplicates.pop(node.id, None)
        if node.value is None:
            self.evictable_host_leaves.discard(node)
        else:  # unlocked: its tokens were evictable
            self.evictable_leaves.discard(node)
            self._evictable_tokens -= len(node.key)
        if parent is not self.root:
            self._classify(parent)  # in the tree: its child was

    def _update_leaf(self, node: TreeNode) -> None:
        """Put `node` in or out of the evictable leaf sets, from its own state and its children's. A node no
        longer in the tree (a release of host protection may reach one that was deleted) joins neither."""
        if node is not self.root and node.parent.children.get(node.key[: self.page_size]) is node:
            self._classify(node)

    def _classify(self, node: TreeNode) -> None:
        """`_update_leaf` for a node known to be in the tree, and not the root."""
        if node.value is None:
            self.evictable_leaves.discard(node)
            if node.host_ref == 0 and not node.children:
                self.evictable_host_leaves.add(node)
            else:
                self.evictable_host_leaves.discard(node)
        else:
            self.evictable_host_leaves.discard(node)
            if node.lock_ref == 0 and (not node.children or all(c.value is None for c in node.children.values())):
                self.evictable_leaves.add(node)
            else:
                self.evictable_leaves.discard(node)

    # -- locks -------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                if node.value is not None:
                    self._evictable_tokens -= len(node.key)
                self.evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, f"unbalanced lock_ref on node {node.id}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.value is not None:
                    self._evictable_tokens += len(node.key)
                self._update_leaf(node)
            node = node.parent

    def protect_host(self, node: TreeNode) -> None:
        """Keep `node`'s host copy from host eviction (while storage reads or writes it). Like locks, the
        protection propagates to the root, so a split keeps both halves protected and release undoes both."""
        while node is not self.root:
            node.host_ref += 1
            self.evictable_host_leaves.discard(node)
            node = node.parent

    def release_host(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.host_ref > 0, f"unbalanced host_ref on node {node.id}"
            node.host_ref -= 1
            if node.host_ref == 0:
                self._update_leaf(node)
            node = node.parent

    # -- what is evictable -------------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable_tokens

    def protected_size(self) -> int:
        return sum(len(n.value) for n in self.nodes() if not n.evicted and n.lock_ref > 0)

    def _check_bookkeeping(self) -> None:
        """The leaf sets and the evictable token count equal what a walk of the tree finds."""
        nodes = list(self.nodes())
        leaves = {n for n in nodes if not n.evicted and n.lock_ref == 0 and all(c.evicted for c in n.children.values())}
        host_leaves = {n for n in nodes if n.evicted and not n.children and n.host_ref == 0}
        evictable = sum(len(n.value) for n in nodes if not n.evicted and n.lock_ref == 0)
        assert self.evictable_leaves == leaves, "evictable device leaves out of date"
        assert self.evictable_host_leaves == host_leaves, "evictable host leaves out of date"
        assert self._evictable_tokens == evictable, f"evictable tokens {self._evictable_tokens}, walk finds {evictable}"

    # -- queries -----------------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_slots(self, node: TreeNode) -> torch.Tensor:
        """The device slots of the path from the root to `node` (every node on it on the device)."""
        chain = []
        while node is not self.root:
            chain.append(node.value)
            node = node.parent
        return torch.cat(chain[::-1]) if chain else self.root.value

    def device_size(self) -> int:
        return sum(len(n.value) for n in self.nodes() if not n.evicted)

    def host_size(self) -> int:
        return sum(len(n.host_value) for n in self.nodes() if n.backuped)

    # -- checks ------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert every structural invariant listed in the module docstring."""
        ps = self.page_size
        for node in self.nodes():
            parent = node.parent
            where = f"node {node.id} key[:4]={node.key[:4]}"
            assert parent.children.get(node.key[:ps]) is node, f"{where}: not under its parent's child key"
            assert node.key and len(node.key) % ps == 0, f"{where}: key length {len(node.key)} not page-aligned"
            assert node.value is not None or node.host_value is not None, f"{where}: in no tier"
            for tier in (node.value, node.host_value):
                assert tier is None or len(tier) == len(node.key), f"{where}: tier length differs from key"
            assert not (parent is not self.root and parent.evicted and not node.evicted), (
                f"{where}: holds a device copy under an evicted parent"
            )
            assert node.lock_ref >= 0 and node.host_ref >= 0, f"{where}: negative reference count"
            assert parent is self.root or parent.lock_ref >= node.lock_ref, f"{where}: lock not propagated"
            assert parent is self.root or parent.host_ref >= node.host_ref, f"{where}: protection not propagated"
            if node.hashes is not None:  # computed ones must continue the chain (a parent has its own by then)
                prev = parent.hashes[-1] if parent.hashes else ""
                assert parent.hashes is not None, f"{where}: hashed below a parent without hashes"
                assert node.hashes == page_hashes(node.key, ps, prev), f"{where}: hash chain broken"
        self._check_bookkeeping()

    def digest(self) -> str:
        """A hash of structure, tiers, locks and host protection (not slot indices): equal trees, equal digests.
        A key enters by its length and Python's hash of its token tuple, which is the same in every process (no
        string is hashed); every step's trace records one, so it must stay cheap."""
        parts, stack = [], [(self.root, 0)]
        while stack:  # pre-order with depths: the sequence determines the shape
            node, depth = stack.pop()
            key = node.key
            parts.append(
                (depth, len(key), hash(key), node.value is None, node.host_value is None, node.lock_ref, node.host_ref)
            )
            stack.extend((node.children[k], depth + 1) for k in sorted(node.children, reverse=True))
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
