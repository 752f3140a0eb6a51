"""What the lab binds into a run (entrypoints/binders.py): `--cache-impl sglang`, `--sync-impl`, the faults, the
cache-op recorder.
`python -m hicache_lab run` passes them all; so does `run` here, for the lab's own tools and tests."""

from __future__ import annotations

from pathlib import Path

from ..config import RunConfig
from ..entrypoints import launch
from ..entrypoints.binders import Binder
from .check.faults import FAULTS
from .plugins import PLUGINS
from .sglang.binder import SGLANG_CACHE
from .sglang.recording import RECORDING
from .teach.sync_impl import SYNC_IMPLS

LAB: tuple[Binder, ...] = (SGLANG_CACHE, SYNC_IMPLS, FAULTS, RECORDING, PLUGINS)  # in the order they bind


def run(cfg: RunConfig, out_dir: Path | None = None, verbose: bool = True, more: tuple[Binder, ...] = ()) -> dict:
    """`launch.run_world` with the lab's binders (and `more` after them): the `run` of the lab's tools, under
    `hicache_lab.api.run`."""
    return launch.run_world(cfg, out_dir, verbose, binders=(*LAB, *more))
