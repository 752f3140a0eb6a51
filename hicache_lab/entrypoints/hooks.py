"""What the entry point binds into a rank's parts at build time, so that the core has no branch for it.

**`--sync-impl SLOT=MODULE:FUNCTION`** (repeatable): your own `_pp_sync` or `writing_check` in every rank. For
course exercises (notebooks/06_exercises.ipynb) and protocol experiments. Every rank imports MODULE
(from the working directory or `sys.path`) and binds FUNCTION as a method in place of the lab's own:

* `pp_sync`       - `CacheSync._pp_sync(self, data)`: relay the agreed counts (an int64 tensor, changed in
                    place) down the pipeline. Every agreement that crosses stages goes through it.
* `writing_check` - `HiRadixCache.writing_check(self, count)`: consume `count` write acks, the count every
                    rank agreed on this step.

The run checks the targets before it starts, so a typo fails at once (`ConfigError`, exit code 2).

**Faults** (`install_faults`), for the tests that show a failure is caught:

* `--fault kill-rank:R@N` - rank R's process is killed (SIGKILL) as its iteration N begins;
* `--fault tear-copy:R@N` / `misplace-copy:R@N` - rank R's Nth host write leaves out its first layer / lands
  every token one slot over (`--copy-checksum` and `--check-outputs` must catch it);
* `--fault alloc-fail:R@N` - rank R's Nth slot allocation for a copy (a write to the host, a load back, a
  prefetch's host slots; from 0) fails, as a full pool would on that rank alone (SGLang #28429, #33442): the
  ranks must agree on it (`alloc_agreement`);
* `--fault damage-page:R@N` - the Nth page rank R reads from the file store (from 0) has a byte flipped on disk
  just before the read: the checksum makes it a miss, and the ranks must agree that it did not arrive;
* `--skip-load-wait` - the forward pass reads loaded KV without waiting for the load (the oracle must fail).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import signal
import sys
import types
from collections.abc import Callable
from functools import partial

from ..config import RunConfig
from ..errors import ConfigError
from ..managers.scheduler import Scheduler
from ..managers.scheduler_pp import StageLoop
from ..mem_cache.base import BasePrefixCache
from ..mem_cache.cache_controller import HiCacheController
from ..mem_cache.hicache_storage import FileStorage
from ..mem_cache.hiradix_cache import HiRadixCache

log = logging.getLogger(__name__)


def resolve(specs: tuple[str, ...]) -> dict[str, Callable]:
    """Import every `SLOT=MODULE:FUNCTION` (validated by ParallelConfig); {slot: function}."""
    if specs and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module written next to the notebook or the shell
    importlib.invalidate_caches()
    impls = {}
    for spec in specs:
        slot, _, target = spec.partition("=")
        module_name, _, function = target.partition(":")
        try:
            module = importlib.import_module(module_name)
            module = importlib.reload(module)  # in-process runs see the file as it is now
        except Exception as exc:
            raise ConfigError(
                f"--sync-impl {spec}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); "
                "put the module in the working directory or on PYTHONPATH"
            ) from exc
        fn = getattr(module, function, None)
        if not callable(fn):
            raise ConfigError(
                f"--sync-impl {spec}: {module_name} has no function {function!r}: define it, or fix the name"
            )
        impls[slot] = fn
    return impls


def install(impls: dict[str, Callable], sync, cache) -> None:
    """Bind the replacements to this rank's CacheSync and HiRadixCache (instance attributes shadow methods)."""
    if "pp_sync" in impls:
        sync._pp_sync = types.MethodType(impls["pp_sync"], sync)
    if "writing_check" in impls:
        cache.writing_check = types.MethodType(impls["writing_check"], cache)


def install_faults(cfg: RunConfig, rank: int, cache: BasePrefixCache, loop: StageLoop) -> None:
    """Bind `--fault` (where it names this rank) and `--skip-load-wait` to this rank's parts."""
    if cfg.cache.skip_load_wait:
        _skip_load_wait(loop.scheduler)
    if not cfg.parallel.fault:
        return
    kind, fault_rank, n = cfg.parallel.fault_spec
    if fault_rank != rank:
        return
    if kind == "kill-rank":
        loop.on_iteration.append(partial(_kill_at, n))
    elif kind == "alloc-fail" and isinstance(cache, HiRadixCache):
        _fail_allocation(cache, n)
    elif kind == "damage-page" and isinstance(cache, HiRadixCache) and cache.storage is not None:
        _damage_page(cache.storage.backend, n)
    elif isinstance(cache, HiRadixCache):
        _bad_write(cache.controller, kind, n)


def _kill_at(step: int, iteration: int) -> None:
    if iteration == step:
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no result: as if the process were lost


def _skip_load_wait(scheduler: Scheduler) -> None:
    """Every batch's forward pass reads loaded KV without waiting for the load; the acks still wait as before."""
    schedule = scheduler.schedule

    def hooked(iteration: int):
        batch = schedule(iteration)
        if batch.forward is not None:
            batch.forward.load_event = None
        return batch

    scheduler.schedule = hooked


def _bad_write(controller: HiCacheController, kind: str, n: int) -> None:
    """The controller's Nth host write (from 0) is torn (its first layer not copied: the destination keeps its
    poison) or misplaced (every token lands one slot over)."""
    make_job, writes = controller.write_job, itertools.count()

    def job(host_idx, device_idx):
        if next(writes) != n:
            return make_job(host_idx, device_idx)
        if kind == "misplace-copy":
            return make_job(host_idx, device_idx.roll(1))
        torn = make_job(host_idx, device_idx)
        torn.layers = torn.layers[1:]
        return torn

    controller.write_job = job


def _fail_allocation(cache: HiRadixCache, n: int) -> None:
    """The cache's Nth allocation for a copy (from 0) finds no room, whatever the pool holds."""
    allocate, calls = cache.allocate, itertools.count()

    def hooked(alloc, num_tokens):
        if next(calls) == n:
            log.warning("--fault alloc-fail: %s refuses %d tokens (allocation %d)", alloc.name, num_tokens, n)
            return None
        return allocate(alloc, num_tokens)

    cache.allocate = hooked


def _damage_page(backend: FileStorage, n: int) -> None:
    """The Nth page asked of the backend (from 0) finds its file damaged: one payload byte flipped on disk."""
    batch_get, asked = backend.batch_get, [0]

    def hooked(hashes, host, page_slots):
        if asked[0] <= n < asked[0] + len(hashes):
            backend.damage(hashes[n - asked[0]])
            log.warning("--fault damage-page: page %s damaged before it is read", hashes[n - asked[0]][:12])
        asked[0] += len(hashes)
        return batch_get(hashes, host, page_slots)

    backend.batch_get = hooked
