"""The seam through which tooling outside the core attaches to a run, so that no lab code lives below `lab/`.

A binder serves some of the lab's fields (`fields`: names of `LabConfig`, the section the core never reads).
The lab's binders (`lab/binders.py`: faults, `--sync-impl`, the cache-op recorder) come with
`python -m hicache_lab run`; a benchmark brings its own (bench/step_timer.py). A run that sets a lab field no
binder serves is refused before any rank starts (`refuse_unserved`): a lab flag never silently does nothing.

What a binder does, in order:

* `check(cfg)` - in the launcher, before any rank starts: its fields' grammar, and what only it can
  check (a `--sync-impl` that does not import);
* `build_cache(cfg, sync, kv, storage_dir)` - in each rank, before the core builds its cache: another cache
  and the device pool it manages (`--cache-impl sglang`: SGLang's own), or None (the core builds the lab's);
* `wrap_cache(cfg, cache, out_dir, rank)` - in each rank: what the scheduler asks instead of the cache (a
  recorder in front of it), or the cache itself;
* `bind(cfg, parts, out_dir)` - in each rank, once its parts are built: it binds into them (instance attributes
  shadow methods) and returns what the rank's result records, as a function asked when the rank writes it, or
  None;
* `runs_unbounded_code(cfg)` - whether what it binds is code the lab cannot bound from inside the process (a
  `--sync-impl`, SGLang's cache): a world of one rank then runs in a process of its own, which the launcher
  watches and can stop.

Binders travel to spawned ranks by pickling: instances of module-level classes, holding no live state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import LabConfig, RunConfig
from ..distributed.cache_sync import CacheSync
from ..errors import ConfigError
from ..managers.scheduler_pp import StageLoop
from ..mem_cache.base import BasePrefixCache
from ..mem_cache.build import KVShape


@dataclass
class RankParts:
    """One rank's parts (a rank of any kind: a TP or CP peer as much as a pipeline stage), for its binders."""

    rank: int
    sync: CacheSync
    cache: BasePrefixCache  # the cache itself
    loop: StageLoop  # its scheduler asks `loop.scheduler.cache`: the cache, or what a binder put in front of it


class Binder:
    """Serves nothing and binds nothing: the base a binder overrides."""

    fields: tuple[str, ...] = ()

    def check(self, cfg: RunConfig) -> None:
        """Before any rank starts; raises ConfigError."""

    def build_cache(self, cfg: RunConfig, sync: CacheSync, kv: KVShape, storage_dir: Path) -> tuple | None:
        """(device pool, cache) for the rank, or None."""
        return None

    def wrap_cache(self, cfg: RunConfig, cache: BasePrefixCache, out_dir: Path, rank: int) -> BasePrefixCache:
        return cache

    def bind(self, cfg: RunConfig, parts: RankParts, out_dir: Path) -> Callable[[], dict] | None:
        return None

    def runs_unbounded_code(self, cfg: RunConfig) -> bool:
        """Whether, in `cfg`, it puts code into a rank that the lab cannot bound from inside the process (a
        user's, another library's): then even a world of one rank runs in a process of its own (launch.run_world)."""
        return False


def _as_flags(flag: str, value) -> str:
    """How `value` of `flag`'s field is written on a command line."""
    if isinstance(value, bool):
        return flag
    return " ".join(f"{flag} {v}" for v in value) if isinstance(value, tuple) else f"{flag} {value}"


def refuse_unserved(cfg: RunConfig, binders: tuple[Binder, ...]) -> None:
    """ConfigError for each lab field `cfg` sets that none of `binders` serves."""
    served, default = {f for b in binders for f in b.fields}, LabConfig()
    unserved = [
        _as_flags(field.metadata["flag"], getattr(cfg.lab, field.name))
        for field in dataclasses.fields(LabConfig)
        if field.name not in served and getattr(cfg.lab, field.name) != getattr(default, field.name)
    ]
    if unserved:
        raise ConfigError(
            f"{', '.join(unserved)}: lab tooling that nothing in this run serves; run it with "
            "`python -m hicache_lab run`, or pass launch.run_world the lab's binders (hicache_lab.lab.binders.LAB)"
        )


def check_all(cfg: RunConfig, binders: tuple[Binder, ...]) -> None:
    """Before any rank starts: no lab field unserved, and each binder's own check."""
    refuse_unserved(cfg, binders)
    for binder in binders:
        binder.check(cfg)
