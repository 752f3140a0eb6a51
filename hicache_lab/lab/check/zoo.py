"""The bug zoo: every known failure of this family, reproducible by name, next to its fix.

Each entry is a small world given as `run` flags. Its *broken* run is `--sync fixed` with the entry's fix(es)
switched off (`--disable-fix NAME`) and its `broken_flags` added, its *fixed* run the same flags with every
fix: same seed, same workload.
`symptom` (zoo_symptoms.py) reads a run's summary (and trace) and says what went wrong, or None; the broken run
must show it, the fixed run must not, must complete with identical decisions on every rank and exact outputs.

    python -m hicache_lab zoo                 # the table
    python -m hicache_lab zoo host_capacity   # run one pair and say what happened
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ...entrypoints.launch import run_world
from ...errors import ConfigError
from ..plugins import PLUGINS
from ..sglang.binder import SGLANG_CACHE, refusals
from ..sglang.releases import missing
from .faults import FAULTS
from .zoo_entries import ENTRIES, PROPOSALS, Entry, entry_config
from .zoo_symptoms import diverged

__all__ = ["ENTRIES", "Entry", "consistent", "not_on_sglang", "reproduce"]


@dataclass
class EntryRun:
    """One run of an entry, broken or fixed: its summary, the symptom it showed (None: none) and its directory."""

    summary: dict
    symptom: str | None
    out: Path = field(repr=False)


def not_on_sglang(entry: Entry) -> str | None:
    """Why an entry cannot run on SGLang's own cache (`--cache-impl sglang`: its broken run reverts the entry's
    fixes in SGLang's objects), or None."""
    if entry.prepare is not None:
        return "its store is prepared in the lab's key format"
    reasons = refusals(entry_config(f"{entry.run_flags(True)}{entry.switches(True)} --cache-impl sglang"))
    return "; ".join(reasons) or None


def impls(entry: Entry, cache_impl: str) -> tuple[str, str]:
    """The caches of an entry's broken and fixed runs: `releases` runs the last release whose own code has the bug,
    then the first that has the fix (neither with a fix switched: each runs its code as released)."""
    if cache_impl == "releases":
        return f"sglang=={entry.releases[0]}", f"sglang=={entry.releases[1]}"
    return cache_impl, cache_impl


def not_in_releases(entry: Entry) -> str | None:
    """Why an entry cannot run on SGLang's releases, or None."""
    if entry.releases is None:
        return "its bug lives in no release the lab runs (the lab reverts it in 0.5.23: --cache-impl sglang)"
    return "; ".join(why for v in entry.releases if (why := missing(v))) or None


def reproduce(
    entry: Entry, out: Path, verbose: bool = False, cache_impl: str = "lab", plugin: str = ""
) -> tuple[EntryRun, EntryRun]:
    """The broken and the fixed run of an entry, on the lab's cache, SGLang 0.5.23's own, or SGLang's releases
    (`impls`): (broken, fixed); `plugin`: a `--plugin` the fixed run binds (does your protocol fix it too?)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    store = out / "store"
    if entry.prepare is not None:
        entry.prepare(store, entry.flags)
    runs = []
    for name, impl in zip(("broken", "fixed"), impls(entry, cache_impl), strict=True):
        switches = entry.switches(name == "broken") if cache_impl != "releases" else ""
        flags = entry.run_flags(name == "broken") + switches
        if entry.prepare is not None:  # a copy each, beside the run's directory (which holds only what it wrote)
            shutil.copytree(store, out / f"{name}_store")
            flags += f" --hicache-storage-dir {out / f'{name}_store'}"
        cfg = entry_config(f"{flags} --cache-impl {impl}").with_lab(
            plugins=(plugin,) * (bool(plugin) and name == "fixed")
        )
        summary = run_world(cfg, out / name, verbose, (FAULTS, SGLANG_CACHE, PLUGINS))
        runs.append(EntryRun(summary, entry.symptom(summary, out / name), out / name))
    return runs[0], runs[1]


def consistent(entry_run: EntryRun) -> bool:
    s = entry_run.summary
    return s["completed"] and not s["diverged"] and s["outputs_match_reference"] is True and entry_run.symptom is None


def add_zoo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", choices=list(ENTRIES), help="reproduce one entry (default: list them)")
    parser.add_argument("--out", default="runs/zoo", help="run directories (default: runs/zoo/NAME)")
    parser.add_argument(
        "--cache-impl",
        choices=("lab", "sglang", "releases"),
        default="lab",
        help="sglang: both runs on SGLang 0.5.23's own cache, the broken one with the entry's fixes reverted in "
        "SGLang's objects (lab/sglang/reverts.py); releases: the broken run on the last SGLang release whose own "
        "code has the bug, the fixed one on the first with the fix (make releases); the list says which entries can",
    )
    parser.add_argument("--plugin", default="", metavar="MODULE:OBJECT", help="the fixed run binds this plug-in too")


def cmd_zoo(args: argparse.Namespace) -> int:
    impl = args.cache_impl
    cannot = {"lab": lambda e: None, "sglang": not_on_sglang, "releases": not_in_releases}[impl]
    if args.name is None:
        for e in ENTRIES.values():
            fixes = ", ".join(e.fixes) or "-"
            print(f"{e.name:<24} fix {fixes:<18} {e.failure}\n{'':<24} SGLang {e.sglang}\n{'':<24} {e.command(True)}")
            if e.releases:
                print(
                    f"{'':<24} in SGLang's own code: sglang=={e.releases[0]} has it, sglang=={e.releases[1]} fixed it"
                )
            if impl != "lab":
                print(f"{'':<24} with --cache-impl {impl}: {'not run: ' + why if (why := cannot(e)) else 'yes'}")
        return 0
    entry = ENTRIES[args.name]
    if why := cannot(entry):
        raise ConfigError(f"zoo {entry.name} --cache-impl {impl}: {why}")
    print(f"{entry.name}: {entry.failure}\nSGLang: {entry.sglang}")
    broken, fixed = reproduce(entry, Path(args.out) / entry.name, cache_impl=impl, plugin=args.plugin)
    switched = impl != "releases"
    shown = [f" --cache-impl {i}" if impl != "lab" else "" for i in impls(entry, impl)]
    symptom = broken.symptom or "no symptom (unexpected)"
    print(f"\nbroken ({entry.command(True, switched)}{shown[0]}):\n  {symptom}")
    verdict = "completed, every rank agrees, outputs exact" if consistent(fixed) else diverged(fixed.summary, fixed.out)
    yours = f" --plugin {args.plugin}" if args.plugin else ""
    print(f"fixed ({entry.command(False, switched)}{shown[1]}{yours}):\n  {verdict}")
    for name in (f for f in entry.fixes if f in PROPOSALS):
        print(f"  its fix {name} is in no release of SGLang ({PROPOSALS[name]}): 0.5.23 fails here as the broken run")
    return 0 if broken.symptom and consistent(fixed) else 1
