"""The radix tree of token prefixes, with a device tier (`value`) and a host tier (`host_value`).

A node is in one of three states: device-only, device+host, or host-only (`evicted`: it stays in the tree
and can be loaded back). Keys are page-aligned. The tree knows nothing of pools or copies: `HiRadixCache`
(hiradix_cache.py) decides policy; this module keeps the structure and its invariants:

* every non-root node has a device copy or a host copy (evicted => backed up);
* the device tier is prefix-closed: an evicted node has only evicted children;
* `lock_ref > 0` => not evictable; locks propagate to the root, so a parent's lock_ref >= its child's;
* `hashes[i]` = sha256(previous page's hash + page i's tokens), chained from the root, computed when first
  asked for (`node_hashes`; only the storage tier asks), as SGLang leaves `hash_value` unset until needed.

The tree keeps what eviction asks for as it changes, as SGLang's `RadixCache` does, rather than by walking the
tree: the evictable device leaves, the evictable host leaves and the evictable token count. Every change of a
node's device copy, children, lock or host protection goes through this class so that they stay right
(`check_integrity` recomputes them).

LRU uses a logical clock (one tick per access), never wall time, so ranks that take the same decisions
hold the same tree.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

Key = tuple[int, ...]


def page_hashes(tokens: Key, page_size: int, prev: str = "") -> list[str]:
    """The chained sha256 of every full page of `tokens`, continuing from the hash `prev`."""
    hashes = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[start : start + page_size], dtype="<u4").tobytes()
        prev = hashlib.sha256(bytes.fromhex(prev) + page).hexdigest()
        hashes.append(prev)
    return hashes


@dataclass(eq=False, slots=True)
class TreeNode:
    id: int
    parent: TreeNode | None
    key: Key
    value: torch.Tensor | None  # device slots; None once evicted
    host_value: torch.Tensor | None = None  # host slots; None until backed up
    hashes: list[str] | None = None  # page hashes; None until first asked for (node_hashes)
    children: dict[Key, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    host_ref: int = 0  # host protection: > 0 => not host-evictable
    hit_count: int = 0
    last_access: int = 0
    load_pending: int | None = None  # id of the load back still filling this node's device copy
    write_pending: int | None = None  # id of the host write in flight that covers this node (a split keeps it)

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None


def node_hashes(node: TreeNode, page_size: int) -> list[str]:
    """`node`'s page hashes, computed (with those of its ancestors that lack theirs) on first use."""
    chain = []
    while node.hashes is None:
        chain.append(node)
        node = node.parent
    prev = node.hashes[-1] if node.hashes else ""  # the root's list is empty: a chain starts from ""
    for n in reversed(chain):
        n.hashes = page_hashes(n.key, page_size, prev)
        prev = n.hashes[-1]
    return (chain[0] if chain else node).hashes


def lru_order(node: TreeNode) -> tuple[int, int]:
    """Eviction order: least recently used first, then the oldest node (ids are unique: no two nodes tie)."""
    return node.last_access, node.id


def evict_lru(leaves: set[TreeNode], num_tokens: int, evict_leaf: Callable[[TreeNode], int]) -> int:
    """Evict least recently used nodes of `leaves` (one of the leaf sets a `RadixTree` keeps) with `evict_leaf`
    (which returns the tokens it freed) until `num_tokens` are freed; a parent the eviction made a leaf joins.
    An entry that left the set meanwhile is skipped."""
    heap = [(lru_order(n), n) for n in leaves]  # the keys are tuples of ints: compared in C
    heapq.heapify(heap)
    freed = 0
    while freed < num_tokens and heap:
        node = heapq.heappop(heap)[1]
        if node not in leaves:
            continue
        parent = node.parent
        freed += evict_leaf(node)
        if parent in leaves:
            heapq.heappush(heap, (lru_order(parent), parent))
    return freed


@dataclass(slots=True)
class MatchResult:
    device_indices: torch.Tensor  # device slots of the matched prefix held on the device
    last_device_node: TreeNode  # deepest matched node with a device copy
    last_host_node: TreeNode  # deepest matched node with a host copy (or the root)
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
        leaf = self._new_node(parent, key, value)
        parent.children[key[: self.page_size]] = leaf
        if value is not None:
            self._evictable_tokens += len(key)
        self._update_leaf(leaf)
        self._update_leaf(parent)
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
        return lo - lo % self.page_size

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
        self.clock += 1
        node.last_access = self.clock
        path, done, end = [], 0, len(key)
        while done < end:
            child = children.get(key[done : done + ps])
            if child is None:
                break
            self.clock += 1
            child.last_access = self.clock
            n = self._match_len(child.key, key, done)
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            done += n
            children = child.children
        return path, done

    def match_prefix(self, key: Key) -> MatchResult:
        """Longest page-aligned match of `key`."""
        path, _ = self._walk(key[: len(key) // self.page_size * self.page_size], self.root)
        node = path[-1] if path else self.root
        last_host_node, host_hit = node, 0
        while node.value is None:
            host_hit += len(node.host_value)
            node = node.parent
        while last_host_node.host_value is None:
            last_host_node = last_host_node.parent
        values = [n.value for n in path if n.value is not None]
        indices = values[0] if len(values) == 1 else torch.cat(values) if values else self.root.value
        return MatchResult(indices, node, last_host_node, host_hit)

    def insert(self, key: Key, value: torch.Tensor) -> InsertResult:
        """Insert a page-aligned `key` with device slots `value`.

        An evicted node on the path adopts the caller's slots (its host copy stays); those tokens are not
        counted in `prefix_len`, so the caller keeps them allocated.
        """
        assert len(key) % self.page_size == 0 and len(key) == len(value), "insert takes whole pages, a slot each"
        touched, done = self._walk(key, self.root)
        prefix_len, start = 0, 0
        for node in touched:
            n = len(node.key)
            if node.value is None:
                self.set_device(node, value[start : start + n].clone())
                self.track_duplicate(node)
            else:
                prefix_len += n
            start += n
        if done < len(key):
            touched.append(self._add_leaf(touched[-1] if touched else self.root, key[done:], value[done:].clone()))
        return InsertResult(prefix_len, touched, done)

    def insert_host(self, anchor: TreeNode, key: Key, host_value: torch.Tensor) -> torch.Tensor:
        """Insert `key`, continuing the path ending at `anchor`, as a host-only node holding `host_value`
        (pages fetched from storage). Tokens the tree already holds are skipped; returns the positions of
        `host_value` now owned by the tree (the caller frees the rest)."""
        path, done = self._walk(key, anchor)
        if done < len(key):
            leaf = self._add_leaf(path[-1] if path else anchor, key[done:], None)
            leaf.host_value = host_value[done:].clone()
        return torch.arange(done, len(key))

    def set_device(self, node: TreeNode, value: torch.Tensor | None) -> None:
        """Give `node` a device copy (`value`, slots) or take it away (None): a load back, an adoption at
        insert, an eviction that leaves the node host-only."""
        if node.lock_ref == 0:
            self._evictable_tokens += (0 if value is None else len(value)) - (
                0 if node.value is None else len(node.value)
            )
        node.value = value
        self._update_leaf(node)
        self._update_leaf(node.parent)

    def delete_leaf(self, node: TreeNode) -> None:
        assert not node.children and node is not self.root and node.lock_ref == 0, "only an unlocked leaf goes"
        del node.parent.children[node.key[: self.page_size]]
        self.host_duplicates.pop(node.id, None)
        self.evictable_leaves.discard(node)
        self.evictable_host_leaves.discard(node)
        if node.value is not None and node.lock_ref == 0:
            self._evictable_tokens -= len(node.value)
        self._update_leaf(node.parent)

    def _update_leaf(self, node: TreeNode) -> None:
        """Put `node` in or out of the evictable leaf sets, from its own state and its children's. A node no
        longer in the tree (a release of host protection may reach one that was deleted) joins neither."""
        if node is self.root or node.parent.children.get(node.key[: self.page_size]) is not node:
            return
        if node.value is None:
            self.evictable_leaves.discard(node)
            if node.host_ref == 0 and not node.children:
                self.evictable_host_leaves.add(node)
            else:
                self.evictable_host_leaves.discard(node)
        else:
            self.evictable_host_leaves.discard(node)
            if node.lock_ref == 0 and all(c.value is None for c in node.children.values()):
                self.evictable_leaves.add(node)
            else:
                self.evictable_leaves.discard(node)

    # -- locks -------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                if node.value is not None:
                    self._evictable_tokens -= len(node.value)
                self.evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, f"unbalanced lock_ref on node {node.id}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.value is not None:
                    self._evictable_tokens += len(node.value)
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

    def evictable_size(self) -> int:
        return self._evictable_tokens

    def protected_size(self) -> int:
        return sum(len(n.value) for n in self.nodes() if not n.evicted and n.lock_ref > 0)

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

    def _check_bookkeeping(self) -> None:
        """The leaf sets and the evictable token count equal what a walk of the tree finds."""
        nodes = list(self.nodes())
        leaves = {n for n in nodes if not n.evicted and n.lock_ref == 0 and all(c.evicted for c in n.children.values())}
        host_leaves = {n for n in nodes if n.evicted and not n.children and n.host_ref == 0}
        evictable = sum(len(n.value) for n in nodes if not n.evicted and n.lock_ref == 0)
        assert self.evictable_leaves == leaves, "evictable device leaves out of date"
        assert self.evictable_host_leaves == host_leaves, "evictable host leaves out of date"
        assert self._evictable_tokens == evictable, f"evictable tokens {self._evictable_tokens}, walk finds {evictable}"

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
