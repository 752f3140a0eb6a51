"""The lab's cache answers every question the scheduler asks as SGLang 0.5.23's own cache does
(lab/sglang/replay.py, lab/sglang/cache.py): random operation sequences, and recorded runs replayed, compared after
every operation. Needs sglang 0.5.23 (make installs it); skipped with the reason where it is missing.

Each test can fail: `test_a_deliberate_change_to_the_lab_is_caught` makes three one-line changes to the lab (the
LRU order, the load-back threshold, FIFO ack order) and finds a difference for each in the seeded sequences that
`test_seeded_sequences_answer_as_sglang_does` finds none in. (A change of the LRU *tie* order cannot be seen: the
logical clock gives every touch its own tick, in the lab as in SGLang, so two leaves never tie.)"""

from __future__ import annotations

import importlib
import random

import pytest
from conformance_driver import Driver, lab_cache, random_ops
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_lab.config import WRITE_POLICIES
from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, install_cpu_replacements, prepare_imports, sglang_version
from hicache_lab.lab.sglang.replay import replay
from hicache_lab.mem_cache import radix_tree
from hicache_lab.mem_cache.hiradix_cache import HiRadixCache

pytestmark = pytest.mark.skipif(
    sglang_version() != SGLANG_VERSION,
    reason=f"sglang {SGLANG_VERSION} is not installed (make installs it; see requirements-sglang-cpu.txt)",
)

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("request"), st.integers(0, 5), st.integers(1, 8), st.booleans()),
        st.tuples(st.just("request"), st.integers(0, 5), st.integers(1, 8), st.booleans()),
        st.tuples(st.just("decode"), st.integers(0, 7)),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("retract"), st.integers(0, 7)),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("evict"), st.integers(1, 32)),
        st.tuples(st.just("evict_host"), st.integers(1, 32)),
    ),
    min_size=30,
    max_size=120,
)


def play(groups, path, ops, page_size=1, policy="write_through", max_delay=0, host_ratio=2.0) -> None:
    driver = Driver(lab_cache(groups, page_size, policy, max_delay, host_ratio), path)
    for op in ops:
        driver.apply(op)
    driver.close()


def explain(result) -> str:
    return "\n".join(map(str, result.differences[:5])) + (f"\nstopped: {result.stopped}" if result.stopped else "")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=OPS,
    page_size=st.sampled_from([1, 4]),
    policy=st.sampled_from(WRITE_POLICIES),
    max_delay=st.integers(0, 3),
    host_ratio=st.sampled_from([1.5, 3.0]),
)
@pytest.mark.slow
def test_random_operations_answer_as_sglang_does(
    groups, tmp_path_factory, ops, page_size, policy, max_delay, host_ratio
):
    path = tmp_path_factory.mktemp("ops") / "ops.jsonl"
    play(groups, path, ops, page_size, policy, max_delay, host_ratio)
    result = replay(path)
    assert result.equal, explain(result)


# -- the suite can fail: the same seeded sequences, before and after a deliberate one-line change ------------

SEEDS = range(24)  # among them, requests that find exactly 10 tokens on the host only (seeds 14, 18, 20)
CONFIGS = [  # (page size, policy, max delay, host ratio), cycled over the seeds
    (1, "write_through", 2, 1.5),
    (4, "write_through_selective", 1, 3.0),
    (1, "write_back", 3, 3.0),
    (4, "write_through", 0, 1.5),
]


def seeded_differences(groups, tmp_path, **overrides) -> list[str]:
    """Play 24 seeded sequences of 200 operations; the first difference of each that differs."""
    found = []
    for seed in SEEDS:
        page_size, policy, max_delay, host_ratio = CONFIGS[seed % len(CONFIGS)]
        path = tmp_path / f"ops{seed}.jsonl"
        driver = Driver(lab_cache(groups, page_size, policy, max_delay, host_ratio, **overrides), path)
        for op in random_ops(random.Random(seed), 200):
            driver.apply(op)
        driver.close()
        result = replay(path)
        if not result.equal:
            found.append(f"seed {seed}: {result.differences[0] if result.differences else result.stopped}")
    return found


def test_seeded_sequences_answer_as_sglang_does(groups, tmp_path):
    assert seeded_differences(groups, tmp_path) == []


def _evict_oldest_first(nodes) -> list:  # radix_tree.lru_order with its entries' two keys swapped
    return [(n.id, n.last_access, n) for n in nodes]


_consume_acks_oldest_first = HiRadixCache._consume_acks


def _consume_acks_newest_first(self, queue, name, ongoing, count):  # HiRadixCache._consume_acks from the tail
    queue.reverse()
    try:
        return _consume_acks_oldest_first(self, queue, name, ongoing, count)
    finally:
        queue.reverse()


_insert_counting_own_hits = HiRadixCache._insert


def _count_own_inserts_again(self, key, value, inserted_len=0):  # HiRadixCache._insert ignoring `inserted_len`
    return _insert_counting_own_hits(self, key, value, 0)


@pytest.mark.parametrize("change", ["lru_order", "load_back_threshold", "ack_order", "own_insert_hits"])
def test_a_deliberate_change_to_the_lab_is_caught(change, groups, tmp_path, monkeypatch):
    """Each change is one line of the lab: evict by node age instead of last use (radix_tree.lru_order), load
    back from 11 tokens instead of SGLang's 10 (config.CacheConfig.load_back_threshold; the same as `<` made `<=`
    in HiRadixCache.load_back), consume acks newest first (HiRadixCache._consume_acks), count a
    hit again when a request inserts what its own prefill inserted (SGLang 0.5.18's behaviour, HiRadixCache._insert
    with `inserted_len` ignored)."""
    overrides = {}
    if change == "lru_order":
        monkeypatch.setattr(radix_tree, "lru_order", _evict_oldest_first)
    elif change == "load_back_threshold":
        overrides["load_back_threshold"] = 11
    elif change == "own_insert_hits":
        monkeypatch.setattr(HiRadixCache, "_insert", _count_own_inserts_again)
    else:
        monkeypatch.setattr(HiRadixCache, "_consume_acks", _consume_acks_newest_first)
    assert seeded_differences(groups, tmp_path, **overrides), f"the {change} change went unnoticed"


def test_a_replaced_sglang_function_that_moved_fails_loudly(monkeypatch):
    prepare_imports()
    common = importlib.import_module("sglang.srt.mem_cache.pool_host.common")
    monkeypatch.delattr(common, "ALLOC_MEMORY_FUNCS")
    with pytest.raises(RuntimeError, match="moved.*ALLOC_MEMORY_FUNCS"):
        install_cpu_replacements()
