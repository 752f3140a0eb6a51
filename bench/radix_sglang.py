"""SGLang's own `RadixCache` (`sglang.srt.mem_cache.radix_cache`) for bench/radix_speed.py, whichever version is
installed.

Its API differs between versions, so `probe_sglang` tries every known way of building and calling it on a tiny
example and keeps the first that behaves as a radix tree. `SGLangTreeProbe` then offers what the other
implementations (radix_impls.py) offer: `name`, `size`, prepare_key, match, insert and evict.

Beside a CPU torch, sglang 0.5.23 (the `sglang` extra) imports only with the lab's torchvision placeholders
(`hicache_lab.lab.sglang.cpu.prepare_imports`); another version is imported without them, which works where a
torchvision that loads is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
from array import array
from collections.abc import Callable

import torch

from bench.common import check
from hicache_lab.lab.sglang.cpu import prepare_imports, quiet_imports
from hicache_lab.mem_cache.radix_tree import Key


class SlotSink:
    """Stands in for SGLang's `token_to_kv_pool_allocator`: a simulated tree only frees slots into it."""

    def __init__(self, page_size: int):
        self.device = torch.device("cpu")  # read by the constructor of some versions
        self.page_size = page_size
        self.freed = 0

    def free(self, indices, *args, **kwargs) -> None:
        self.freed += len(indices)

    free_segment = free  # newer versions free a kv-row segment

    def available_size(self) -> int:
        return 0


@dataclasses.dataclass
class SGLangApi:
    """How the installed SGLang's RadixCache is built and called, found by `probe_sglang`."""

    version: str
    description: str
    new_cache: Callable[[SlotSink, int], object]
    make_key: Callable[[Key], object]
    match: Callable[[object, object], torch.Tensor]  # (cache, key) -> slots of the match
    insert: Callable[[object, object, torch.Tensor], int]  # (cache, key, slots) -> prefix_len
    evict: Callable[[object, SlotSink, int], None]


class SGLangTreeProbe:
    """SGLang's RadixCache alone, called through the API `probe_sglang` found, behind the interface of the trees
    in radix_impls.py (it counts the tokens it holds; freed slots go to a `SlotSink`)."""

    name = "sglang"

    def __init__(self, api: SGLangApi, page_size: int):
        self.api, self.sink = api, SlotSink(page_size)
        self.cache = api.new_cache(self.sink, page_size)
        self._match, self._insert, self._evict = api.match, api.insert, api.evict
        self.size = 0

    def prepare_key(self, key: Key):
        return self.api.make_key(key)

    def match(self, key) -> torch.Tensor:
        return self._match(self.cache, key)

    def insert(self, key, value: torch.Tensor) -> None:
        self.size += len(value) - self._insert(self.cache, key, value)

    def evict(self, num_tokens: int) -> int:
        before = self.sink.freed
        self._evict(self.cache, self.sink, num_tokens)
        freed = self.sink.freed - before
        self.size -= freed
        return freed


def _parameter_classes(module) -> dict[str, type | None]:
    """The parameter objects of newer versions (beside the base class), None where this version has none."""
    try:
        base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    except ImportError:
        base = None
    found = {name: getattr(base, name, None) for name in ("MatchPrefixParams", "InsertParams", "EvictParams")}
    return {**found, "CacheInitParams": getattr(module, "CacheInitParams", None)}


def _pools(sink: SlotSink) -> dict:
    """No request-to-token map (nothing runs), the sink as the KV allocator."""
    return {"req_to_token_pool": None, "token_to_kv_pool_allocator": sink}


def _constructors(cls, init_params, page_size: int) -> list[tuple[str, Callable]]:
    found = []
    if hasattr(cls, "create_simulated"):
        found.append(("create_simulated", lambda sink, ps: cls.create_simulated(mock_allocator=sink, page_size=ps)))
    if init_params is not None:
        found.append(
            ("CacheInitParams", lambda sink, ps: cls(init_params(disable=False, **_pools(sink), page_size=ps)))
        )
    found.append(("keywords", lambda sink, ps: cls(**_pools(sink), page_size=ps)))
    if page_size == 1:  # before paging: RadixCache(req_to_token_pool, token_to_kv_pool, disable=False)
        found.append(("token_to_kv_pool", lambda sink, ps: cls(req_to_token_pool=None, token_to_kv_pool=sink)))
    return found


def _key_makers(radix_key) -> list[tuple[str, Callable]]:
    found = []
    if radix_key is not None:
        found.append(("RadixKey(array)", lambda key: radix_key(array("q", key), None)))
        found.append(("RadixKey(list)", lambda key: radix_key(list(key), None)))
    return [*found, ("list", list)]


def _matcher(call, slots):
    return lambda cache, key: slots(cache, call(cache, key))


def _match_callers(match_params) -> list[tuple[str, Callable]]:
    """What match_prefix returns, by version: MatchResult(device_indices, ...); newer MatchResult(device_prefix_len,
    last_device_node, ...) whose slots lie on the path to that node; oldest a tuple (indices, last_node)."""
    slot_getters = [
        ("device_indices", lambda cache, result: result.device_indices),
        ("path_device_indices", lambda cache, result: cache.path_device_indices(result.last_device_node)),
        ("result[0]", lambda cache, result: result[0]),
    ]
    calls = [("match_prefix(key)", lambda cache, key: cache.match_prefix(key))]
    if match_params is not None:
        calls.insert(0, ("MatchPrefixParams", lambda cache, key: cache.match_prefix(match_params(key=key))))
    return [(f"{c} -> {s}", _matcher(call, get)) for (c, call), (s, get) in itertools.product(calls, slot_getters)]


def _inserter(call, prefix_len):
    return lambda cache, key, value: prefix_len(call(cache, key, value))


def _insert_callers(insert_params) -> list[tuple[str, Callable]]:
    """insert returns InsertResult(prefix_len, ...) with parameter objects, an int before them."""
    prefix_getters = [("prefix_len", lambda result: result.prefix_len), ("int", int)]
    calls = [("insert(key, value)", lambda cache, key, value: cache.insert(key, value))]
    if insert_params is not None:
        calls.insert(0, ("InsertParams", lambda cache, key, value: cache.insert(insert_params(key=key, value=value))))
    return [(f"{c} -> {p}", _inserter(call, get)) for (c, call), (p, get) in itertools.product(calls, prefix_getters)]


def _evict_callers(evict_params) -> list[tuple[str, Callable]]:
    found = [
        ("evict(n)", lambda cache, sink, n: cache.evict(n)),
        ("evict(n, callback)", lambda cache, sink, n: cache.evict(n, sink.free)),
    ]
    if evict_params is not None:
        found.insert(0, ("EvictParams", lambda cache, sink, n: cache.evict(evict_params(num_tokens=n))))
    return found


def _sglang_variants(module, page_size: int):
    """Every way of building and calling `module.RadixCache` worth trying, newest API first."""
    params = _parameter_classes(module)
    choices = (
        _constructors(module.RadixCache, params["CacheInitParams"], page_size),
        _key_makers(getattr(module, "RadixKey", None)),
        _match_callers(params["MatchPrefixParams"]),
        _insert_callers(params["InsertParams"]),
        _evict_callers(params["EvictParams"]),
    )
    version = getattr(importlib.import_module("sglang"), "__version__", "unknown")
    for chosen in itertools.product(*choices):
        names, calls = zip(*chosen, strict=True)
        yield SGLangApi(version, ", ".join(names), *calls)


def _smoke_test(api: SGLangApi, page_size: int) -> None:
    """Two sequences sharing one page: prefix lengths, slots and eviction must come out as a radix tree's."""
    ps = page_size
    a = tuple(range(1, 1 + 2 * ps))
    b = a[:ps] + tuple(range(1000, 1000 + ps))
    cache = SGLangTreeProbe(api, ps)
    got = getattr(cache.cache, "page_size", 1)
    check(got == ps, f"page_size {got}, not {ps}")
    cache.insert(cache.prepare_key(a), torch.arange(0, 2 * ps))
    cache.insert(cache.prepare_key(b), torch.arange(100, 100 + 2 * ps))
    check(cache.size == 3 * ps, f"holds {cache.size} tokens after two inserts, not {3 * ps}")
    expected_b = torch.cat([torch.arange(0, ps), torch.arange(100 + ps, 100 + 2 * ps)])
    check(torch.equal(cache.match(cache.prepare_key(a)).cpu(), torch.arange(0, 2 * ps)), "match(a) slots")
    check(torch.equal(cache.match(cache.prepare_key(b)).cpu(), expected_b), "match(b) slots")
    check(len(cache.match(cache.prepare_key((5000,) * ps))) == 0, "a miss matched")
    check(cache.evict(1) >= ps, "evict freed nothing")
    cache.evict(10 * ps)
    check(cache.size == 0 and len(cache.match(cache.prepare_key(a))) == 0, "evict did not empty the cache")


def probe_sglang(page_size: int) -> tuple[SGLangApi | None, str]:
    """The API of the installed SGLang RadixCache that passes the smoke test at `page_size`, or None and
    "skipped: <reason>"."""
    if importlib.util.find_spec("sglang") is None:
        return None, "skipped: sglang not importable"
    try:
        prepare_imports()  # torchvision placeholders where no real torchvision loads
        refused = ""
    except RuntimeError as e:  # not the version the lab reads: import it as it is
        refused = f"; {e}"
    try:
        with quiet_imports():
            module = importlib.import_module("sglang.srt.mem_cache.radix_cache")
        variants = list(_sglang_variants(module, page_size))
    except Exception as e:  # any import or layout failure is a reason to skip
        why = f"{type(e).__name__}: {e}{refused}"
        return None, f"skipped: cannot import sglang.srt.mem_cache.radix_cache ({why})"
    errors = []
    for api in variants:
        try:
            _smoke_test(api, page_size)
        except Exception as e:  # an API mismatch shows up as any exception
            errors.append(f"[{api.description}] {type(e).__name__}: {str(e)[:160]}")
            continue
        return api, f"sglang {api.version}: {api.description}"
    return None, f"skipped: no known RadixCache API fits sglang {variants[0].version} (first error: {errors[0]})"
