"""Pinned semantics of the radix tree and HiRadixCache: single cases the random operations might take long to
reach (splits keep locks and protection, adoption of host-only nodes, locked nodes never evicted, page hashes,
digests, load back under host pressure)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from radix_harness import Harness
from radix_oracle import DEVICE_TOKENS, NUM_LAYERS, expected_codes, in_tree, kv_mismatch, signature, write_kv

from hicache_lab.config import WRITE_POLICIES
from hicache_lab.errors import PoolExhaustedError
from hicache_lab.mem_cache.radix_tree import RadixTree
from hicache_lab.mem_cache.tree_node import node_hashes
from hicache_lab.mem_cache.utils import page_hashes

# -- pinned semantics -------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_split_keeps_locks_and_host_protection_on_both_halves(page_size):
    ps = page_size
    tree = RadixTree(ps)
    key = tuple(range(3 * ps))
    tree.insert(key, torch.arange(100, 100 + 3 * ps))
    node = tree.root.children[key[:ps]]
    node.host_value = torch.arange(200, 200 + 3 * ps)
    node.host_ref, node.hit_count = 1, 2
    tree.inc_lock_ref(node)
    tree.inc_lock_ref(node)
    assert node.hashes is None and node_hashes(node, ps) == page_hashes(key, ps)  # computed when asked for

    match = tree.match_prefix(key[: 2 * ps])  # ends inside the node: splits it
    upper = match.last_device_node
    assert upper is not node and upper.parent is tree.root and node.parent is upper
    assert upper.key == key[: 2 * ps] and node.key == key[2 * ps :]
    assert upper.lock_ref == node.lock_ref == 2
    assert upper.host_ref == node.host_ref == 1
    assert upper.hit_count == node.hit_count == 2
    assert upper.value.tolist() == list(range(100, 100 + 2 * ps)) and node.value.tolist() == [
        100 + 2 * ps + i for i in range(ps)
    ]
    assert upper.host_value.tolist() == list(range(200, 200 + 2 * ps))
    assert upper.hashes + node.hashes == page_hashes(key, ps)
    assert match.device_indices.tolist() == list(range(100, 100 + 2 * ps))
    tree.check_integrity()
    assert tree.evictable_size() == 0 and tree.protected_size() == 3 * ps
    assert tree.evictable_leaves == set() and tree.evictable_host_leaves == set()

    tree.dec_lock_ref(node)  # unlocking the lower half unlocks the upper one with it
    tree.dec_lock_ref(node)
    assert upper.lock_ref == node.lock_ref == 0
    assert tree.evictable_size() == 3 * ps
    tree.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_over_a_host_only_node_adopts_the_new_slots(groups, page_size):
    ps = page_size
    h = Harness(groups, ps, "write_through")
    head, tail = (1,) * (2 * ps), (2,) * (2 * ps)
    h.apply(("insert", 99, list(head), False))
    h.apply(("insert", 0, list(tail), False))  # head + tail
    h.apply(("sync",))
    assert h.cache.evict(len(tail)) == len(tail)  # the tail node, the only device leaf, goes host-only
    tail_node = h.tree.root.children[head[:ps]].children[tail[:ps]]
    assert tail_node.evicted and tail_node.backuped
    host_before = tail_node.host_value.clone()
    h.check()

    slots = h.cache.alloc_device(len(head + tail))
    write_kv(h.pool, slots, expected_codes(head + tail, 0, len(head + tail)))
    prefix_len = h.cache.insert(head + tail, slots)
    assert prefix_len == len(head), "the adopted host-only tokens are not counted: the caller keeps them"
    assert tail_node.value.tolist() == slots[len(head) :].tolist()
    assert torch.equal(tail_node.host_value, host_before), "the host copy stays"
    h.device_alloc.free(slots[:prefix_len])  # only the duplicates of the device prefix
    h.check()
    h.op_sync()
    assert h.checked_match(head + tail).host_hit_length == 0


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_a_locked_node_is_never_evicted(groups, policy):
    h = Harness(groups, 4, policy)
    h.apply(("insert", 99, [0] * 16, False))
    h.apply(("insert", 99, [1] * 16, False))
    h.apply(("sync",))
    match = h.cache.match_prefix((0,) * 8)  # splits the [0]*16 node
    locked = match.last_device_node
    h.pin(locked)

    h.apply(("evict", 10 * DEVICE_TOKENS))
    assert not locked.evicted and in_tree(h.tree, locked)
    assert h.tree.device_size() == h.tree.protected_size() == 8
    h.apply(("evict_host", 10 * DEVICE_TOKENS))
    assert not locked.evicted and in_tree(h.tree, locked)
    with pytest.raises(PoolExhaustedError):
        h.cache.alloc_device(DEVICE_TOKENS)  # would need the locked slots
    assert not locked.evicted and in_tree(h.tree, locked)
    h.check()

    h.unpin(locked)
    h.apply(("evict", 10 * DEVICE_TOKENS))
    assert h.tree.device_size() == 0 and (locked.evicted or not in_tree(h.tree, locked))


@given(
    page_size=st.sampled_from([1, 2, 4]),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=24),
    data=st.data(),
)
@settings(max_examples=100, deadline=None)
def test_page_hashes_chain(page_size, tokens, data):
    """The hash of page i depends on every earlier page; continuing from a hash gives the same chain."""
    ps, tokens = page_size, tuple(tokens)
    hashes = page_hashes(tokens, ps)
    assert len(hashes) == len(tokens) // ps, "one hash per full page, a partial tail has none"
    assert len(set(hashes)) == len(hashes)
    for k in range(len(hashes) + 1):
        assert page_hashes(tokens[k * ps :], ps, hashes[k - 1] if k else "") == hashes[k:]
    if not hashes:
        return
    i = data.draw(st.integers(0, len(hashes) - 1))
    changed = list(tokens)
    changed[i * ps + data.draw(st.integers(0, ps - 1))] ^= 1 + data.draw(st.integers(0, 2**31))
    other = page_hashes(tuple(changed), ps)
    assert other[:i] == hashes[:i], "pages before the change keep their hashes"
    assert all(a != b for a, b in zip(other[i:], hashes[i:], strict=True)), "every later page's hash changes"
    if i:  # the same page after a different history hashes differently
        assert page_hashes(tokens[i * ps :], ps)[0] != hashes[i]


def test_digest_distinguishes_a_chain_from_siblings():
    """root -> (0) -> (1) and root -> (0), (1) are different trees: their digests must differ."""
    chain = RadixTree(1)
    chain.insert((0, 1), torch.tensor([0, 1]))
    chain.match_prefix((0,))  # splits into (0) -> (1)
    siblings = RadixTree(1)
    siblings.insert((0,), torch.tensor([0]))
    siblings.insert((1,), torch.tensor([1]))
    chain.check_integrity()
    siblings.check_integrity()
    assert signature(chain) != signature(siblings)
    assert chain.digest() != siblings.digest()


def test_digest_is_equal_for_equal_trees_built_differently():
    """Only structure, tiers, locks and protection count: not slot indices, not the order of insertion."""
    a, b = RadixTree(1), RadixTree(1)
    a.insert((0, 1, 2), torch.tensor([5, 6, 7]))
    a.insert((0, 3), torch.tensor([5, 8]))
    b.insert((0, 3), torch.tensor([0, 1]))
    b.insert((0, 1, 2), torch.tensor([0, 2, 3]))
    assert a.digest() == b.digest()
    a.inc_lock_ref(a.root.children[(0,)])
    assert a.digest() != b.digest()


def test_load_back_keeps_its_chain_when_making_room_needs_host_room(groups):
    """write_back, host pool 1.5x: the eviction a load back triggers writes a node back, which host-evicts.

    The host-only chain being loaded is the only host-evictable leaf, so `evict_host` must not take it: the load
    would read freed host slots (reused by the write back) into device slots of nodes no longer in the tree.
    """
    h = Harness(groups, 1, "write_back", device_tokens=16, host_ratio=1.5)  # host pool: 24 tokens
    chain, other, young = (1,) * 12, (0,) * 12, (2,) * 4
    h.apply(("insert", 99, list(chain), False))
    h.apply(("evict", 12))  # chain: written back, host-only
    h.apply(("insert", 99, list(other), False))
    h.apply(("evict", 12))  # other: written back, host-only; the host pool is now full
    h.apply(("load", 99, list(other)))  # other: device + host
    h.apply(("sync",))
    h.apply(("insert", 99, list(young), False))  # device-only, not backed up; the device pool is now full
    h.apply(("match", 99, list(other), 12))  # other is now more recently used than young
    assert h.device_alloc.available_size() == 0 and h.host_alloc.available_size() == 0

    match = h.cache.match_prefix(chain)
    assert match.host_hit_length == 12
    # room for the load: evict young (write it back: the host is full, so host-evict) and other (backed up)
    loaded, last = h.cache.init_load_back(match.last_host_node)
    load_event = h.controller.start_loading()
    assert len(loaded) == 12, "the load back went ahead"
    load_event.synchronize()
    problems = []
    if not in_tree(h.tree, last):
        problems.append("the chain being loaded was host-evicted: it left the tree with its new device slots")
    where = kv_mismatch(h.pool.buffers, NUM_LAYERS, loaded, expected_codes(chain, 0, 12))
    if where is not None:
        problems.append(f"the loaded KV is not the chain's (its host slots were reused by the write back): {where}")
    try:
        h.cache.check_integrity(0)
    except AssertionError as exc:
        problems.append(str(exc))
    assert not problems, problems


def test_write_through_backs_up_unbacked_ancestors_first(groups, monkeypatch):
    """SGLang 0.5.23's `_build_backup_kv_action`: a node whose parent has no host copy (its write found no host
    room) is backed up after that parent, in one batch, parent first. Here the parent is the request's own
    earlier insert (a prompt checkpointed after its prefill), which its final insert does not count as a hit:
    0.5.18's rule (only under a backed-up parent) left both without a host copy."""
    h = Harness(groups, 1, "write_through")
    key = (7,) * 8 + (8,) * 8
    req = h.begin(key, False)
    h.open.remove(req)  # its slots become the tree's below
    with monkeypatch.context() as patch:
        patch.setattr(h.cache, "allocate", lambda alloc, tokens: None)  # the prompt's host write finds no room
        h.cache.insert(key[:8], req.own[:8])
    parent = h.cache.match_prefix(key[:8]).last_device_node
    assert not parent.backuped
    h.cache.insert(key, req.own, inserted_len=8)  # the answer: a child node below the prompt
    h.cache.flush_pending_backups()
    child = h.cache.match_prefix(key).last_device_node
    assert child.parent is parent and parent.backuped and child.backuped
    assert h.controller.ack_write_queue[-1].node_ids == [parent.id, child.id]
    h.apply(("sync",))
