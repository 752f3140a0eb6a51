"""What a run of the exercise did, in words (exercise.py's verdicts): the audit's first finding, from each rank's
`sync_audit_rank{R}.jsonl` (`first_finding`, `finding_words`), what a lockstep cost against the lab's relay
(`lockstep_words`), a crash inside your function (`crash_kind`), or what the run did without a finding
(`explain_run`: a divergence, a crash, a receive no stage answered, the oracle's copy mismatch).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ...managers.step_trace import read_trace
from .mistakes import MISTAKES, mistake_text

QUANTITIES = {
    "acks_write": "write acks",
    "acks_load": "load acks",
    "extend_tokens": "new tokens in its batch",
    "prefix_tokens": "cached tokens in its batch",
}


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


def lockstep_words(out_dir: Path, summary: dict, relay_dir: Path, reference: dict) -> str:
    """What the collective cost against the lab's one-way relay (its run in `relay_dir`, its summary `reference`)
    on the same world: how far stage 0 still runs ahead of the last stage, the time each stage spent in a call,
    and each stage's median step."""
    (yours, your_lead), (relay, relay_lead) = pp_sync_timing(out_dir), pp_sync_timing(relay_dir)
    lead = ""
    if your_lead is not None and relay_lead is not None:
        after = f"{-your_lead:.2f} ms after it (it waits for the last stage)"
        lead = (
            f"with the relay stage 0 finishes a call {relay_lead:.2f} ms (median) before the last stage finishes the "
            f"same call: it runs ahead; with yours, {f'{your_lead:.2f} ms' if your_lead >= 0 else after}; "
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


SENDS = ("send", "isend", "send_object_list")


def relay_sends(lines: list[dict]) -> dict[int, list[int]]:
    """Per stage, from the audit of a run: the stages its pp_sync sent to, in the call that sent to the most."""
    widest: dict[int, list[int]] = {}
    for line in lines:
        if line["slot"] == "pp_sync":
            peers = [op["peer_stage"] for op in line["ops"] if op["op"] in SENDS and op.get("peer_stage") is not None]
            if len(peers) > len(widest.get(line["stage"], [])):
                widest[line["stage"]] = peers
    return dict(sorted(widest.items()))


def chain_note(lines: list[dict]) -> str | None:
    """A note for a right relay that is not the chain the glossary describes (a stage sending to more than one
    later stage in a call: stage 0 to every other, a star); None for the chain."""
    wide = {stage: peers for stage, peers in relay_sends(lines).items() if len(peers) > 1}
    if not wide:
        return None
    stage, peers = next(iter(wide.items()))
    return (
        f"  note: yours is one-way and right, but not the chain of the glossary's relay: stage {stage} sent "
        f"{len(peers)} messages in one call (to stages {sorted(peers)}), where in the chain every stage sends one, "
        "to the next stage, which passes it on; with pp stages yours has stage 0 send pp - 1 messages a step, the "
        "chain one (the design question of notebook 06 measures both)"
    )


def unjudged_words(summary: dict) -> str | None:
    """Why a run without a finding gives no evidence for a verdict, in words: it was interrupted, or ended
    without completing and without a divergence or a crash to show, or its outputs were never checked; None
    where it gives evidence (a verdict, right or wrong, may be drawn from it)."""
    if summary["diverged"]:
        return None  # the steps before the end show a mistake, however the run ended
    if summary["interrupted"]:
        return f"{summary['error']}; run the check again to the end"
    if not summary["completed"] and not summary["crashed"]:
        return f"the world ended without completing ({summary['error'] or 'no rank reported'})"
    if summary["completed"] and summary["outputs_match_reference"] is None:
        return "the outputs were not checked against the reference"
    return None


def left_running(summary: dict) -> list[str]:
    """A note for each thread or process the run's code left running (ended with its rank or the run)."""
    return [
        f"  note: {left} was still running when the rank ended; it was ended" for left in summary.get("left_behind", [])
    ]


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
            acks = QUANTITIES[quantity].removesuffix("s") if values[odd] == 1 else QUANTITIES[quantity]
            words.append(f"at step {step} {who} consumed {values[odd]} {acks} while {other} consumed {values[first]}")
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
                f"the oracle found {len(oracle['copy_mismatches'])} copies whose destination differs from their "
                f"source, the first: the {first}; a copy's ack was consumed before the copy had finished"
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
