"""How bench/radix_speed.py times an implementation: one replay of a page size's keys from empty, each operation
timed alone; the check of the implementations against each other; the median rates of several replays.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable

import torch

from bench.common import check
from bench.radix_impls import LabTree, NaivePrefixDict
from bench.radix_sglang import SGLangApi, SGLangTreeProbe
from hicache_lab.mem_cache.radix_tree import Key

OPERATIONS = ("match", "insert", "evict")


@dataclasses.dataclass
class KeyStream:
    """What every implementation is given, request by request, at one page size."""

    page_size: int
    match_keys: list[Key]  # prompt[:-1], page-aligned
    insert_keys: list[Key]  # prompt + output, page-aligned
    slots: list[torch.Tensor]  # fresh slots for each insert key, one per token


# -- replay ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TreeReplay:
    """One replay of a key stream through one tree: the time and count of each operation, and what the tree
    answered until its first eviction (match lengths and slots, sizes)."""

    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0.0))
    counts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0))
    match_lens: list[int] = dataclasses.field(default_factory=list)
    match_slots: list[torch.Tensor] = dataclasses.field(default_factory=list)  # until the first eviction
    sizes: list[int] = dataclasses.field(default_factory=list)  # tokens held after each insert, before eviction
    first_evict: int | None = None  # index of the request after whose insert the first eviction ran
    evicted_tokens: int = 0

    @property
    def matched_tokens(self) -> int:
        return sum(self.match_lens)


def replay(impl, stream: KeyStream, capacity: int) -> TreeReplay:
    """One pass over `stream` (keys prepared first, untimed) with garbage collection off."""
    match_keys = [impl.prepare_key(k) for k in stream.match_keys]
    insert_keys = [impl.prepare_key(k) for k in stream.insert_keys]
    result = TreeReplay()
    gc.collect()
    gc.disable()
    try:
        for i, (match_key, insert_key, value) in enumerate(zip(match_keys, insert_keys, stream.slots, strict=True)):
            _match_then_insert(impl, result, match_key, insert_key, value)
            _evict_down_to(impl, result, capacity, i)
    finally:
        gc.enable()
    result.counts["match"] = result.counts["insert"] = len(stream.insert_keys)
    return result


def _match_then_insert(impl, result: TreeReplay, match_key, insert_key, value: torch.Tensor) -> None:
    clock = time.perf_counter
    t0 = clock()
    got = impl.match(match_key)
    t1 = clock()
    impl.insert(insert_key, value)
    t2 = clock()
    result.seconds["match"] += t1 - t0
    result.seconds["insert"] += t2 - t1
    result.match_lens.append(len(got))
    if result.first_evict is None:
        result.match_slots.append(got)
    result.sizes.append(impl.size)


def _evict_down_to(impl, result: TreeReplay, capacity: int, request: int) -> None:
    """Evict what `impl` holds beyond `capacity`; a call with nothing to free is neither made nor counted."""
    excess = impl.size - capacity
    if excess <= 0:
        return
    clock = time.perf_counter
    t0 = clock()
    freed = impl.evict(excess)
    t1 = clock()
    result.seconds["evict"] += t1 - t0
    result.counts["evict"] += 1
    result.evicted_tokens += freed
    if result.first_evict is None:
        result.first_evict = request


def compare(reference: TreeReplay, other: TreeReplay, names: str) -> int:
    """Assert `other` matched what `reference` did until the first eviction; returns the matches compared."""
    check(
        reference.first_evict == other.first_evict,
        f"{names}: first eviction after request {reference.first_evict} vs {other.first_evict}",
    )
    last = len(reference.match_lens) - 1 if reference.first_evict is None else reference.first_evict
    check(reference.sizes[: last + 1] == other.sizes[: last + 1], f"{names}: cache sizes differ before eviction")
    for i in range(last + 1):
        a, b = reference.match_lens[i], other.match_lens[i]
        check(a == b, f"{names}: request {i} matched {a} vs {b} tokens before any eviction")
        check(torch.equal(reference.match_slots[i].cpu(), other.match_slots[i].cpu()), f"{names}: request {i} slots")
    return last + 1


# -- one page size --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Contenders:
    """The implementations measured at one page size; sglang may drop out, `status` says why."""

    factories: dict[str, Callable[[], object]]
    status: str
    checked: dict[str, TreeReplay] = dataclasses.field(default_factory=dict)  # the untimed replay of each

    def drop_sglang(self, status: str) -> None:
        self.status = status
        self.factories.pop("sglang", None)
        self.checked.pop("sglang", None)


def contenders(page_size: int, sglang: SGLangApi | None, status: str) -> Contenders:
    factories: dict[str, Callable[[], object]] = {
        "lab": lambda: LabTree(page_size),
        "naive": lambda: NaivePrefixDict(page_size),
    }
    if sglang is not None:
        factories["sglang"] = lambda: SGLangTreeProbe(sglang, page_size)
    return Contenders(factories, status)


def check_replays(race: Contenders, stream: KeyStream, capacity: int) -> int:
    """The untimed replay: the lab and naive must agree until the first eviction, sglang too or it drops out.
    Returns how many matches were compared."""
    instances = {name: factory() for name, factory in race.factories.items()}
    for name, impl in instances.items():
        try:
            race.checked[name] = replay(impl, stream, capacity)
        except Exception as e:
            if name != "sglang":
                raise
            race.drop_sglang(f"skipped: failed on the key stream ({type(e).__name__}: {e})")
    instances["lab"].tree.check_integrity()
    check(instances["lab"].size == instances["lab"].tree.device_size(), "lab size bookkeeping drifted")
    verified = compare(race.checked["lab"], race.checked["naive"], "lab vs naive")
    if "sglang" in race.checked:
        try:
            compare(race.checked["naive"], race.checked["sglang"], "sglang vs naive")
        except AssertionError as e:
            race.drop_sglang(f"skipped: disagrees with the naive baseline ({e})")
    return verified


def median_rates(race: Contenders, stream: KeyStream, capacity: int, repeats: int) -> dict[str, dict]:
    """{implementation: {operation: median ops/s or None}} over `repeats` timed replays, taken in turn."""
    rates: dict[str, dict[str, list[float]]] = {name: {op: [] for op in OPERATIONS} for name in race.factories}
    for _ in range(repeats):
        for name, factory in list(race.factories.items()):
            try:
                result = replay(factory(), stream, capacity)
            except Exception as e:
                if name != "sglang":
                    raise
                race.drop_sglang(f"skipped: failed during a timed replay ({type(e).__name__}: {e})")
                del rates[name]
                continue
            for op in OPERATIONS:
                if result.counts[op]:
                    rates[name][op].append(result.counts[op] / result.seconds[op])
    return {name: {op: statistics.median(r) if r else None for op, r in ops.items()} for name, ops in rates.items()}


def bench_page_size(stream: KeyStream, capacity: int, repeats: int, sglang: SGLangApi | None, status: str):
    """Median rates per implementation and operation, details of the checked replay, how many matches were
    compared, and the sglang status (it may turn to skipped here)."""
    race = contenders(stream.page_size, sglang, status)
    verified = check_replays(race, stream, capacity)
    medians = median_rates(race, stream, capacity, repeats)
    details = {
        name: {
            "ops": r.counts,
            "matched_tokens": r.matched_tokens,
            "evicted_tokens": r.evicted_tokens,
            "first_eviction_after_request": r.first_evict,
        }
        for name, r in race.checked.items()
    }
    return medians, details, verified, race.status
