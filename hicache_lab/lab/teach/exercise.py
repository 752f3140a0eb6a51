"""The exercise's check: your `_pp_sync`, `writing_check` and `_attn_groups` in every rank of several worlds, and
what is wrong with them, in words.

`check(pp_sync=..., writing_check=..., attn_groups=...)` (notebooks/06_exercises.ipynb) and
`python -m hicache_lab exercise --pp-sync FILE.py:FUNCTION ...` run each world of `WORLDS` in turn with the fixed
sync and your functions (`--sync-impl`), on a workload whose device pool overflows, so write-through, eviction
and load-back all happen; the first world that shows a mistake ends the check. A world shows a mistake three
ways, and the verdict names the first cause it finds:

1. the audit (entrypoints/sync_audit.py) saw your function break a rule of its slot: the kind of mistake
   (`MISTAKES`), what the rank did, why it is wrong; a collective that forces the stages into lockstep is
   measured against the one-way relay on the same world;
2. the run went wrong: two stages consumed different acks, ran different batches or hold different trees (the
   first step and values), a rank crashed or waited for a message no stage sent (which call, which peer);
3. the outputs differ from the from-scratch reference (the copy the oracle found wrong, or the requests).

Each value is a `MODULE:FUNCTION` or `FILE.py:FUNCTION` spec, or the function itself when it is defined in a
file (a script needs no `if __name__ == "__main__":` guard: in the ranks, and while the check imports the
script, a call of `check` returns at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import multiprocessing
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...config import SYNC_IMPL_SLOTS, RunConfig
from ...entrypoints.launch import run
from ...errors import ConfigError
from ...managers.step_trace import read_trace
from ..check.faults import FAULTS
from ..presets import WORLD, config
from .sync_audit import MISTAKES, mistake_text
from .sync_impl import SYNC_IMPLS

STORAGE = (
    "--hicache-storage-backend file --hicache-storage-prefetch-policy wait_complete --storage-prefetch-threshold 16"
)


@dataclass(frozen=True)
class World:
    name: str
    flags: str


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
LOCKSTEP = ("symmetric_across_stages", "blocking_send")  # measured against the relay, not refused on sight
QUANTITIES = {
    "acks_write": "write acks",
    "acks_load": "load acks",
    "extend_tokens": "new tokens in its batch",
    "prefix_tokens": "cached tokens in its batch",
}
_running = False  # a check in progress in this process: a call while it imports your file returns at once
_relay_runs: dict[tuple, tuple[Path, dict]] = {}  # (world, device, quick) -> the relay's run (lockstep_cost)


def world_config(world: World, sync_impls: tuple[str, ...] = (), device: str = "cpu", quick: bool = True) -> RunConfig:
    """`world` on the divergence scenario of the tests (presets.WORLD: 3 layers, a 256-token device pool the
    conversations overflow by round 3, a host pool 3x larger). Not `quick`: twice the clients, rounds and pool."""
    larger = "" if quick else "--max-total-tokens 512 --num-clients 8 --num-rounds 8"
    cfg = config(WORLD, larger, world.flags, f"--device {device} --collective-timeout 6")
    parallel = dataclasses.replace(cfg.parallel, sync_impls=sync_impls)  # not through `config`: a path may hold spaces
    return dataclasses.replace(cfg, parallel=parallel)


@dataclass
class Verdict:
    ok: bool = True
    lines: list[str] = field(default_factory=list)
    mistake: str | None = None  # the MISTAKES kind the audit named, if any
    skipped: bool = False  # called in a rank, or while the check imports the caller's file: nothing to say

    def __str__(self) -> str:
        return "" if self.skipped else "\n".join([*self.lines, "PASSED" if self.ok else "FAILED"])


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


def audit_lines(out_dir: Path) -> list[dict]:
    lines = []
    for path in sorted(Path(out_dir).glob("sync_audit_rank*.jsonl")):
        rank = int(path.stem.removeprefix("sync_audit_rank"))
        for text in path.read_text().splitlines():
            try:
                lines.append({"rank": rank, **json.loads(text)})
            except json.JSONDecodeError:
                continue  # a line cut short as the rank was stopped
    return lines


def first_finding(lines: list[dict]) -> tuple[dict, dict] | None:
    """(line, finding) of the first call with a finding. A call is known by its slot and number (the same call
    on every rank); calls are ordered by when the first rank left them, then by stage."""
    first_end: dict[tuple, float] = {}
    for line in lines:
        key = (line["slot"], line["call"])
        first_end[key] = min(first_end.get(key, line["end"]), line["end"])
    found = [
        (first_end[line["slot"], line["call"]], line["stage"], line["rank"], i)
        for i, line in enumerate(lines)
        if line["findings"]
    ]
    if not found:
        return None
    line = lines[min(found)[3]]
    return line, line["findings"][0]


def stage_medians(out_dir: Path) -> dict[int, float]:
    """Median step time (ms) of each rank, from the step trace."""
    steps: dict[int, list[float]] = {}
    for row in read_trace(out_dir):
        steps.setdefault(row["rank"], []).append(row["ms"])
    return {rank: statistics.median(ms) for rank, ms in sorted(steps.items())}


RELAY = "pp_sync=hicache_lab.distributed.cache_sync:CacheSync._pp_sync"  # the lab's own, audited the same way
BINDERS = (SYNC_IMPLS, FAULTS)  # what its worlds need: your functions, and a slower stage


def pp_sync_timing(out_dir: Path) -> tuple[dict[int, float], float | None]:
    """From the audit of a run: the median time (ms) each stage spent in one call of pp_sync, and the median of
    how long after stage 0 the last stage left the same call (ms): how far stage 0 runs ahead."""
    waits: dict[int, list[float]] = {}
    ends: dict[int, dict[int, float]] = {}
    for line in audit_lines(out_dir):
        if line["slot"] == "pp_sync":
            waits.setdefault(line["stage"], []).append(line["ms"])
            ends.setdefault(line["stage"], {}).setdefault(line["call"], line["end"])
    last = max(ends, default=0)
    leads = [1e3 * (ends[last][k] - t) for k, t in ends.get(0, {}).items() if k in ends.get(last, {})]
    lead = statistics.median(leads) if leads and last > 0 else None
    return {stage: statistics.median(ms) for stage, ms in sorted(waits.items())}, lead


def lockstep_cost(world: World, out_dir: Path, summary: dict, device: str, quick: bool) -> str:
    """What the collective cost against the lab's one-way relay on the same world: how far stage 0 still runs
    ahead of the last stage, the time each stage spent in a call, and each stage's median step."""
    key = (world, device, quick)
    if key not in _relay_runs:  # one run of the relay per world in a process (the tests ask more than once)
        relay_dir = out_dir.parent / f"{out_dir.name}_relay"
        _relay_runs[key] = relay_dir, run(world_config(world, (RELAY,), device, quick), relay_dir, False, BINDERS)
    relay_dir, reference = _relay_runs[key]
    (yours, your_lead), (relay, relay_lead) = pp_sync_timing(out_dir), pp_sync_timing(relay_dir)
    lead = ""
    if your_lead is not None and relay_lead is not None:
        lead = (
            f"stage 0 left a call a median {relay_lead:.2f} ms before the last stage with the relay (it runs ahead), "
            f"{your_lead:.2f} ms with yours; "
        )
    waits = ", ".join(f"stage {s} {yours[s]:.2f} ms against {relay[s]:.2f} ms" for s in relay if s in yours)
    steps_yours, steps_relay = stage_medians(out_dir), stage_medians(relay_dir)
    stride = summary["config"]["parallel"]["tp"] * summary["config"]["parallel"]["cp"]
    steps = ", ".join(
        f"stage {rank // stride} {steps_yours[rank]:.1f} ms against {steps_relay[rank]:.1f} ms "
        f"({steps_yours[rank] / steps_relay[rank]:.2f}x)"
        for rank in steps_relay
        if rank % stride == 0 and rank in steps_yours
    )
    done = "" if reference["completed"] else " (the relay's run did not complete: compare with care)"
    return (
        f"measured on this world against the lab's one-way relay: {lead}a median call took {waits}; a median "
        f"step took {steps}{done}"
    )


def explain_run(summary: dict, lines: list[dict]) -> str | None:
    """What went wrong in a run with no finding of the audit, in words; None if nothing did."""
    words = []
    d = summary["first_divergence"]
    if d:
        stride = summary["config"]["parallel"]["tp"] * summary["config"]["parallel"]["cp"]
        values = {int(rank): v for rank, v in d["values"].items()}
        first = min(values)
        odd = next(r for r, v in values.items() if v != values[first])
        who, other = f"rank {odd} (stage {odd // stride})", f"rank {first} (stage {first // stride})"
        step, quantity = d["step"], d["quantity"]
        if quantity == "digest":
            words.append(f"at step {step} {who}'s tree differs from {other}'s (shape, tiers or locks)")
        elif quantity in ("acks_write", "acks_load"):
            words.append(
                f"at step {step} {who} consumed {values[odd]} {QUANTITIES[quantity]} while {other} consumed "
                f"{values[first]}"
            )
        else:
            words.append(
                f"at step {step} {who} and {other} differ in {QUANTITIES[quantity]}: {values[odd]} vs {values[first]}"
            )
    if summary["crashed"]:
        error = summary["error"] or "?"
        if "NotImplementedError" in error:
            stub = error.splitlines()[0].split("NotImplementedError: ")[-1]
            return f"not written yet: {stub} (your function still raises NotImplementedError; write it and run again)"
        if (stuck := stuck_receive(summary, lines)) is not None:
            words.append(waiting_words(summary, lines, *stuck))
        else:
            words.append(f"rank {summary['failing_rank']} crashed: {error.splitlines()[0]}")
    elif summary["outputs_match_reference"] is False:
        oracle = summary["oracle"]
        if oracle["copy_mismatches"]:
            first = oracle["copy_mismatches"][0]
            words.append(
                f"the oracle found {len(oracle['copy_mismatches'])} copies whose destination differs from its source, "
                f"the first: the {first}; a copy's ack was consumed before the copy had finished"
            )
        else:
            wrong = oracle["requests_with_wrong_logits"]
            words.append(f"{len(wrong)} requests' outputs differ from the from-scratch reference (ids {wrong[:5]})")
    return "; then ".join(words) or None


def stuck_receive(summary: dict, lines: list[dict]) -> tuple[dict, dict] | None:
    """(line, receive) of a rank whose last audited call ended in a receive that waited most of the collective
    timeout: the rank that waited, whichever rank the run's summary blames (its peers fail around it)."""
    timeout_ms = 1e3 * summary["config"]["parallel"]["collective_timeout_s"]
    last = {line["rank"]: line for line in lines}
    for _, line in sorted(last.items()):
        for op in line["ops"]:
            if op["op"] in ("recv", "irecv", "recv_object_list") and op["ms"] >= 0.8 * timeout_ms:
                return line, op
    return None


def waiting_words(summary: dict, lines: list[dict], line: dict, receive: dict) -> str:
    """A receive that waited past the collective timeout: from whom, and what that peer did in the same call."""
    timeout = summary["config"]["parallel"]["collective_timeout_s"]
    rank, peer = line["rank"], receive.get("peer")
    same = next(
        (x for x in lines if x["rank"] == peer and x["slot"] == line["slot"] and x["call"] == line["call"]), None
    )
    sends = sorted(
        {op["peer"] for op in (same or {"ops": []})["ops"] if op["op"] in ("send", "isend", "send_object_list")}
    )
    did = "made no such call" if same is None else f"sent to {sends or 'no one'}"
    if rank in sends:
        return f"rank {rank} waited {timeout:g} s to receive from rank {peer}, which did send to it"
    return (
        f"rank {rank} (stage {line['stage']}) waited {timeout:g} s in call {line['call']} of {line['slot']} to receive "
        f"from rank {peer} (stage {receive.get('peer_stage')}), and in that call rank {peer} {did}: a message no "
        "stage sent"
    )


def finding_words(finding: dict, summary: dict, lines: list[dict]) -> str:
    """The finding, why it is wrong, and (for one that does not stop the run) what the run then did."""
    words = mistake_text(finding["kind"], finding["what"])
    if MISTAKES[finding["kind"]][0]:
        return words  # the run stopped at once, with these words
    if summary["crashed"] and finding["kind"] in ("group_spans_stages", "backwards"):
        return f"{words}; in this run rank {summary['failing_rank']} stopped: {summary['error'].splitlines()[0]}"
    outcome = explain_run(summary, lines)
    return f"{words}; in this run: {outcome}" if outcome else words


CRASHES = {  # what the lab raises inside your function -> the mistake that makes it raise there
    "unbalanced lock_ref": "lock_released_twice",
    "pop from empty list": "wrong_ack_count",
}


def crash_kind(summary: dict) -> str | None:
    """The mistake a crash inside a `--sync-impl` function names (`CRASHES`), if any."""
    error = (summary["error"] or "") if summary["crashed"] else ""
    if "--sync-impl" not in error:
        return None
    return next((kind for words, kind in CRASHES.items() if words in error), None)


def check(
    pp_sync: str | Callable | None = None,
    writing_check: str | Callable | None = None,
    attn_groups: str | Callable | None = None,
    out_dir: Path | str = "runs/exercise",
    device: str = "cpu",
    quick: bool = True,
    worlds: tuple[World, ...] = WORLDS,
) -> Verdict:
    """Each world in turn with your functions (None: the lab's own), until one shows a mistake."""
    global _running
    if _running or multiprocessing.current_process().name != "MainProcess":  # a spawned rank importing a script
        return Verdict(skipped=True)
    given = {"pp_sync": pp_sync, "writing_check": writing_check, "attn_groups": attn_groups}
    specs = tuple(spec_of(slot, value) for slot, value in given.items() if value is not None)
    if not specs:
        raise ConfigError(f"check() needs at least one of {', '.join(SYNC_IMPL_SLOTS)}")
    verdict = Verdict()
    _running = True
    try:
        for i, world in enumerate(worlds):
            out = Path(out_dir) / f"world{i}"
            summary = run(world_config(world, specs, device, quick), out, False, BINDERS)
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
            else:
                why = explain_run(summary, lines)
                verdict.ok = why is None
            verdict.lines.append(f"{world.name}: {'ok' if verdict.ok else 'WRONG ' + why}")
            if not verdict.ok:
                break
        else:
            verdict.lines.append("every stage consumed the same acks at every step; outputs match the reference")
    finally:
        _running = False
    return verdict


EXAMPLES = {  # kind -> a wrong answer in teaching/mistakes/ that shows it (tests/lab/test_exercise.py runs each)
    "symmetric_across_stages": "pp_sync.py:all_reduce_max",
    "blocking_send": "pp_sync.py:blocking_send",
    "send_aliases_data": "pp_sync.py:sends_data_itself",
    "lost_send_handle": "pp_sync.py:drops_the_handle",
    "recv_not_waited": "pp_sync.py:irecv_without_wait",
    "recv_elsewhere": "pp_sync.py:receives_into_a_new_tensor",
    "no_receive": "pp_sync.py:two_stages_only",
    "backwards": "pp_sync.py:upstream",
    "wrong_rank_space": "pp_sync.py:global_ranks",
    "wrong_ack_count": "writing_check.py:only_finished_here",
    "acks_out_of_order": "writing_check.py:newest_first",
    "copy_not_waited": "writing_check.py:no_wait",
    "lock_leaked": "writing_check.py:keeps_the_lock",
    "lock_released_twice": "writing_check.py:releases_twice",
    "node_left_in_flight": "writing_check.py:leaves_them_in_flight",
    "node_not_published": "writing_check.py:forgets_to_publish",
    "wrong_node_taken": "writing_check.py:unlocks_every_write",
    "group_spans_stages": "attn_groups.py:with_the_pipeline",
    "missing_group": "attn_groups.py:attention_tp_only",
    "not_groups": "attn_groups.py:the_ranks_not_the_groups",
}


def mistakes_table() -> str:
    """The markdown table of every kind of mistake the audit recognises (docs/notebooks.md): its name in a
    verdict, whether it stops the run, a wrong answer that shows it, and the check's words for why."""
    rows = ["| `WRONG (kind)` | stops the run | shown by `teaching/mistakes/` | the check says |", "|---|---|---|---|"]
    rows += [
        f"| `{kind}` | {'at once' if fatal else 'no: the run shows it'} | `{EXAMPLES[kind]}` | {why} |"
        for kind, (fatal, why) in MISTAKES.items()
    ]
    return "\n".join(rows)


def add_exercise_flags(parser: argparse.ArgumentParser) -> None:
    for slot in SYNC_IMPL_SLOTS:
        parser.add_argument(
            f"--{slot.replace('_', '-')}",
            metavar="FILE.py:FUNCTION",
            help=f"your {slot} (a .py file's path, or MODULE:FUNCTION)",
        )
    parser.add_argument("--out", default="runs/exercise", help="where each world's run is written")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--full", action="store_true", help="twice the clients, rounds and device pool")
    parser.add_argument("--table", action="store_true", help="print the table of mistakes the check recognises")


def cmd_exercise(args: argparse.Namespace) -> int:
    if args.table:
        print(mistakes_table())
        return 0
    given = {slot: getattr(args, slot) for slot in SYNC_IMPL_SLOTS}
    if not any(given.values()):
        print("give at least one of --pp-sync, --writing-check, --attn-groups (FILE.py:FUNCTION)", file=sys.stderr)
        return 2
    verdict = check(**given, out_dir=args.out, device=args.device, quick=not args.full)
    print(verdict)
    return 0 if verdict.ok else 1
