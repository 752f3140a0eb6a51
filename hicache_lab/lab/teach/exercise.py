"""The exercise's check: your `_pp_sync`, `writing_check` and `_attn_groups` in every rank of several worlds, and
what is wrong with them, in words.

`check(pp_sync=..., writing_check=..., attn_groups=...)` (notebooks/06_exercises.ipynb) and
`python -m hicache_lab exercise --pp-sync FILE.py:FUNCTION ...` run each world of `WORLDS` in turn with the fixed
sync and your functions (`--sync-impl`), on a workload whose device pool overflows, so write-through, eviction
and load-back all happen; the first world that shows a mistake ends the check. A world shows a mistake three
ways, and the verdict names the first cause it finds:

1. the audit (sync_audit.py) saw your function break a rule of its slot: the kind of mistake
   (`MISTAKES`), what the rank did, why it is wrong; a collective that forces the stages into lockstep is
   measured against the one-way relay on the same world;
2. the run went wrong: two stages consumed different acks, ran different batches or hold different trees (the
   first step and values), a rank crashed or waited for a message no stage sent (which call, which peer);
3. the outputs differ from the from-scratch reference (the copy the oracle found wrong, or the requests).

Each value is a `MODULE:FUNCTION` or `FILE.py:FUNCTION` spec, or the function itself when it is defined in a
file (a script needs no `if __name__ == "__main__":` guard: in the ranks, and while the check imports the
script, a call of `check` returns at once).

The words of a verdict come from explain.py; `python -m hicache_lab exercise` is exercise_cli.py.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...config import SYNC_IMPL_SLOTS, RunConfig
from ...entrypoints.ending import Interrupted
from ...entrypoints.launch import exit_code, run_world
from ...errors import ConfigError
from ..check.faults import FAULTS
from ..presets import WORLD, World, config
from .explain import (
    audit_lines,
    chain_note,
    crash_kind,
    explain_run,
    finding_words,
    first_finding,
    left_running,
    lockstep_words,
    unjudged_words,
)
from .mistakes import MISTAKES, mistake_text
from .sync_impl import SYNC_IMPLS

STORAGE = (
    "--hicache-storage-backend file --hicache-storage-prefetch-policy wait_complete --storage-prefetch-threshold 16"
)


WORLDS = (
    World("PP=2", "--pp 2"),
    World("PP=3", "--pp 3"),
    World("TP=2 x PP=2", "--tp 2 --pp 2"),
    World("CP=2 x PP=2", "--cp 2 --pp 2"),
    World(
        "PP=2, real copy latency, stage 1 slower by 15 ms a step",
        "--pp 2 --latency real --injected-delay-ms 2 --fault slow-rank:1@15",
    ),
    World("PP=2 with L3 (file store, a flush between rounds)", f"--pp 2 {STORAGE} --flush-cache-between-rounds"),
)
LOCKSTEP = ("symmetric_across_stages", "blocking_send", "backwards")  # measured against the relay, where the run ends
_running = False  # a check in progress in this process: a call while it imports your file returns at once
_relay_runs: dict[tuple, tuple[Path, dict]] = {}  # (world, device, quick) -> the relay's run (lockstep_cost)


def exercise_config(
    world: World, sync_impls: tuple[str, ...] = (), device: str = "cpu", quick: bool = True
) -> RunConfig:
    """`world` on the divergence scenario of the tests (presets.WORLD: 3 layers, a 256-token device pool the
    conversations overflow by round 3, a host pool 3x larger). Not `quick`: twice the clients, rounds and pool."""
    larger = "" if quick else "--max-total-tokens 512 --num-clients 8 --num-rounds 8"
    cfg = config(WORLD, larger, world.flags, f"--device {device} --collective-timeout 6")
    return cfg.with_lab(sync_impls=sync_impls)  # not through `config`: a path may hold spaces


HINT_ON_REQUEST = "stuck? check(..., hint=True), or --hint from the shell, says what to change"


@dataclass
class Verdict:
    """What the check found, in two levels: the kind of mistake, what the rank did and why it is wrong (`lines`);
    then, only if asked for (`show_hint`), what to change (`hint`: the kind's `Mistake.fix`)."""

    ok: bool = True
    lines: list[str] = field(default_factory=list)
    mistake: str | None = None  # the MISTAKES kind the audit named, if any
    skipped: bool = False  # called in a rank, or while the check imports the caller's file: nothing to say
    show_hint: bool = False
    judged: bool = True  # False: a world ended without the evidence for a verdict (interrupted, cut short)
    interrupted: str | None = None  # the signal that interrupted a world (SIGINT, SIGTERM), if one did

    @property
    def hint(self) -> str | None:
        return MISTAKES[self.mistake].fix if self.mistake else None

    def __str__(self) -> str:
        if self.skipped:
            return ""
        lines = list(self.lines)
        if not self.judged:
            return "\n".join([*lines, "NOT JUDGED"])
        if not self.ok and self.hint:
            lines.append(f"hint: {self.hint}" if self.show_hint else f"({HINT_ON_REQUEST})")
        return "\n".join([*lines, "PASSED" if self.ok else "FAILED"])

    @property
    def exit_code(self) -> int:
        """0 passed, 1 failed or could not judge, 128 + signal interrupted (as `run`'s)."""
        return exit_code(self.interrupted, self.ok and self.judged)


def spec_of(slot: str, value: str | Callable) -> str:
    """The `--sync-impl` spec of a value of `check`: a spec as it is, a function as FILE.py:NAME."""
    if isinstance(value, str):
        return f"{slot}={value}"
    source = inspect.getsourcefile(value)
    if value.__qualname__ != value.__name__ or source is None or not Path(source).is_file() or "ipykernel" in source:
        raise ConfigError(
            f"{slot}: the check loads {value.__qualname__} in every rank from a file: define it at the top level of "
            "a .py file (in a notebook: %%writefile my_sync.py), then give the file's function"
        )
    return f"{slot}={source}:{value.__name__}"


LAB_OWN = {  # slot -> the lab's methods that do its work, which an answer must not call
    "pp_sync": {"_pp_sync"},
    "writing_check": {"writing_check", "loading_check", "_consume_acks"},
    "attn_groups": {"_attn_groups"},
}


PACKAGE = Path(__file__).resolve().parents[2]  # the lab's own source: hicache_lab/


def lab_own_calls(spec: str) -> str | None:
    """What of the lab's own the function a `--sync-impl` spec names is, or calls (`LAB_OWN`), read from its
    source without running it: the words of a verdict; None where it is neither, or where its source cannot be
    read (the run's import then says why)."""
    slot, _, target = spec.partition("=")
    module, _, name = target.rpartition(":")
    try:
        found = None if module.endswith(".py") or not module else importlib.util.find_spec(module)
        source = Path(module) if module.endswith(".py") else Path(found.origin) if found and found.origin else None
        tree = ast.parse(source.read_text()) if source is not None and source.is_file() else None
    except (ImportError, ValueError, SyntaxError, OSError, UnicodeDecodeError):  # the run's import says why
        return None
    if tree is None:
        return None
    if source.resolve().is_relative_to(PACKAGE):
        return f"{name} is the lab's own ({source.resolve().relative_to(PACKAGE.parent)})"
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name.split(".")[-1]), None)
    names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} if node else set()
    names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node else set()
    used = names & LAB_OWN[slot]
    return f"{name} calls the lab's own {', '.join(sorted(used))}" if used else None


def judge_lab_own(verdict: Verdict, specs: tuple[str, ...]) -> None:
    """A function that is, or calls, the lab's own for its slot does not do the exercise: the verdict says so
    before any world runs."""
    for spec in specs:
        if (what := lab_own_calls(spec)) is not None:
            verdict.ok, verdict.mistake = False, "uses_the_lab_own"
            verdict.lines.append(f"before any world: WRONG (uses_the_lab_own) {mistake_text('uses_the_lab_own', what)}")
            return


RELAY = "pp_sync=hicache_lab.distributed.cache_sync:CacheSync._pp_sync"  # the lab's own, audited the same way
BINDERS = (SYNC_IMPLS, FAULTS)  # what its worlds need: your functions, and a slower stage


def lockstep_cost(world: World, out_dir: Path, summary: dict, device: str, quick: bool) -> str:
    """What the collective cost against the lab's one-way relay on the same world (`lockstep_words`), the relay
    run once per world in a process."""
    key = (world, device, quick)
    if key not in _relay_runs:  # one run of the relay per world in a process (the tests ask more than once)
        relay_dir = out_dir.parent / f"{out_dir.name}_relay"
        _relay_runs[key] = (
            relay_dir,
            run_world(exercise_config(world, (RELAY,), device, quick), relay_dir, False, BINDERS),
        )
    relay_dir, reference = _relay_runs[key]
    return lockstep_words(out_dir, summary, relay_dir, reference)


def check(
    pp_sync: str | Callable | None = None,
    writing_check: str | Callable | None = None,
    attn_groups: str | Callable | None = None,
    out_dir: Path | str = "runs/exercise",
    device: str = "cpu",
    quick: bool = True,
    worlds: tuple[World, ...] = WORLDS,
    hint: bool = False,
) -> Verdict:
    """Each world in turn with your functions (None: the lab's own), until one shows a mistake. `hint`: add what
    to change to a verdict that names a kind of mistake."""
    global _running
    if _running or multiprocessing.current_process().name != "MainProcess":  # a spawned rank importing a script
        return Verdict(skipped=True)
    given = {"pp_sync": pp_sync, "writing_check": writing_check, "attn_groups": attn_groups}
    specs = tuple(spec_of(slot, value) for slot, value in given.items() if value is not None)
    if not specs:
        raise ConfigError(f"check() needs at least one of {', '.join(SYNC_IMPL_SLOTS)}")
    verdict = Verdict(show_hint=hint)
    judge_lab_own(verdict, specs)
    if not verdict.ok:
        return verdict
    _running = True
    try:
        for i, world in enumerate(worlds):
            out = Path(out_dir) / f"world{i}"
            try:
                summary = run_world(exercise_config(world, specs, device, quick), out, False, BINDERS)
            except (Interrupted, KeyboardInterrupt) as exc:  # between worlds, or as one starts
                name = exc.name if isinstance(exc, Interrupted) else "SIGINT"
                verdict.ok, verdict.judged, verdict.interrupted = False, False, name
                verdict.lines.append(f"{world.name}: could not judge: interrupted by {name} as the world started")
                break
            judge_world(verdict, world, out, summary, device, quick)
            if not verdict.ok:
                break
        else:
            verdict.lines.append("every stage consumed the same acks at every step; outputs match the reference")
    finally:
        _running = False
    return verdict


def judge_world(verdict: Verdict, world: World, out: Path, summary: dict, device: str, quick: bool) -> None:
    """What one world's run shows, into `verdict`: the audit's first finding, a crash inside your function, no
    evidence at all (could not judge), or what the run did (`explain_run`: nothing wrong, or what went wrong)."""
    lines = audit_lines(out)
    found = first_finding(lines)
    if found is not None:
        kind = found[1]["kind"]
        why = f"({kind}) {finding_words(found[1], summary, lines)}"
        if kind in LOCKSTEP and summary["completed"]:
            why += f"; {lockstep_cost(world, out, summary, device, quick)}"
        verdict.ok, verdict.mistake = False, kind
    elif (kind := crash_kind(summary)) is not None:
        rank, error = summary["failing_rank"], summary["error"].splitlines()[0]
        why = f"({kind}) {mistake_text(kind, f'rank {rank} crashed in your function: {error}')}"
        verdict.ok, verdict.mistake = False, kind
    elif (unjudged := unjudged_words(summary)) is not None:
        verdict.ok, verdict.judged, verdict.interrupted = False, False, summary["interrupted"]
        verdict.lines.append(f"{world.name}: could not judge: {unjudged}")
        return
    else:
        why = explain_run(summary, lines)
        verdict.ok = why is None
    if not verdict.ok and summary["interrupted"]:  # it showed the mistake before the signal came
        why += f" (then the world was interrupted by {summary['interrupted']})"
        verdict.interrupted = summary["interrupted"]
    verdict.lines.append(f"{world.name}: {'ok' if verdict.ok else 'WRONG ' + why}")
    if verdict.ok and (note := chain_note(lines)) is not None and note not in verdict.lines:
        verdict.lines.append(note)
    verdict.lines += left_running(summary)
