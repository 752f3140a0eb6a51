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

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from radix_harness import Harness
from radix_oracle import DEVICE_TOKENS, MAX_OPEN, MAX_SEQ, VOCAB, snapshot

from hicache_lab.config import WRITE_POLICIES

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
