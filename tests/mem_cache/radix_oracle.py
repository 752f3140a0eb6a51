"""Oracles for the radix cache's property tests: the KV every slot must hold (a code derived from a hash of the
sequence up to that token, so any slot anywhere can be checked against it) and views of the tree (its prefixes,
paths, signature) to compare with what the operations should have produced."""

from __future__ import annotations

import functools
import hashlib

import torch

from hicache_lab.mem_cache.memory_pool import DeviceKVPool
from hicache_lab.mem_cache.radix_tree import RadixTree
from hicache_lab.mem_cache.tree_node import TreeNode

DEVICE_TOKENS = 64  # host pool: 2x
NUM_LAYERS = 2
MAX_SEQ = 32  # longest sequence a request inserts (half the device pool)
MAX_OPEN = 3  # requests running at once
VOCAB = 4  # few tokens: prefixes are shared a lot

EMPTY = torch.empty(0, dtype=torch.int64)


# -- the KV every slot must hold ----------------------------------------------------------------------


@functools.lru_cache(maxsize=1 << 16)
def _prefix_hash(tokens: tuple[int, ...]) -> bytes:
    if not tokens:
        return b""
    return hashlib.blake2b(_prefix_hash(tokens[:-1]) + tokens[-1].to_bytes(4, "little"), digest_size=8).digest()


def expected_codes(path: tuple[int, ...], start: int, end: int) -> torch.Tensor:
    """K of positions [start, end) of `path` (V is its negation): exact in fp32, never 0 (a fresh pool's value)."""
    return torch.tensor(
        [1 + int.from_bytes(_prefix_hash(path[: p + 1])[:3], "little") for p in range(start, end)],
        dtype=torch.float32,
    )


def write_kv(pool: DeviceKVPool, slots: torch.Tensor, codes: torch.Tensor) -> None:
    """What a forward pass does: the same K/V in every layer."""
    for layer in range(pool.num_layers):
        k, v = pool.buffers(layer)
        k[slots] = codes[:, None, None]
        v[slots] = -codes[:, None, None]


def kv_mismatch(buffers, num_layers: int, slots: torch.Tensor, codes: torch.Tensor) -> str | None:
    """None when every layer's K/V at `slots` hold `codes`; else where they do not."""
    for layer in range(num_layers):
        for name, buf, want in zip("KV", buffers(layer), (codes, -codes), strict=True):
            got = buf[slots]
            if not torch.equal(got, want[:, None, None].expand_as(got)):
                return f"layer {layer} {name}: got {got[:, 0, 0].tolist()}, want {want.tolist()}"
    return None


# -- looking at the tree ----------------------------------------------------------------------------


def tree_paths(tree: RadixTree) -> list[tuple[tuple[int, ...], TreeNode]]:
    """(tokens from the root through the node, node) for every node."""
    out, stack = [], [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for child in node.children.values():
            out.append((path + child.key, child))
            stack.append((path + child.key, child))
    return out


def tree_prefixes(tree: RadixTree) -> tuple[set, set]:
    """Every page-aligned prefix the tree holds: (in any tier, on the device)."""
    ps, anywhere, device = tree.page_size, set(), set()
    for path, node in tree_paths(tree):
        for end in range(len(path) - len(node.key) + ps, len(path) + 1, ps):
            anywhere.add(path[:end])
            if not node.evicted:
                device.add(path[:end])
    return anywhere, device


def longest_prefix(query: tuple[int, ...], prefixes: set, page_size: int) -> int:
    """Longest page-aligned prefix of `query` in a prefix-closed set."""
    n = 0
    while n + page_size <= len(query) and query[: n + page_size] in prefixes:
        n += page_size
    return n


def aligned_prefixes(key: tuple[int, ...], page_size: int) -> set:
    return {key[:end] for end in range(page_size, len(key) + 1, page_size)}


def depth(node: TreeNode) -> int:
    n = 0
    while node.parent is not None:
        n += len(node.key)
        node = node.parent
    return n


def in_tree(tree: RadixTree, node: TreeNode) -> bool:
    while node is not tree.root:
        if node.parent is None or node.parent.children.get(node.key[: tree.page_size]) is not node:
            return False
        node = node.parent
    return True


def signature(tree: RadixTree) -> tuple:
    """What `digest` must hash: the shape (paths), tiers, locks and host protection, not slot indices."""
    return tuple(
        sorted((path, len(n.key), n.evicted, n.backuped, n.lock_ref, n.host_ref) for path, n in tree_paths(tree))
    )


def snapshot(tree: RadixTree) -> tuple:
    """Everything, slot indices included: two runs of the same operations must agree on all of it."""
    return tuple(
        sorted(
            (
                path,
                len(n.key),
                None if n.value is None else tuple(n.value.tolist()),
                None if n.host_value is None else tuple(n.host_value.tolist()),
                n.lock_ref,
                n.host_ref,
                n.hit_count,
                n.last_access,
            )
            for path, n in tree_paths(tree)
        )
    )


class Checks:
    """What must hold after every operation of a `radix_harness.Harness` (whose state these methods read)."""

    def checked_match(self, query: tuple[int, ...]):
        """match_prefix, checked against the tree's own prefixes and the naive set of everything inserted."""
        anywhere, device = tree_prefixes(self.tree)
        match = self.cache.match_prefix(query)
        dev_len = len(match.device_indices)
        matched = dev_len + match.host_hit_length
        naive = longest_prefix(query, self.naive, self.ps)
        assert dev_len == longest_prefix(query, device, self.ps)
        assert matched == longest_prefix(query, anywhere, self.ps)
        assert matched <= naive, f"matched {matched} tokens, but only {naive} were ever inserted"
        if self.naive <= anywhere:  # nothing inserted has left the tree
            assert matched == naive, f"matched {matched} tokens of {naive} inserted and still cached"
        assert depth(match.last_device_node) == dev_len and not match.last_device_node.evicted
        assert depth(match.last_host_node) == matched  # the deepest matched node, on either tier
        assert match.last_host_node.backuped or not match.host_hit_length
        pending = self.in_flight_slots(self.controller.ack_load_queue, "device_indices")
        keep = torch.tensor([s not in pending for s in match.device_indices.tolist()], dtype=torch.bool)
        where = kv_mismatch(
            self.pool.buffers, NUM_LAYERS, match.device_indices[keep], expected_codes(query, 0, dev_len)[keep]
        )
        assert where is None, f"matched device KV of {query[:dev_len]} is wrong: {where}"
        return match

    @staticmethod
    def in_flight_slots(queue, field: str) -> set[int]:
        return {s for ack in queue if not ack.finish_event.query() for s in getattr(ack, field).tolist()}

    def check_kv(self, in_flight: bool) -> None:
        """Every tree slot holds its KV; with `in_flight`, destinations of unfinished copies are skipped."""
        skip_dev = self.in_flight_slots(self.controller.ack_load_queue, "device_indices") if in_flight else set()
        skip_host = self.in_flight_slots(self.controller.ack_write_queue, "host_indices") if in_flight else set()
        skip_host |= {s for host, _, _ in self.controller.write_queue for s in host.tolist()}  # not started yet
        for path, node in tree_paths(self.tree):
            codes = expected_codes(path, len(path) - len(node.key), len(path))
            for tier, slots, skip, buffers in (
                ("device", node.value, skip_dev, self.pool.buffers),
                ("host", node.host_value, skip_host, self.host_pool.buffers),
            ):
                if slots is None:
                    continue
                keep = torch.tensor([s not in skip for s in slots.tolist()], dtype=torch.bool)
                where = kv_mismatch(buffers, NUM_LAYERS, slots[keep], codes[keep])
                assert where is None, f"{tier} KV of node {node.id} (path {path}) is wrong: {where}"

    def check(self) -> None:
        assert not self.controller.load_queue, "every queued load was started"
        self.cache.check_integrity(self.held())
        # lock_ref = number of lock holders at or below the node
        holders = (
            [r.last_node for r in self.open]
            + self.pinned
            + list(self.cache.ongoing_write_through.values())
            + list(self.cache.ongoing_load_back.values())
        )
        want: dict[int, int] = {}
        for node in holders:
            assert in_tree(self.tree, node) and not node.evicted, f"lock holder {node.id} left the device"
            while node is not self.tree.root:
                want[node.id] = want.get(node.id, 0) + 1
                node = node.parent
        contiguous_host = self.cfg.write_policy != "write_back"  # write-back backs up leaves first
        for _, node in tree_paths(self.tree):
            assert node.lock_ref == want.get(node.id, 0), f"node {node.id}: lock_ref {node.lock_ref}"
            if contiguous_host and node.backuped:
                assert node.parent.backuped, f"node {node.id}: backed up under a parent that is not"
        self.check_kv(in_flight=True)
        # digest changes exactly when what it hashes changes
        digest, sig = self.tree.digest(), signature(self.tree)
        if sig != self.signature:
            assert digest != self.digest, "the tree changed but its digest did not"
        else:
            assert digest == self.digest, "the tree did not change but its digest did"
        self.digest, self.signature = digest, sig
