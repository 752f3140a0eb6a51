"""Property tests of the radix tree and HiRadixCache: random request-like operation sequences against oracles.

A `Harness` builds one rank's cache with `mem_cache.build.build_cache`, as every run does (device pool, host
pool, virtual copy engine, controller, CacheSync), and plays operations on it the way the scheduler does: a
request matches, locks, optionally loads back (`lock_match`), allocates its own slots, writes its KV, and is
cached (`cache_finished_req`: insert, free duplicates, unlock).
The KV of the token at position p of a sequence is a code derived from a hash of the sequence up to p, so any
slot anywhere can be checked against what it must hold. After every operation the harness checks:

* `check_integrity(held)` (tree invariants and slot accounting of both pools);
* every lock_ref equals the number of lock holders below it (open requests, in-flight writes and loads);
* every device and host slot in the tree holds the right KV, except destinations of copies still in flight;
* `tree.digest()` changes exactly when the tree's structure, tiers, locks or host protection change.

Matches are checked against two oracles: the prefixes the tree holds now (exact) and a naive set of every
page-aligned prefix ever inserted (an upper bound, exact while nothing has left the tree).
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hicache_lab.config import WRITE_POLICIES, CacheConfig, ParallelConfig
from hicache_lab.distributed.cache_sync import CacheSync
from hicache_lab.errors import PoolExhaustedError
from hicache_lab.mem_cache.build import KVShape, build_cache
from hicache_lab.mem_cache.memory_pool import DeviceKVPool
from hicache_lab.mem_cache.radix_tree import RadixTree, TreeNode, page_hashes

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


# -- the harness ----------------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    key: tuple[int, ...]
    prefix: torch.Tensor  # device slots of the cached prefix (the loaded part included)
    own: torch.Tensor  # slots allocated for the rest of the key
    last_node: TreeNode  # locked while the request runs


class Harness:
    def __init__(
        self,
        groups,
        page_size: int,
        policy: str,
        max_delay: int = 0,
        seed: int = 0,
        layout: str = "layer_first",
        load_back_threshold: int = 1,
        checks: bool = True,
        device_tokens: int = DEVICE_TOKENS,
        host_ratio: float = 2.0,
    ):
        self.ps, self.checks = page_size, checks
        self.cfg = CacheConfig(
            max_total_tokens=device_tokens,
            hicache_ratio=host_ratio,
            page_size=page_size,
            enable_hierarchical_cache=True,
            write_policy=policy,
            host_layout=layout,
            load_back_threshold=load_back_threshold,
            max_copy_delay_steps=max_delay,
        )
        sync = CacheSync("fixed", groups, ParallelConfig().fixes)
        kv = KVShape(NUM_LAYERS, num_heads=1, head_dim=2)
        self.pool, self.cache = build_cache(self.cfg, kv, sync, check_copies=True, seed=seed)
        self.controller, self.device_alloc, self.host_alloc = (
            self.cache.controller,
            self.cache.device_alloc,
            self.cache.host_alloc,
        )
        self.engine, self.host_pool = self.controller.engine, self.controller.host_pool
        self.tree = self.cache.tree
        self.open: list[Request] = []
        self.pinned: list[TreeNode] = []  # nodes a test locked by hand
        self.history: list[tuple[int, ...]] = []  # keys requests used, to extend
        self.naive: set = set()  # every page-aligned prefix ever inserted
        self.digest, self.signature = self.tree.digest(), signature(self.tree)
        self.stats = {"inserted": 0, "refused": 0, "loaded": 0, "duplicates_freed": 0, "adopted": 0}

    # -- building keys ----------------------------------------------------------------------------

    def key_from(self, base: int, ext: list[int]) -> tuple[int, ...]:
        """Mostly an extension of a recent key (shared prefixes), sometimes a fresh one."""
        start = self.history[-1 - base % len(self.history)] if self.history and base < 6 else ()
        return (start + tuple(ext))[:MAX_SEQ]

    def pin(self, node: TreeNode) -> None:
        self.tree.inc_lock_ref(node)
        self.pinned.append(node)

    def unpin(self, node: TreeNode) -> None:
        self.tree.dec_lock_ref(node)
        self.pinned.remove(node)

    def held(self) -> int:
        return sum(len(r.own) for r in self.open)

    # -- requests ---------------------------------------------------------------------------------

    def drain(self) -> None:
        """Finish every copy in flight and consume every ack (what waiting steps would do)."""
        for ack in self.controller.ack_write_queue + self.controller.ack_load_queue:
            ack.finish_event.synchronize()
        self.cache.check_hicache_events()
        assert not self.controller.ack_write_queue and not self.controller.ack_load_queue

    def begin(self, key: tuple[int, ...], load_back: bool) -> Request | None:
        """Admit a request as `Scheduler._admit` does; None (nothing held) when it does not fit."""
        key = key[: len(key) // self.ps * self.ps]
        self.history.append(key)
        for attempt in range(2):
            match = self.cache.match_prefix(key)
            self.cache.inc_lock_ref(match.last_device_node)
            if self.cache.device_room() >= len(key) - len(match.device_indices):
                break
            self.cache.dec_lock_ref(match.last_device_node)
            if attempt == 0:
                self.drain()
        else:
            assert self.open, "an idle cache without copies in flight must fit a request of half the pool"
            self.stats["refused"] += 1
            return None
        prefix, last = match.device_indices, match.last_device_node
        if load_back and match.host_hit_length > 0:
            matched = len(prefix) + match.host_hit_length
            prefix, last = self.cache.lock_match(match)
            self.cache.start_loading()
            if len(prefix) > len(match.device_indices):
                assert len(prefix) == matched, "a load back brings back the whole host hit"
                self.stats["loaded"] += 1
        need = len(key) - len(prefix)
        own = self.cache.alloc_device(need) if need else EMPTY  # admission said it fits: no PoolExhaustedError
        write_kv(self.pool, own, expected_codes(key, len(prefix), len(key)))
        req = Request(key, prefix, own, last)
        self.open.append(req)
        return req

    def finish(self, req: Request) -> None:
        """Insert, free duplicates, unlock: `Scheduler._cache_finished_req`."""
        self.open.remove(req)
        slots = torch.cat([req.prefix, req.own])
        anywhere, device = tree_prefixes(self.tree)
        on_device = longest_prefix(req.key, device, self.ps)
        if longest_prefix(req.key, anywhere, self.ps) > on_device:
            self.stats["adopted"] += 1  # host-only nodes on the path take the request's slots
        prefix_len = self.cache.cache_finished_req(req.key, slots, len(req.prefix), req.last_node)
        assert prefix_len == on_device, "insert counts exactly the tokens the tree held on the device"
        assert prefix_len >= len(req.prefix), "the request's locked prefix must still be on the device"
        assert req.key in tree_prefixes(self.tree)[1] or not req.key, "an inserted key is on the device"
        if prefix_len > len(req.prefix):
            self.stats["duplicates_freed"] += 1
        self.naive |= aligned_prefixes(req.key, self.ps)
        self.stats["inserted"] += 1

    # -- operations -------------------------------------------------------------------------------

    def apply(self, op: tuple) -> None:
        kind, *args = op
        getattr(self, f"op_{kind}")(*args)
        if self.checks:
            self.check()

    def op_insert(self, base: int, ext: list[int], load_back: bool) -> None:
        req = self.begin(self.key_from(base, ext), load_back)
        if req is not None:
            self.finish(req)

    def op_begin(self, base: int, ext: list[int], load_back: bool) -> None:
        if len(self.open) < MAX_OPEN:
            self.begin(self.key_from(base, ext), load_back)

    def op_finish(self, which: int) -> None:
        if self.open:
            self.finish(self.open[which % len(self.open)])

    def op_match(self, base: int, ext: list[int], cut: int) -> None:
        self.checked_match(self.key_from(base, ext)[:cut])

    def op_load(self, base: int, ext: list[int]) -> None:
        """Load back a host hit; once the load is done a fresh match holds it all on the device."""
        query = self.key_from(base, ext)
        match = self.checked_match(query)
        if match.host_hit_length == 0:
            return
        matched = len(match.device_indices) + match.host_hit_length
        loaded, last = self.cache.init_load_back(match.last_host_node)
        load_event = self.controller.start_loading()
        if len(loaded) == 0:
            assert load_event is None, "nothing loaded, nothing started"
            assert not last.evicted and depth(last) == len(match.device_indices)
            return
        assert last is match.last_host_node and len(loaded) == match.host_hit_length
        self.stats["loaded"] += 1
        load_event.synchronize()
        fresh = self.checked_match(query)
        assert len(fresh.device_indices) == matched, (
            f"loaded back {len(loaded)} tokens, but a fresh match holds {len(fresh.device_indices)} of the "
            f"{matched} matched before on the device"
        )

    def op_evict(self, num_tokens: int) -> None:
        locked = [n for _, n in tree_paths(self.tree) if n.lock_ref > 0]
        evictable, available = self.tree.evictable_size(), self.device_alloc.available_size()
        freed = self.cache.evict(num_tokens)
        assert min(num_tokens, evictable) <= freed <= evictable
        assert self.device_alloc.available_size() == available + freed
        for node in locked:
            assert in_tree(self.tree, node) and not node.evicted, f"locked node {node.id} was evicted"

    def op_evict_host(self, num_tokens: int) -> None:
        device = {path for path, n in tree_paths(self.tree) if not n.evicted}
        host_only = sum(len(n.host_value) for _, n in tree_paths(self.tree) if n.evicted)
        available = self.host_alloc.available_size()
        freed = self.cache.evict_host(num_tokens)
        assert min(num_tokens, host_only) <= freed <= host_only
        assert self.host_alloc.available_size() == available + freed
        assert {path for path, n in tree_paths(self.tree) if not n.evicted} == device, "evict_host touched the device"

    def op_step(self) -> None:
        self.engine.advance(self.engine.step + 1)
        self.cache.check_hicache_events()

    def op_sync(self) -> None:
        """Force every copy done, consume every ack: then every slot in the tree holds its KV, no exceptions."""
        self.drain()
        self.check_kv(in_flight=False)
        assert not self.controller.copy_check.mismatched, self.controller.copy_check.mismatched

    # -- checks -----------------------------------------------------------------------------------

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
        assert match.last_host_node.backuped
        if match.host_hit_length:
            assert depth(match.last_host_node) == matched
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

    def close(self) -> None:
        """End of a run: finish every request, drain, check everything once more."""
        while self.open:
            self.finish(self.open[0])
        self.op_sync()
        self.check()


# -- operation strategies ---------------------------------------------------------------------------

_tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
_base = st.integers(0, 7)
_insert = st.tuples(st.just("insert"), _base, _tokens, st.booleans())
OPS = st.lists(
    st.one_of(
        _insert,
        _insert,
        _insert,
        st.tuples(st.just("begin"), _base, _tokens, st.booleans()),
        st.tuples(st.just("finish"), st.integers(0, MAX_OPEN - 1)),
        st.tuples(st.just("match"), _base, _tokens, st.integers(0, MAX_SEQ)),
        st.tuples(st.just("load"), _base, _tokens),
        st.tuples(st.just("evict"), st.integers(1, DEVICE_TOKENS)),
        st.tuples(st.just("evict_host"), st.integers(1, 2 * DEVICE_TOKENS)),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("sync")),
    ),
    min_size=20,
    max_size=80,
)
ENGINE = st.fixed_dictionaries(
    {
        "max_delay": st.integers(0, 3),
        "seed": st.integers(0, 2**16),
        "layout": st.sampled_from(["layer_first", "page_first"]),
        "load_back_threshold": st.sampled_from([1, 8]),
    }
)
POLICIES = pytest.mark.parametrize("policy", WRITE_POLICIES)
PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 4])


@PAGE_SIZES
@POLICIES
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=ENGINE, ops=OPS)
def test_random_operations_keep_the_cache_consistent(groups, page_size, policy, engine, ops):
    """Integrity, lock bookkeeping, KV contents, digests and matches hold after every operation."""
    harness = Harness(groups, page_size, policy, **engine)
    for op in ops:
        harness.apply(op)
    harness.close()
    for name, count in harness.stats.items():  # shown by --hypothesis-show-statistics
        if count:
            event(name)


@PAGE_SIZES
@POLICIES
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=ENGINE, ops=OPS)
def test_same_operations_give_the_same_cache(groups, page_size, policy, engine, ops):
    """Two caches fed the same operations with the same seed hold the same tree, slot for slot, at every step."""
    a = Harness(groups, page_size, policy, checks=False, **engine)
    b = Harness(groups, page_size, policy, checks=False, **engine)
    for op in ops:
        a.apply(op)
        b.apply(op)
        assert a.tree.digest() == b.tree.digest()
        assert snapshot(a.tree) == snapshot(b.tree)
        assert a.device_alloc.available_size() == b.device_alloc.available_size()
        assert a.engine.step == b.engine.step


def test_random_operations_exercise_every_path(groups):
    """Guard against a vacuous property test: one fixed long run reaches eviction, load-back and duplicates."""
    rng = random.Random(0)
    harness = Harness(groups, 4, "write_through", max_delay=2, seed=1)
    for _ in range(400):
        roll = rng.random()
        ext = [rng.randrange(VOCAB) for _ in range(rng.randrange(13))]
        if roll < 0.45:
            harness.apply(("insert", rng.randrange(8), ext, rng.random() < 0.5))
        elif roll < 0.55:
            harness.apply(("begin", rng.randrange(8), ext, True))
        elif roll < 0.65:
            harness.apply(("finish", rng.randrange(MAX_OPEN)))
        elif roll < 0.75:
            harness.apply(("load", rng.randrange(8), ext))
        elif roll < 0.85:
            harness.apply(("match", rng.randrange(8), ext, rng.randrange(MAX_SEQ)))
        elif roll < 0.97:
            harness.apply(("step",))
        else:
            harness.apply(("evict_host", rng.randrange(1, 64)))
    harness.close()
    stats = harness.stats
    assert stats["inserted"] > 100 and stats["loaded"] > 0 and stats["duplicates_freed"] > 0, stats
    assert stats["adopted"] > 0, stats


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
    assert tree.device_leaves() == [] and tree.host_leaves() == []

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
