"""Faults, for the tests that show a failure is caught, bound into a rank's parts at build time by `FAULTS`
(entrypoints/binders.py), so that the core has no branch for them. The kinds of `--fault KIND:RANK@N` and what
each does are `config.FAULT_KINDS` (the flag's help is made of them); here each kind's chances (`CHANCES`), its
checks (`FaultBinder.check`) and its binding, through the hook points the cache's contract names
(mem_cache/base.py):

* kill-rank and slow-rank - `StageLoop.on_iteration` (a slower stage is what a protocol that forces the stages
  into lockstep costs, `python -m hicache_lab exercise`);
* tear-copy and misplace-copy - `HiCacheController.write_job` (`--copy-checksum` and `--check-outputs` must
  catch them);
* alloc-fail - `HiRadixCache.allocate`: a full pool on that rank alone (SGLang #28429, #33442), which the ranks
  must agree on (`alloc_agreement`);
* damage-page - `FileStorage.batch_get`, which `FileStorage.damage` flips a byte of on disk just before the read:
  the checksum makes it a miss, and the ranks must agree that it did not arrive;
* `--skip-load-wait` - `Scheduler.schedule`: the forward pass reads loaded KV without waiting for the load (the
  oracle must fail).

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

from ...config import FAULT_KINDS, RunConfig
from ...entrypoints.binders import Binder, RankParts
from ...errors import ConfigError, require
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
CHANCES = {  # what a chance of each fault kind (config.FAULT_KINDS) is, and what makes one
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
    if cfg.lab.skip_load_wait:
        faults.append(Chances("--skip-load-wait", rank, *SKIP_LOAD_WAIT))
        _skip_load_wait(loop.scheduler, faults[-1])
    if cfg.lab.fault and parse_fault(cfg.lab.fault)[1] == rank:
        kind, _, n = parse_fault(cfg.lab.fault)
        chances = Chances(f"--fault {cfg.lab.fault}", rank, *CHANCES[kind], 0 if kind == "slow-rank" else n)
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

    fields = ("fault", "skip_load_wait")

    def check(self, cfg: RunConfig) -> None:
        """`--fault`'s grammar, and that it can strike in this world."""
        if not cfg.lab.fault:
            return
        fault, p = cfg.lab.fault, cfg.parallel
        kind, rank, n = parse_fault(fault)
        require(rank < p.world_size, f"--fault {fault}: rank {rank} is not in a world of {p.world_size}")
        require(
            kind != "slow-rank" or n < 250 * p.collective_timeout_s,
            f"--fault {fault}: a sleep of {n} ms every iteration makes its peers wait past a quarter of "
            f"--collective-timeout {p.collective_timeout_s:g}: give fewer ms or a longer timeout",
        )
        require(
            kind != "kill-rank" or p.world_size > 1,
            "--fault kill-rank needs a world of 2 or more ranks (a single rank runs in the launching process)",
        )
        require(
            kind != "damage-page" or cfg.cache.storage_backend == "file",
            "--fault damage-page damages a page file: add --hicache-storage-backend file",
        )

    def bind(self, cfg: RunConfig, parts: RankParts, out_dir: Path):
        faults = install_faults(cfg, parts.rank, parts.cache, parts.loop)
        return (lambda: {"faults": [f.record() for f in faults]}) if faults else None


FAULTS = FaultBinder()


def parse_fault(fault: str) -> tuple[str, int, int]:
    """(kind, rank, n) of `--fault KIND:RANK@N`; a ConfigError that shows the grammar otherwise."""
    kind, _, where = fault.partition(":")
    rank, _, at = where.partition("@")
    if kind not in FAULT_KINDS or not rank.isdigit() or not at.isdigit():
        raise ConfigError(
            f"--fault {fault!r}: write KIND:RANK@N with KIND one of {', '.join(FAULT_KINDS)}, e.g. kill-rank:1@20"
        )
    return kind, int(rank), int(at)
