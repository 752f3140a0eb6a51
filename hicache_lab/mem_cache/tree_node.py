"""A radix tree's node (`TreeNode`: its tiers, references, hits and LRU time) and its page hashes.

A node is in one of three states: device-only, device+host, or host-only (`evicted`: it stays in the tree and
can be loaded back). Its `hashes` continue its parent's chain (utils.page_hashes) and are computed when first
asked for (`node_hashes`; only the storage tier asks), as SGLang leaves `hash_value` unset until needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .utils import Key, page_hashes


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
