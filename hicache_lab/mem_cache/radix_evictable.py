"""What eviction asks of a radix tree, kept as the tree changes (`EvictableIndex`, a mixin of `RadixTree`).

As SGLang's `RadixCache` does, rather than walking the tree at every eviction, the tree keeps three things up
to date: the evictable device leaves (unlocked, on the device, no child on the device), the evictable host
leaves (host-only, unprotected, no children) and the evictable token count (device tokens of unlocked nodes).
Every change of a node's device copy, children, lock or host protection goes through this class, so that they
stay right; `_check_bookkeeping` recomputes them by a walk. Locks (`lock_ref`) and host protection
(`host_ref`) propagate to the root, so a parent's count is at least its child's.
"""

from __future__ import annotations

import torch

from .tree_node import TreeNode


class EvictableIndex:
    """The evictable leaf sets and token count, and every operation that changes them; `RadixTree` sets
    the attributes below (`reset`) and supplies `nodes`."""

    page_size: int
    root: TreeNode
    host_duplicates: dict[int, TreeNode]
    evictable_leaves: set[TreeNode]
    evictable_host_leaves: set[TreeNode]
    _evictable_tokens: int

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
