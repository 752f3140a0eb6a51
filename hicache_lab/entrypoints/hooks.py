"""Your own `_pp_sync` or `writing_check` in every rank: `--sync-impl SLOT=MODULE:FUNCTION` (repeatable).

For course exercises (notebooks/06_exercises.ipynb) and protocol experiments. Every rank imports MODULE
(from the working directory or `sys.path`) and binds FUNCTION as a method in place of the lab's own:

* `pp_sync`       - `CacheSync._pp_sync(self, data)`: relay the agreed counts (an int64 tensor, changed in
                    place) down the pipeline. Every agreement that crosses stages goes through it.
* `writing_check` - `HiRadixCache.writing_check(self, count)`: consume `count` write acks, the count every
                    rank agreed on this step.

The run checks the targets before it starts, so a typo fails at once (`ConfigError`, exit code 2).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Callable

from ..errors import ConfigError


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
