"""The radix tree of token prefixes, with a device tier (`value`) and a host tier (`host_value`).

A node is in one of three states: device-only, device+host, or host-only (`evicted`: it stays in the tree
and can be loaded back). Keys are page-aligned. The tree knows nothing of pools or copies: `HiRadixCache`
(hiradix_cache.py) decides policy; this module keeps the structure and its invariants:

* every non-root node has a device copy or a host copy (evicted => backed up);
* the device tier is prefix-closed: an evicted node has only evicted children;
* `lock_ref > 0` => not evictable; locks propagate to the root, so a parent's lock_ref >= its child's;
* `hashes[i]` = sha256(previous page's hash + page i's tokens), chained from the root.

LRU uses a logical clock (one tick per access), never wall time, so ranks that take the same decisions
hold the same tree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
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


@dataclass(eq=False)
class TreeNode:
    id: int
    parent: TreeNode | None
    key: Key
    value: torch.Tensor | None  # device slots; None once evicted
    host_value: torch.Tensor | None = None  # host slots; None until backed up
    hashes: list[str] = field(default_factory=list)
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

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first, then oldest id
        return (self.last_access, self.id) < (other.last_access, other.id)


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # device slots of the matched prefix held on the device
    last_device_node: TreeNode  # deepest matched node with a device copy
    last_host_node: TreeNode  # deepest matched node with a host copy (or the root)
    host_hit_length: int  # matched tokens beyond the device prefix, held on the host only


@dataclass
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
        self.root.lock_ref = 1
        # Nodes on both tiers, in the order they became so (SGLang's `full_host_duplicates`): what write_back
        # reclaims first under host pressure. An entry whose node lost a tier stays until it is swept (as
        # SGLang's: a node that regains the tier keeps its place).
        self.host_duplicates: dict[int, TreeNode] = {}

    # -- structure ---------------------------------------------------------------------------------

    def _new_node(self, parent: TreeNode | None, key: Key, value: torch.Tensor | None) -> TreeNode:
        prev = parent.hashes[-1] if parent is not None and parent.hashes else ""
        node = TreeNode(self._next_id, parent, key, value, hashes=page_hashes(key, self.page_size, prev))
        self._next_id += 1
        self._touch(node)
        return node

    def _touch(self, node: TreeNode) -> None:
        self.clock += 1
        node.last_access = self.clock

    def _match_len(self, a: Key, b: Key) -> int:
        n, ps = 0, self.page_size
        limit = min(len(a), len(b)) // ps * ps
        while n < limit and a[n : n + ps] == b[n : n + ps]:
            n += ps
        return n

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after `n` tokens; the new upper node inherits its locks, protection and hits."""
        ps = self.page_size
        upper = TreeNode(
            self._next_id,
            child.parent,
            child.key[:n],
            None if child.value is None else child.value[:n],
            None if child.host_value is None else child.host_value[:n],
            hashes=child.hashes[: n // ps],
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

    def _walk(self, key: Key, start: TreeNode | None = None) -> Iterator[tuple[TreeNode, int]]:
        """Yield (node, tokens of `key` it matched) down `key`'s path from `start` (the root), splitting the
        node a match ends inside."""
        node, ps = start or self.root, self.page_size
        self._touch(node)
        while key and key[:ps] in node.children:
            child = node.children[key[:ps]]
            self._touch(child)
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            yield child, n
            node, key = child, key[n:]

    def match_prefix(self, key: Key) -> MatchResult:
        """Longest page-aligned match of `key`."""
        node, values = self.root, []
        for node, _ in self._walk(key[: len(key) // self.page_size * self.page_size]):
            if not node.evicted:
                values.append(node.value)
        last_host_node, host_hit = node, 0
        while node.evicted:
            host_hit += len(node.host_value)
            node = node.parent
        while not last_host_node.backuped:
            last_host_node = last_host_node.parent
        indices = torch.cat(values) if values else self.root.value
        return MatchResult(indices, node, last_host_node, host_hit)

    def insert(self, key: Key, value: torch.Tensor) -> InsertResult:
        """Insert a page-aligned `key` with device slots `value`.

        An evicted node on the path adopts the caller's slots (its host copy stays); those tokens are not
        counted in `prefix_len`, so the caller keeps them allocated.
        """
        assert len(key) % self.page_size == 0 and len(key) == len(value), "insert takes whole pages, a slot each"
        node, done, prefix_len, touched = self.root, 0, 0, []
        for node, n in self._walk(key):
            if node.evicted:
                node.value = value[done : done + n].clone()
                self.track_duplicate(node)
            else:
                prefix_len += n
            touched.append(node)
            done += n
        if done < len(key):
            leaf = self._new_node(node, key[done:], value[done:].clone())
            node.children[key[done : done + self.page_size]] = leaf
            touched.append(leaf)
        return InsertResult(prefix_len, touched, done)

    def insert_host(self, anchor: TreeNode, key: Key, host_value: torch.Tensor) -> torch.Tensor:
        """Insert `key`, continuing the path ending at `anchor`, as a host-only node holding `host_value`
        (pages fetched from storage). Tokens the tree already holds are skipped; returns the positions of
        `host_value` now owned by the tree (the caller frees the rest)."""
        node, done = anchor, 0
        for node, n in self._walk(key, anchor):  # noqa: B007 - the last node visited gets the new leaf
            done += n
        if done < len(key):
            leaf = self._new_node(node, key[done:], None)
            leaf.host_value = host_value[done:].clone()
            node.children[key[done : done + self.page_size]] = leaf
        return torch.arange(done, len(key))

    def delete_leaf(self, node: TreeNode) -> None:
        assert not node.children and node is not self.root
        del node.parent.children[node.key[: self.page_size]]
        self.host_duplicates.pop(node.id, None)

    # -- locks -------------------------------------------------------------------------------------

    def _count_on_path(self, node: TreeNode, counter: str, delta: int) -> None:
        """Add `delta` to `counter` of `node` and of every ancestor below the root."""
        while node is not self.root:
            value = getattr(node, counter) + delta
            assert value >= 0, f"unbalanced {counter} on node {node.id}"
            setattr(node, counter, value)
            node = node.parent

    def inc_lock_ref(self, node: TreeNode) -> None:
        self._count_on_path(node, "lock_ref", 1)

    def dec_lock_ref(self, node: TreeNode) -> None:
        self._count_on_path(node, "lock_ref", -1)

    def protect_host(self, node: TreeNode) -> None:
        """Keep `node`'s host copy from host eviction (while storage reads or writes it). Like locks, the
        protection propagates to the root, so a split keeps both halves protected and release undoes both."""
        self._count_on_path(node, "host_ref", 1)

    def release_host(self, node: TreeNode) -> None:
        self._count_on_path(node, "host_ref", -1)

    # -- queries -----------------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def device_leaves(self) -> list[TreeNode]:
        """Unlocked nodes holding a device copy whose children hold none: device eviction candidates."""
        return [
            n for n in self.nodes() if not n.evicted and n.lock_ref == 0 and all(c.evicted for c in n.children.values())
        ]

    def host_leaves(self) -> list[TreeNode]:
        """Unprotected host-only leaves: host eviction candidates."""
        return [n for n in self.nodes() if n.evicted and not n.children and n.host_ref == 0]

    def path_slots(self, node: TreeNode) -> torch.Tensor:
        """The device slots of the path from the root to `node` (every node on it on the device)."""
        chain = []
        while node is not self.root:
            chain.append(node.value)
            node = node.parent
        return torch.cat(chain[::-1]) if chain else self.root.value

    def evictable_size(self) -> int:
        return sum(len(n.value) for n in self.nodes() if not n.evicted and n.lock_ref == 0)

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
            prev = parent.hashes[-1] if parent.hashes else ""
            assert node.hashes == page_hashes(node.key, ps, prev), f"{where}: hash chain broken"

    def digest(self) -> str:
        """A hash of structure, tiers, locks and host protection (not slot indices): equal trees, equal digests."""
        h = hashlib.sha256()
        stack = [(self.root, 0)]
        while stack:  # pre-order with depths: the sequence determines the shape
            node, depth = stack.pop()
            h.update(repr((depth, node.key, node.evicted, node.backuped, node.lock_ref, node.host_ref)).encode())
            stack.extend((node.children[k], depth + 1) for k in sorted(node.children, reverse=True))
        return h.hexdigest()[:16]
