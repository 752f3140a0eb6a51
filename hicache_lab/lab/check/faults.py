"""Faults, for the tests that show a failure is caught, bound into a rank's parts at build time by `FAULTS`
(entrypoints/binders.py), so that the core has no branch for them:

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

import logging
import os
import signal
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ...config import RunConfig
from ...entrypoints.binders import Binder, RankParts
from ...managers.scheduler import Scheduler
from ...managers.scheduler_pp import StageLoop
from ...mem_cache.base import BasePrefixCache
from ...mem_cache.cache_controller import HiCacheController
from ...mem_cache.hicache_storage import FileStorage
from ...mem_cache.hiradix_cache import HiRadixCache

log = logging.getLogger(__name__)


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


class FaultBinder(Binder):
    """`--fault` and `--skip-load-wait`: bound into the rank they strike; its result records their chances."""

    fields = ("parallel.fault", "cache.skip_load_wait")

    def bind(self, cfg: RunConfig, parts: RankParts, out_dir: Path):
        faults = install_faults(cfg, parts.rank, parts.cache, parts.loop)
        return (lambda: {"faults": [f.record() for f in faults]}) if faults else None


FAULTS = FaultBinder()
