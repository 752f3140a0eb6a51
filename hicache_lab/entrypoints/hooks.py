"""What the entry point binds into a rank's parts at build time, so that the core has no branch for it.

**`--sync-impl SLOT=MODULE:FUNCTION`** (repeatable): your own `_pp_sync`, `writing_check` or `_attn_groups` in
every rank. For course exercises (notebooks/06_exercises.ipynb, `python -m hicache_lab exercise`) and protocol
experiments. Every rank imports MODULE (a module name, from the working directory or `sys.path`, or the path of a
`.py` file) and binds FUNCTION as a method in place of the lab's own:

* `pp_sync`       - `CacheSync._pp_sync(self, data)`: relay the agreed counts (an int64 tensor, changed in
                    place) down the pipeline. Every agreement that crosses stages goes through it.
* `writing_check` - `HiRadixCache.writing_check(self, count)`: consume `count` write acks, the count every
                    rank agreed on this step.
* `attn_groups`   - `CacheSync._attn_groups(self)`: the groups PP rank 0 agrees over (the CP fix: attention-CP
                    and attention-TP).

Every such call is audited (`sync_audit.Audit`): the distributed calls it makes and the rules of its slot, one
line per call in `sync_audit_rank{R}.jsonl`; a rule broken in every world stops the run with the reason.

The run checks the targets before it starts, so a typo fails at once (`ConfigError`, exit code 2). Your code is
bounded (`call_bounded`): the import must end within IMPORT_TIMEOUT_S, and every call runs in a helper thread and
must return within USER_CALL_BOUND x `--collective-timeout` (the lab's own collectives inside it time out first,
with their own message); a call that raises anything (`sys.exit` included) or does not return stops the run with
a `SyncImplError` naming the `--sync-impl`, and a call that never returns is left behind in its daemon thread.
Only one thread at a time uses a group: the rank waits while its helper runs.

**Faults** (`install_faults`), for the tests that show a failure is caught:

* `--fault kill-rank:R@N` - rank R's process is killed (SIGKILL) as its iteration N begins;
* `--fault slow-rank:R@MS` - rank R sleeps MS milliseconds at the start of every iteration: a slower stage (what a
  protocol that forces the stages into lockstep costs, `python -m hicache_lab exercise`);
* `--fault tear-copy:R@N` / `misplace-copy:R@N` - rank R's Nth host write leaves out its first layer / lands
  every token one slot over (`--copy-checksum` and `--check-outputs` must catch it);
* `--fault alloc-fail:R@N` - rank R's Nth slot allocation for a copy (a write to the host, a load back, a
  prefetch's host slots; from 0) fails, as a full pool would on that rank alone (SGLang #28429, #33442): the
  ranks must agree on it (`alloc_agreement`);
* `--fault damage-page:R@N` - the Nth page rank R reads from the file store (from 0) has a byte flipped on disk
  just before the read: the checksum makes it a miss, and the ranks must agree that it did not arrive;
* `--skip-load-wait` - the forward pass reads loaded KV without waiting for the load (the oracle must fail).

Each fault counts its chances on the rank it strikes (`Chances`: the Nth host write can come only if the rank
makes N + 1), and the rank's result records them (`"faults"`): a fault that never came is a run that did not do
what was asked, and the summary says so (report.py, `_merge_faults`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..config import RunConfig
from ..errors import ConfigError
from ..managers.scheduler import Scheduler
from ..managers.scheduler_pp import StageLoop
from ..mem_cache.base import BasePrefixCache
from ..mem_cache.cache_controller import HiCacheController
from ..mem_cache.hicache_storage import FileStorage
from ..mem_cache.hiradix_cache import HiRadixCache
from .sync_audit import Audit, AuditFinding, patch_torch_distributed

log = logging.getLogger(__name__)

IMPORT_TIMEOUT_S = 60.0  # importing a --sync-impl module runs its top-level code: it must end within this
USER_CALL_BOUND = 2  # a --sync-impl call must return within this many --collective-timeouts


class SyncImplError(RuntimeError):
    """A `--sync-impl` function raised, exited or did not return in time; the message names it."""


def call_bounded(what: str, timeout_s: float, bound: str, fn: Callable, *args):
    """`fn(*args)` in a daemon thread, on this thread's CUDA device: its value, or `SyncImplError` naming `what`
    when it raised anything (SystemExit and KeyboardInterrupt included) or did not return within `timeout_s`
    (`bound` says where that limit comes from); a call that did not return is left running."""
    outcome = {}
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def call() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            outcome["value"] = fn(*args)
        except BaseException as exc:  # user code: whatever ends it is reported, never lost
            outcome["error"] = exc

    thread = threading.Thread(target=call, name=what, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise SyncImplError(
            f"{what} did not return within {timeout_s:g} s ({bound}): it must return (a loop that never ends, a long "
            "sleep or a receive no peer sends keeps it waiting); the call is left running in a thread"
        )
    if "error" not in outcome:
        return outcome.get("value")
    exc = outcome["error"]
    if isinstance(exc, AuditFinding):
        raise SyncImplError(f"{what}: {exc}") from exc
    if isinstance(exc, SystemExit):
        raise SyncImplError(f"{what} called sys.exit({exc.code!r}): it must return, or raise an exception") from exc
    raise SyncImplError(f"{what} raised {type(exc).__name__}{f': {exc}' if str(exc) else ''}") from exc


def _fresh(module_name: str) -> types.ModuleType:
    """The module as its file is now (in-process runs see a changed file); a path to a .py file is imported under
    its file name."""
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        spec = importlib.util.spec_from_file_location(f"sync_impl_{path.stem}", path)
        if spec is None or not path.is_file():
            raise ModuleNotFoundError(f"no file {module_name}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.reload(importlib.import_module(module_name))


def resolve(specs: tuple[str, ...]) -> dict[str, tuple[str, Callable]]:
    """Import every `SLOT=MODULE:FUNCTION` (validated by ParallelConfig); {slot: (spec, function)}."""
    if specs and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module written next to the notebook or the shell
    importlib.invalidate_caches()
    if specs:
        patch_torch_distributed()  # before the import: a name it takes from torch.distributed is the audited one
    impls = {}
    for spec in specs:
        slot, _, target = spec.partition("=")
        module_name, _, function = target.partition(":")
        try:
            module = call_bounded("its import", IMPORT_TIMEOUT_S, "the lab's bound on an import", _fresh, module_name)
        except SyncImplError as exc:
            missing = isinstance(exc.__cause__, ModuleNotFoundError)
            where = "; give a .py file's path, or put the module in the working directory or on PYTHONPATH"
            where = where if missing else ""
            raise ConfigError(f"--sync-impl {spec}: cannot import {module_name!r}: {exc}{where}") from exc
        fn = module
        for name in function.split("."):  # a method of a class too: the lab's own, as a baseline
            fn = getattr(fn, name, None)
        if not callable(fn):
            raise ConfigError(
                f"--sync-impl {spec}: {module_name} has no function {function!r}: define it, or fix the name"
            )
        impls[slot] = (spec, fn)
    return impls


SLOT_TARGETS = {  # slot -> (whose method, its name)
    "pp_sync": ("sync", "_pp_sync"),
    "writing_check": ("cache", "writing_check"),
    "attn_groups": ("sync", "_attn_groups"),
}


def install(impls: dict[str, tuple[str, Callable]], sync, cache, out_dir: Path | None = None) -> None:
    """Bind the replacements to this rank's CacheSync and HiRadixCache (instance attributes shadow methods),
    each call audited (its lines in `out_dir`) and bounded by USER_CALL_BOUND x the collective timeout."""
    if not impls:
        return
    collective_s = sync.groups.timeout.total_seconds()
    timeout_s, bound = USER_CALL_BOUND * collective_s, f"{USER_CALL_BOUND} x --collective-timeout {collective_s:g}"
    audit = Audit(out_dir, sync.groups)
    owners = {"sync": sync, "cache": cache}
    for slot, (spec, fn) in impls.items():
        owner = owners[SLOT_TARGETS[slot][0]]
        method = audit.wrap(slot, types.MethodType(fn, owner), owner)
        setattr(owner, SLOT_TARGETS[slot][1], partial(call_bounded, f"--sync-impl {spec}", timeout_s, bound, method))


@dataclass
class Chances:
    """Where one fault can strike on this rank: how many chances it has had (`taken`) and which one it waits for
    (`n`, from 0). `what` says what a chance is, with `{}` where the count goes; `hint`, what makes one."""

    asked: str  # the flag, e.g. "--fault alloc-fail:1@20"
    rank: int
    what: str  # e.g. "made {} host writes"
    hint: str = ""
    n: int = 0
    taken: int = 0

    def take(self, count: int = 1) -> int | None:
        """`count` more chances: the offset among them of the one the fault waits for, or None."""
        first, self.taken = self.taken, self.taken + count
        return self.n - first if first <= self.n < self.taken else None

    def record(self) -> dict:
        """What the rank's result says of it (`message`: None once it fired)."""
        fired, message = self.taken > self.n, None
        if not fired and self.taken:
            pick = f"; pick N below {self.taken}" if self.asked.startswith("--fault") else ""
            message = f"{self.asked} never fired: rank {self.rank} {self.what.format(f'only {self.taken}')}{pick}"
        elif not fired:
            message = f"{self.asked} never fired: rank {self.rank} {self.what.format('no')} ({self.hint})"
        return {"asked": self.asked, "rank": self.rank, "fired": fired, "chances": self.taken, "message": message}


HOST_TIER = "only a run with --enable-hierarchical-cache makes them"
CHANCES = {  # what a chance of each fault is, and what makes one
    "kill-rank": ("began {} iterations", ""),
    "slow-rank": ("began {} iterations", ""),
    "tear-copy": ("made {} host writes", HOST_TIER),
    "misplace-copy": ("made {} host writes", HOST_TIER),
    "alloc-fail": ("made {} slot allocations for a copy", HOST_TIER),
    "damage-page": (
        "read {} pages from the file store",
        "it reads what it finds stored: a store filled before, or --flush-cache-between-rounds",
    ),
}
SKIP_LOAD_WAIT = (
    "ran {} batches that read loaded KV",
    "a load back needs --enable-hierarchical-cache and a device pool the conversations overflow",
)


def install_faults(cfg: RunConfig, rank: int, cache: BasePrefixCache, loop: StageLoop) -> list[Chances]:
    """Bind `--fault` (where it names this rank) and `--skip-load-wait` to this rank's parts; each counts its
    chances, which the rank's result records (`Chances.record`)."""
    faults = []
    if cfg.cache.skip_load_wait:
        faults.append(Chances("--skip-load-wait", rank, *SKIP_LOAD_WAIT))
        _skip_load_wait(loop.scheduler, faults[-1])
    if cfg.parallel.fault and cfg.parallel.fault_spec[1] == rank:
        kind, _, n = cfg.parallel.fault_spec
        chances = Chances(f"--fault {cfg.parallel.fault}", rank, *CHANCES[kind], 0 if kind == "slow-rank" else n)
        faults.append(chances)
        if kind == "kill-rank":
            loop.on_iteration.append(partial(_kill_at, chances))
        elif kind == "slow-rank":
            loop.on_iteration.append(partial(_slow_down, chances, n / 1e3))
        elif kind == "alloc-fail" and isinstance(cache, HiRadixCache):
            _fail_allocation(cache, chances)
        elif kind == "damage-page" and isinstance(cache, HiRadixCache) and cache.storage is not None:
            _damage_page(cache.storage.backend, chances)
        elif kind in ("tear-copy", "misplace-copy") and isinstance(cache, HiRadixCache):
            _bad_write(cache.controller, kind, chances)
    return faults


def _kill_at(chances: Chances, iteration: int) -> None:
    if chances.take() is not None:
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no result: as if the process were lost


def _slow_down(chances: Chances, seconds: float, iteration: int) -> None:
    chances.take()
    time.sleep(seconds)


def _skip_load_wait(scheduler: Scheduler, chances: Chances) -> None:
    """Every batch's forward pass reads loaded KV without waiting for the load; the acks still wait as before."""
    schedule = scheduler.schedule

    def hooked(iteration: int):
        batch = schedule(iteration)
        if batch.forward is not None and batch.forward.load_event is not None:
            chances.take()
            batch.forward.load_event = None
        return batch

    scheduler.schedule = hooked


def _bad_write(controller: HiCacheController, kind: str, chances: Chances) -> None:
    """The controller's Nth host write (from 0) is torn (its first layer not copied: the destination keeps its
    poison) or misplaced (every token lands one slot over)."""
    make_job = controller.write_job

    def job(host_idx, device_idx):
        if chances.take() is None:
            return make_job(host_idx, device_idx)
        if kind == "misplace-copy":
            return make_job(host_idx, device_idx.roll(1))
        torn = make_job(host_idx, device_idx)
        torn.layers = torn.layers[1:]
        return torn

    controller.write_job = job


def _fail_allocation(cache: HiRadixCache, chances: Chances) -> None:
    """The cache's Nth allocation for a copy (from 0) finds no room, whatever the pool holds."""
    allocate = cache.allocate

    def hooked(alloc, num_tokens):
        if chances.take() is not None:
            log.warning("--fault alloc-fail: %s refuses %d tokens (allocation %d)", alloc.name, num_tokens, chances.n)
            return None
        return allocate(alloc, num_tokens)

    cache.allocate = hooked


def _damage_page(backend: FileStorage, chances: Chances) -> None:
    """The Nth page asked of the backend (from 0) finds its file damaged: one payload byte flipped on disk."""
    batch_get = backend.batch_get

    def hooked(hashes, host, page_slots):
        if (i := chances.take(len(hashes))) is not None:
            backend.damage(hashes[i])
            log.warning("--fault damage-page: page %s damaged before it is read", hashes[i][:12])
        return batch_get(hashes, host, page_slots)

    backend.batch_get = hooked
