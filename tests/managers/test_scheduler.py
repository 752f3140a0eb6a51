"""The scheduler alone, on one rank's real cache (mem_cache/build.py) without a model: sampled tokens are
given by the test. What it must do: admit while requests fit (at most `max_running`), decode otherwise, let a
request wait until its whole sequence fits, fail clearly on one that never can, lock a running request's
prefix, cache finished requests for the next ones, and load host hits back before the forward pass reads them.
"""

from __future__ import annotations

import pytest

from hicache_lab.config import CacheConfig
from hicache_lab.distributed.cache_sync import CacheSync
from hicache_lab.errors import PoolExhaustedError
from hicache_lab.managers.schedule_batch import Req
from hicache_lab.managers.schedule_policy import PrefillAdder
from hicache_lab.managers.scheduler import Scheduler
from hicache_lab.managers.scheduler_pp import decode_requests, encode_requests
from hicache_lab.mem_cache.build import KVShape, build_cache
from hicache_lab.parallel_config import ParallelConfig


def scheduler(groups, tokens: int = 64, max_running: int = 4, hicache: bool = False) -> Scheduler:
    cfg = CacheConfig(
        max_total_tokens=tokens, enable_hierarchical_cache=hicache, load_back_threshold=1, max_copy_delay_steps=0
    )
    _, cache = build_cache(cfg, KVShape(num_layers=1, num_heads=1, head_dim=2), CacheSync(groups, ParallelConfig()))
    return Scheduler(cache, max_running)


def req(rid: int, prompt: list[int], new_tokens: int = 2) -> Req:
    return Req(rid, client=rid, round=0, prompt=list(prompt), max_new_tokens=new_tokens)


def step(s: Scheduler, iteration: int, token: int = 7):
    """One scheduler step, its sampled tokens given back at once: (batch, finished requests)."""
    batch = s.schedule(iteration)
    return batch, s.process_result(batch, [token] * len(batch.reqs), None)


def test_admits_up_to_max_running_then_decodes_then_admits_the_rest(groups):
    s = scheduler(groups, max_running=2)
    s.add([req(i, [10 * i + j for j in range(8)]) for i in range(3)])
    kinds = []
    for i in range(4):
        batch, _ = step(s, i)
        kinds.append((batch.kind, [r.rid for r in batch.reqs]))
    assert kinds == [("prefill", [0, 1]), ("decode", [0, 1]), ("prefill", [2]), ("decode", [2])]


def served(s: Scheduler, prompt: list[int]) -> Req:
    """A request of two output tokens, run to its end (steps 0 and 1)."""
    done = req(0, prompt)
    s.add([done])
    step(s, 0)
    step(s, 1)
    return done


def test_a_finished_request_is_cached_for_the_next_one(groups):
    s = scheduler(groups)
    first = served(s, list(range(16)))
    assert first.finished and first.kv_len == 17  # the last sampled token has no KV yet
    second = req(1, first.prompt + first.output + [99, 98, 97])
    s.add([second])
    batch, _ = step(s, 2)
    assert batch.kind == "prefill" and second.cached_device == 17
    assert batch.forward.positions.tolist() == list(range(17, 21))  # only the new tokens are computed


def test_a_request_waits_until_its_whole_sequence_fits(groups):
    s = scheduler(groups, tokens=64)
    a, b = req(0, list(range(38)), new_tokens=2), req(1, list(range(100, 138)), new_tokens=2)
    s.add([a, b])
    batch, _ = step(s, 0)
    assert [r.rid for r in batch.reqs] == [0]  # 40 + 40 slots do not fit 64
    batch, finished = step(s, 1)
    assert batch.kind == "decode" and finished == [a]
    batch, _ = step(s, 2)
    assert [r.rid for r in batch.reqs] == [1]  # a's cached prefix was evicted to make room
    assert s.cache.tree.device_size() < 39


def test_a_request_that_can_never_fit_fails_naming_the_flag(groups):
    s = scheduler(groups, tokens=64)
    s.add([req(0, list(range(70)))])
    with pytest.raises(PoolExhaustedError, match="can never fit the device pool: raise --max-total-tokens"):
        s.schedule(0)


def test_a_lock_no_one_releases_is_named_not_the_pool_size(groups):
    """A node locked by no request and no copy (a lock taken and never released) keeps the pool full: the error
    says so instead of asking for a larger pool."""
    s = scheduler(groups, tokens=64)
    leaked = served(s, list(range(40)))
    s.cache.inc_lock_ref(leaked.last_node)
    s.add([req(1, [100 + i for i in range(40)])])
    with pytest.raises(PoolExhaustedError, match="tokens are locked with no request or copy holding them"):
        s.schedule(2)


def test_a_running_request_locks_its_prefix_until_it_finishes(groups):
    s = scheduler(groups)
    first = served(s, list(range(16)))
    second = req(1, first.prompt + first.output + [50, 51], new_tokens=3)
    s.add([second])
    step(s, 2)
    assert second.last_node.lock_ref == 1 and s.cache.tree.evictable_size() == 0
    step(s, 3)
    step(s, 4)
    assert second.finished and second.last_node.lock_ref == 0
    s.cache.check_integrity(s.held_by_requests())  # every slot is free or in the tree again


def test_a_host_hit_is_loaded_back_and_the_forward_pass_waits_for_it(groups):
    s = scheduler(groups, tokens=48, hicache=True)
    first = served(s, list(range(20)))
    other = req(1, list(range(100, 140)), new_tokens=2)  # needs the whole pool: `first` goes to the host
    s.add([other])
    for i in range(2, 6):
        step(s, i)
    assert other.finished
    again = req(2, first.prompt + first.output + [60])
    s.add([again])
    batch = s.schedule(6)
    assert batch.kind == "prefill" and again.cached_host == 21 and again.cached_device == 0
    assert batch.forward.load_event is not None  # each layer's attention waits for that layer's bytes


def test_requests_with_the_same_prompt_at_once_return_their_duplicate_slots(groups):
    s = scheduler(groups, tokens=64)
    prompt = list(range(200, 216))
    twins = [req(0, prompt), req(1, prompt)]
    s.add(twins)
    batch, _ = step(s, 0)
    assert [r.cached_device for r in batch.reqs] == [0, 0]  # neither finds the other: both compute the prompt
    step(s, 1)
    assert all(r.finished for r in twins) and not s.running
    s.cache.check_integrity()  # the second insert found the first's pages: its own copies went back to the pool
    assert s.cache.device_alloc.available_size() + s.cache.tree.device_size() == 64


def test_a_prefix_split_between_device_and_host_is_unlocked_when_its_request_ends(groups):
    s = scheduler(groups, tokens=48, hicache=True)
    first = served(s, list(range(20)))
    branch = req(1, list(range(10)) + list(range(300, 310)))  # shares 10 tokens: the tree splits there
    s.add([branch])
    for i in range(2, 4):
        step(s, i)
    filler = req(2, list(range(400, 426)), new_tokens=2)  # room for it evicts the two tails to the host
    s.add([filler])
    for i in range(4, 8):
        step(s, i)
    again = req(3, first.prompt + first.output + [61])
    s.add([again])
    for i in range(8, 11):
        step(s, i)
    assert again.finished and again.cached_device == 10 and again.cached_host == 11  # device head, host tail
    assert all(node.lock_ref == 0 for node in s.cache.tree.nodes()), "a lock outlived its request"
    s.cache.check_integrity()


def test_a_full_batch_stays_full_until_a_request_leaves(groups):
    """SGLang's sticky `batch_is_full`: once admission ran out of device room, it is not tried again until a
    request leaves the batch, even where room has grown meanwhile (here the output estimate decayed)."""
    s = scheduler(groups, tokens=64)
    a, b = req(0, list(range(24)), new_tokens=32), req(1, list(range(100, 116)), new_tokens=2)
    a.ignore_eos = False  # its remaining answer is reserved times the estimate
    s.add([a, b])
    batch, _ = step(s, 0)
    assert [r.rid for r in batch.reqs] == [0] and s.batch_is_full == [True]  # b's 19 slots do not fit
    s.new_token_ratio.current = 0.1  # a's remaining answer now reserves 3 slots: b would fit
    batch, _ = step(s, 1)
    assert batch.kind == "decode" and b in s.waiting
    iteration = 2
    while not a.finished:
        batch, finished = step(s, iteration)
        assert batch.kind == "decode" and s.batch_is_full == [not finished]  # cleared as a leaves
        iteration += 1
    batch, _ = step(s, iteration)
    assert [r.rid for r in batch.reqs] == [1]


def test_the_output_estimate_resets_only_when_fully_idle(groups):
    """SGLang's `on_idle`: an idle step resets `new_token_ratio` only with nothing running and nothing waiting.
    Here b waits (a's prefix stays locked while its host write is in flight), so the ratio is kept."""
    cfg = CacheConfig(max_total_tokens=64, enable_hierarchical_cache=True, max_copy_delay_steps=6)
    _, cache = build_cache(cfg, KVShape(num_layers=1, num_heads=1, head_dim=2), CacheSync(groups, ParallelConfig()))
    s = Scheduler(cache, 4)
    a = req(0, list(range(40)), new_tokens=2)
    s.add([a])
    step(s, 0)
    step(s, 1)
    assert a.finished
    s.add([req(1, list(range(100, 160)), new_tokens=2)])  # needs a's slots, locked until its write ack
    s.new_token_ratio.current = 0.3
    iteration, idle = 2, 0
    while s.waiting:  # idle until the ack is consumed, then b is admitted
        batch, _ = step(s, iteration)
        idle += batch.kind == "idle"
        assert s.new_token_ratio.current == 0.3
        iteration += 1
    assert idle > 0 and batch.kind == "prefill"


def test_a_running_request_that_ignores_eos_reserves_its_whole_remaining_answer(groups):
    """SGLang 0.5.23's `_get_running_request_total_token_offset`: a fixed-length request (bench_multiturn sends
    ignore_eos, as every lab request is) reserves all of its remaining output; only one that may stop early
    reserves it times `new_token_ratio`."""
    s = scheduler(groups, tokens=64)
    a = req(0, list(range(24)), new_tokens=32)
    s.add([a])
    step(s, 0)  # a prefilled, one token answered: 31 to go
    assert PrefillAdder(s.cache, [a], 0.1, 16384, None).total_offset == 31
    a.ignore_eos = False
    assert PrefillAdder(s.cache, [a], 0.1, 16384, None).total_offset == pytest.approx(3.1)


def test_the_pipeline_relays_every_field_admission_reads():
    """Stage 0 sends new requests to the later stages as one tensor: each field the scheduler decides on (here
    `ignore_eos`, which sizes the reservation) arrives as sent, or the stages admit differently."""
    sent = [req(3, [5, 6, 7], new_tokens=9), req(4, [8], new_tokens=2)]
    sent[1].ignore_eos, sent[0].upper_bound_cached = False, 2
    got, new_round, stop = decode_requests(encode_requests(sent, True, False))
    fields = ("rid", "client", "round", "prompt", "max_new_tokens", "ignore_eos", "upper_bound_cached")
    assert [[getattr(r, f) for f in fields] for r in got] == [[getattr(r, f) for f in fields] for r in sent]
    assert (new_round, stop) == (True, False)
