"""`--plugin MODULE:OBJECT` (repeatable): a protocol or a policy of your own, bound into every rank as the lab binds
its own tools, with no file of the lab edited. OBJECT is a `Binder` (entrypoints/binders.py) in MODULE (a module
name, from the working directory or `sys.path`, or the path of a `.py` file):

* `check(cfg)` - before any rank starts: refuse, with a ConfigError saying what to change, a world it cannot serve;
* `bind(cfg, parts, out_dir)` - in each rank, once its parts are built: bind into them through the hook points the
  cache's contract names (mem_cache/base.py: the step's agreement `CacheSync.agree_ack_counts`, the relay
  `CacheSync._pp_sync`, what travels with the activations between stages `StageLoop.send_hidden` /
  `recv_hidden`, the prefetch votes `CacheSync.agree_prefetch_progress`, ...), and return what the rank's result
  records, as a function, or None;
* `wrap_cache`, `build_cache` - as for any binder;
* `differences` - the step-trace quantities it is expected to change against the lab's own protocol (e.g.
  `("relay_sent",)`): the checks that compare it with the lab name these and accept no others.

Wherever run flags are taken (`run`, a torchrun rank, `compare`, the presets) `--plugin` is one of them; `compare
--against lab` runs the lab with it beside the lab without it, `soak --plugin` binds it into every drawn world,
`zoo NAME --plugin` into the entry's fixed run, and `bench/divergence_rate.py` and `bench/agreement_cost.py` add a
mode, `plugin` (`fixed` with it). The launcher checks each plug-in before any rank starts, imported in a process of
its own (`answer_in_a_child`): one that cannot be imported, is not a `Binder`,
exits its process at import or does not finish importing in time is a ConfigError; its own `check` runs there too.
A rank that binds one runs in a process of its own, watched, even alone (`runs_unbounded_code`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

from ..config import RunConfig
from ..entrypoints.binders import Binder, RankParts
from ..entrypoints.launch import rank_processes
from ..errors import ConfigError

IMPORT_TIMEOUT_S = 60.0  # importing your module runs its top-level code: it must end within this
_LOADED: dict[str, Binder] = {}  # by spec, in a rank: each plug-in imported once per process


def import_fresh(module_name: str, prefix: str) -> types.ModuleType:
    """The module as its file is now (in-process runs see a changed file); a path to a .py file is imported under
    `prefix` + its file name."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module written next to the notebook or the shell
    importlib.invalidate_caches()
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        spec = importlib.util.spec_from_file_location(f"{prefix}{path.stem}", path)
        if spec is None or not path.is_file():
            raise ModuleNotFoundError(f"no file {module_name}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.reload(importlib.import_module(module_name))


def load_plugin(spec: str) -> Binder:
    """The `Binder` that `--plugin MODULE:OBJECT` names; a ConfigError that says what to change otherwise."""
    module_name, _, name = spec.rpartition(":")  # a path may hold a colon, an object's name never
    if not module_name or not name:
        raise ConfigError(f"--plugin {spec!r}: write MODULE:OBJECT, e.g. my_protocol:PIGGYBACK")
    try:
        module = import_fresh(module_name, "plugin_")
    except ModuleNotFoundError as exc:
        raise ConfigError(
            f"--plugin {spec}: cannot import {module_name!r} ({exc}); give a .py file's path, or put the module in "
            "the working directory or on PYTHONPATH"
        ) from None
    plugin = getattr(module, name, None)
    if not isinstance(plugin, Binder):
        raise ConfigError(
            f"--plugin {spec}: {module_name}.{name} is {type(plugin).__name__}, not a Binder instance "
            "(hicache_lab.entrypoints.binders.Binder): define OBJECT = YourBinder() at the module's top level"
        )
    return plugin


def _answer(what: str, fn: Callable, args: tuple, answer) -> None:
    """In a child process: `fn(*args)`, then send back None or the ConfigError's words, and leave at once (threads
    it started must not hold the child open)."""
    try:
        fn(*args)
        answer.send(None)
    except ConfigError as exc:
        answer.send(str(exc))
    except Exception as exc:  # your code's own error, with whose it is
        answer.send(f"{what}: raised {type(exc).__name__}: {exc}")
    finally:
        answer.close()
        os._exit(0)


def answer_in_a_child(what: str, fn: Callable, *args) -> None:
    """`fn(*args)` in a process of its own (the launcher's fork server forks it), never in this one: code that exits
    the process, arms a timer, starts threads or holds the interpreter at import must not touch the launcher.
    ConfigError (naming `what`) if it raised one, ended its process, or did not finish within IMPORT_TIMEOUT_S."""
    ctx = rank_processes()
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_answer, args=(what, fn, args, writer), daemon=True)
    child.start()
    writer.close()
    try:
        if not reader.poll(IMPORT_TIMEOUT_S + 10):
            raise ConfigError(f"{what}: its import did not end within {IMPORT_TIMEOUT_S:g} s")
        words = reader.recv()
    except EOFError:
        child.join(5)
        raise ConfigError(
            f"{what}: importing it ended the process (exit code {child.exitcode}) before the import returned: a "
            "module must not exit at its top level (os._exit, sys.exit in a thread); move that code into a function"
        ) from None
    finally:
        reader.close()
        if child.is_alive():
            child.kill()
        child.join(5)
    if words is not None:
        raise ConfigError(words)


def _check_plugin(spec: str, cfg: RunConfig) -> None:
    load_plugin(spec).check(cfg)


def loaded(cfg: RunConfig) -> list[Binder]:
    """The plug-ins `cfg` names, imported once in this process."""
    for spec in cfg.lab.plugins:
        if spec not in _LOADED:
            _LOADED[spec] = load_plugin(spec)
    return [_LOADED[spec] for spec in cfg.lab.plugins]


class PluginBinder(Binder):
    """`--plugin`: each plug-in checked before any rank starts (in a child process), then bound into every rank."""

    fields = ("plugins",)

    def check(self, cfg: RunConfig) -> None:
        for spec in cfg.lab.plugins:
            answer_in_a_child(f"--plugin {spec}", _check_plugin, spec, cfg)

    def runs_unbounded_code(self, cfg: RunConfig) -> bool:
        return bool(cfg.lab.plugins)

    def build_cache(self, cfg, sync, kv, storage_dir):
        return next(filter(None, (p.build_cache(cfg, sync, kv, storage_dir) for p in loaded(cfg))), None)

    def wrap_cache(self, cfg, cache, out_dir, rank):
        for plugin in loaded(cfg):
            cache = plugin.wrap_cache(cfg, cache, out_dir, rank)
        return cache

    def bind(self, cfg: RunConfig, parts: RankParts, out_dir: Path):
        reports = [r for p in loaded(cfg) if (r := p.bind(cfg, parts, out_dir)) is not None]
        return (lambda: {k: v for report in reports for k, v in report().items()}) if reports else None


PLUGINS = PluginBinder()


def differences(cfg: RunConfig) -> set[str]:
    """The step-trace quantities the plug-ins of `cfg` say they change (`differences` of each)."""
    return {name for plugin in loaded(cfg) for name in getattr(plugin, "differences", ())}
