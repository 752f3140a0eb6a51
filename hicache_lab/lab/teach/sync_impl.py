"""`--sync-impl SLOT=MODULE:FUNCTION` (repeatable): your own `_pp_sync`, `writing_check` or `_attn_groups` in
every rank, bound in at build time by `SYNC_IMPLS` (entrypoints/binders.py), so that the core has no branch for
it. For course exercises (notebooks/06_exercises.ipynb, `python -m hicache_lab exercise`) and protocol
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

The run checks the targets before it starts, each imported in a child process, so a typo fails at once
(`ConfigError`, exit code 2) and a module that exits at import cannot end the launcher. Every rank, even of a
world of one, runs in a process of its own that the launcher watches (entrypoints/watch.py): a call that holds
the interpreter in C code or exits the process is found there. Your code is bounded (`call_bounded`): the import
must end within IMPORT_TIMEOUT_S, and every call runs in a helper thread and must return within
USER_CALL_BOUND x `--collective-timeout` (the lab's own collectives inside it time out first, with their own
message); a call that raises anything (`sys.exit` included) or does not return stops the run with a
`SyncImplError` naming the `--sync-impl`, and a call that never returns is left behind in its daemon thread.
Only one thread at a time uses a group: the rank waits while its helper runs.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ...config import SYNC_IMPL_SLOTS, RunConfig
from ...entrypoints.binders import Binder, RankParts
from ...errors import ConfigError, require, require_choice
from ..plugins import IMPORT_TIMEOUT_S, answer_in_a_child, import_fresh
from .audit_call import AuditFinding
from .audit_patch import patch_torch_distributed
from .sync_audit import Audit

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


def resolve(specs: tuple[str, ...]) -> dict[str, tuple[str, Callable]]:
    """Import every `SLOT=MODULE:FUNCTION` (its grammar checked by `check_grammar`); {slot: (spec, function)}."""
    if specs:
        patch_torch_distributed()  # before the import: a name it takes from torch.distributed is the audited one
    impls = {}
    for spec in specs:
        slot, _, target = spec.partition("=")
        module_name, _, function = target.rpartition(":")  # a path may hold a colon, a function name never
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


def _fresh(module_name: str) -> types.ModuleType:
    return import_fresh(module_name, "sync_impl_")


def _resolve_one(spec: str) -> None:
    resolve((spec,))


class SyncImplBinder(Binder):
    """`--sync-impl`: the functions checked before any rank starts (each imported in a child process), then bound
    into every rank, which runs in a process of its own even alone (`runs_unbounded_code`)."""

    fields = ("sync_impls",)

    def check(self, cfg: RunConfig) -> None:
        check_grammar(cfg.lab.sync_impls)
        for spec in cfg.lab.sync_impls:  # one that cannot load fails here, before any rank starts
            answer_in_a_child(f"--sync-impl {spec}", _resolve_one, spec)

    def runs_unbounded_code(self, cfg: RunConfig) -> bool:
        return bool(cfg.lab.sync_impls)

    def bind(self, cfg: RunConfig, parts: RankParts, out_dir: Path) -> None:
        install(resolve(cfg.lab.sync_impls), parts.sync, parts.cache, out_dir)


SYNC_IMPLS = SyncImplBinder()


def check_grammar(specs: tuple[str, ...]) -> None:
    """Each `--sync-impl` is SLOT=MODULE:FUNCTION with a slot of `SYNC_IMPL_SLOTS`, each slot named once."""
    for spec in specs:
        slot, _, target = spec.partition("=")
        module, _, function = target.rpartition(":")  # a path may hold a colon, a function name never
        require(
            bool(module and function),
            f"--sync-impl {spec!r}: write SLOT=MODULE:FUNCTION, e.g. pp_sync=my_sync:pp_sync",
        )
        require_choice(slot, SYNC_IMPL_SLOTS, "--sync-impl slot")
    slots = [spec.partition("=")[0] for spec in specs]
    require(len(set(slots)) == len(slots), f"--sync-impl names a slot twice ({', '.join(slots)}): keep one each")
