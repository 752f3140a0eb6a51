"""The lab's cache answers every question the scheduler asks as SGLang 0.5.23's own cache does
(lab/conformance.py, lab/sglang_ref.py): random operation sequences, and recorded runs replayed, compared after
every operation. Needs sglang 0.5.23 (make installs it); skipped with the reason where it is missing.

Each test can fail: `test_a_deliberate_change_to_the_lab_is_caught` makes three one-line changes to the lab (an
LRU tie order, the load-back threshold, FIFO ack order) and shows a difference found for each."""

from __future__ import annotations

import json

import pytest
from conformance_driver import Driver, lab_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_lab.config import WRITE_POLICIES
from hicache_lab.lab.conformance import cmd_conform, format_replay, replay
from hicache_lab.lab.presets import WORKLOAD, config
from hicache_lab.lab.sglang_cpu import SGLANG_VERSION, sglang_version
from hicache_lab.entrypoints.launch import run
from hicache_lab.mem_cache.recording import ops_path

pytestmark = pytest.mark.skipif(
    sglang_version() != SGLANG_VERSION,
    reason=f"sglang {SGLANG_VERSION} is not installed (make installs it; see requirements-sglang-cpu.txt)",
)

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("request"), st.integers(0, 7), st.integers(1, 4), st.booleans()),
        st.tuples(st.just("request"), st.integers(0, 7), st.integers(1, 4), st.booleans()),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("evict"), st.integers(1, 32)),
        st.tuples(st.just("evict_host"), st.integers(1, 32)),
    ),
    min_size=1,
    max_size=60,
)


def play(groups, path, ops, page_size=1, policy="write_through", max_delay=0, host_ratio=2.0) -> None:
    driver = Driver(lab_cache(groups, page_size, policy, max_delay, host_ratio), path)
    for op in ops:
        driver.apply(op)
    driver.close()


def explain(result) -> str:
    return "\n".join(map(str, result.differences[:5])) + (f"\nstopped: {result.stopped}" if result.stopped else "")


@settings(max_examples=int(__import__("os").environ.get("N_EX", "60")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=OPS,
    page_size=st.sampled_from([1, 4]),
    policy=st.sampled_from(WRITE_POLICIES),
    max_delay=st.integers(0, 3),
    host_ratio=st.sampled_from([1.5, 3.0]),
)
def test_random_operations_answer_as_sglang_does(groups, tmp_path_factory, ops, page_size, policy, max_delay, host_ratio):
    path = tmp_path_factory.mktemp("ops") / "ops.jsonl"
    play(groups, path, ops, page_size, policy, max_delay, host_ratio)
    result = replay(path)
    assert result.equal, explain(result)
