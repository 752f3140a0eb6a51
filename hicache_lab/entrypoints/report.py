"""Per-round statistics, the summary table, and the files a run leaves behind."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from ..args import sglang_flags
from ..config import RunConfig
from ..managers.schedule_batch import Req
from ..managers.step_trace import StepRecord, first_divergence, read_trace
from ..provenance import provenance
from .outdir import write_file
from .preflight import idle_flags


def round_rows(reqs: list[Req], records: list[StepRecord]) -> list[dict]:
    """One row per round: hit rates by tier against the infinite-cache bound, the modelled TTFT and step time
    (managers/latency_model.py) and the wall clock's (`ttft_ms`, `step_ms`)."""
    rows = []
    for round_ in sorted({r.round for r in reqs}):
        batch = [r for r in reqs if r.round == round_]
        rids = {r.rid for r in batch}
        steps = [s for s in records if rids.intersection(s.requests)]
        prompt = sum(len(r.prompt) for r in batch)
        device = sum(r.cached_device for r in batch)
        host = sum(r.cached_host for r in batch)
        storage = sum(r.cached_storage for r in batch)
        rows.append(
            {
                "round": round_,
                "requests": len(batch),
                "prompt_tokens": prompt,
                "cached_tokens": device + host + storage,
                "cached_device": device,
                "cached_host": host,
                "cached_storage": storage,
                "hit_rate": (device + host + storage) / prompt,
                "upper_bound_hit_rate": sum(r.upper_bound_cached for r in batch) / prompt,
                "modelled_ttft_ms": sum(r.modelled_first_token_ms - r.modelled_arrival_ms for r in batch) / len(batch),
                "modelled_step_ms": sum(s.modelled_ms for s in steps) / max(1, len(steps)),
                "ttft_ms": 1e3 * sum(r.first_token_at - r.arrival for r in batch) / len(batch),
                "step_ms": sum(s.ms for s in steps) / max(1, len(steps)),
            }
        )
    return rows


def format_table(rows: list[dict], wall_clock: bool = True) -> str:
    """The round table: TTFT and step time as modelled (managers/latency_model.py), then (`wall_clock`) timed."""
    head = f"{'round':>5} {'prompt':>7} {'device':>7} {'host':>6} {'storage':>7} {'hit':>6} {'bound':>6} "
    lines = [head + f"{'model_ttft':>10} {'model_step':>10}" + wall_clock * f" {'wall_ttft':>9} {'wall_step':>9}"]
    for r in rows:
        lines.append(
            f"{r['round']:>5} {r['prompt_tokens']:>7} {r['cached_device']:>7} {r['cached_host']:>6} "
            f"{r['cached_storage']:>7} {r['hit_rate']:>6.1%} {r['upper_bound_hit_rate']:>6.1%} "
            f"{r['modelled_ttft_ms']:>10.1f} {r['modelled_step_ms']:>10.2f}"
            + wall_clock
            * f" {r['ttft_ms']:>9.1f} {r['step_ms']:>9.2f}"
        )
    return "\n".join(lines)


def mean_hit_rate(rows: list[dict], first: int, last: int, key: str = "hit_rate") -> float:
    """Mean of `key` over rounds first..last (inclusive)."""
    chosen = [r[key] for r in rows if first <= r["round"] <= last]
    return sum(chosen) / len(chosen) if chosen else float("nan")


def scheduling_counts(loop) -> dict:
    """What one rank's scheduler did beyond plain prefills and decodes, and the most relay sends it held."""
    stats = loop.scheduler.stats
    return {
        "chunked_prefills": stats["chunks"],
        "retractions": stats["retractions"],
        "max_relay_sends": max((r.relay_sends for r in loop.records), default=0),
        "max_older_relay_sends": max((r.relay_sends - r.relay_sent for r in loop.records), default=0),
    }


def _merge_scheduling(results: list[dict]) -> dict:
    """Rank 0's chunk and retraction counts (every rank's are equal when they agree), the world's most relay
    sends held at once (which rank held them), and the most held from steps before the current one (0 when
    every step drains the previous one's)."""
    counted = [r for r in results if "scheduling" in r]
    if not counted:
        return {}
    most = max(counted, key=lambda r: r["scheduling"]["max_relay_sends"])
    return {
        **counted[0]["scheduling"],
        "max_relay_sends": most["scheduling"]["max_relay_sends"],
        "max_relay_sends_rank": most["rank"],
        "max_older_relay_sends": max(r["scheduling"]["max_older_relay_sends"] for r in counted),
    }


def write_requests(out_dir: Path, reqs: list[Req]) -> None:
    """Every request in arrival order, to replay the same workload: here (`--requests-file`), or elsewhere."""
    keys = ("rid", "round", "client", "prompt", "max_new_tokens", "ignore_eos", "output")
    keys += ("modelled_arrival_ms", "modelled_first_token_ms")  # on stage 0's modelled clock (latency_model.py)
    lines = [{key: getattr(r, key) for key in keys} for r in reqs]
    write_file(Path(out_dir) / "requests.jsonl", "".join(json.dumps(line) + "\n" for line in lines))


def _merge_oracles(results: list[dict]) -> dict | None:
    """The reference rank's logit check plus every rank's copy checks."""
    checked = [r for r in results if "oracle" in r]
    if not checked:
        return None
    reference = max(checked, key=lambda r: r["oracle"]["requests_checked"])
    merged = dict(reference["oracle"], reference_rank=reference["rank"])
    merged["copies_checked"] = sum(r["oracle"]["copies_checked"] for r in checked)
    merged["copy_mismatches"] = [m for r in checked for m in r["oracle"]["copy_mismatches"]]
    merged["ok"] = all(r["oracle"]["ok"] for r in checked) and merged["requests_checked"] > 0
    return merged


def _merge_faults(cfg: RunConfig, results: list[dict]) -> list[dict]:
    """Each fault asked (`--fault`, `--skip-load-wait`) and what the ranks it strikes recorded (hooks.Chances):
    `fired` is True where it came on some rank, False where it never did (then `message` says why, as a warning,
    and the CLI exits 1), None where no rank it strikes left a result; `chances` per rank."""
    lab = cfg.lab
    asked = [f"--fault {lab.fault}"] * bool(lab.fault) + ["--skip-load-wait"] * lab.skip_load_wait
    merged = []
    for flag in asked:
        records = [f for r in results for f in r.get("faults", ()) if f["asked"] == flag]
        fired = any(f["fired"] for f in records) if records else None
        message = records[0]["message"] if fired is False else None
        if message:
            logging.getLogger(__name__).warning(message)
        chances = {str(f["rank"]): f["chances"] for f in records}
        merged.append({"asked": flag, "fired": fired, "chances": chances, "message": message})
    return merged


def _exit_reason(code: int | str) -> str:
    if isinstance(code, str):
        return code
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


@dataclass
class WorldEnd:
    """How the world ended, as its launcher saw it (each rank's result says the rest)."""

    run_id: str | None  # the run's id: only results that carry it are this run's
    failed: dict[int, int | str] = field(default_factory=dict)  # ranks that failed first: exit code, or in words
    stopped: dict[int, str] = field(default_factory=dict)  # ranks that never reported: what their process was doing
    interrupted: str | None = None  # the signal (SIGINT, SIGTERM) that ended the run early
    notes: list[str] = field(default_factory=list)  # what the launcher had to do beyond stopping ranks (watch.py)


def read_results(out_dir: Path, end: WorldEnd, world_size: int) -> list[dict]:
    """This run's rank results, by rank: files of another run (another id, a rank beyond this world) and files
    cut short (a full disk) are not this run's."""
    results = []
    for path in Path(out_dir).glob("rank*.json"):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if result.get("run_id") == end.run_id and result.get("rank", world_size) < world_size:
            results.append(result)
    return sorted(results, key=lambda r: r["rank"])


def blame(results: list[dict], missing: list[int], end: WorldEnd, elapsed_s: float) -> tuple[str | None, int | None]:
    """(error, failing rank). The cause comes first: a rank that failed on its own with no result, then one that
    raised (earliest first), then one that never reported (stuck: its process state says how). A rank that timed
    out or lost a connection waited for a peer: a symptom, named only where nothing else is (`waited`)."""
    ended = [r for r in results if r["crashed"] or r.get("interrupted")]
    waits = [f"rank {r['rank']} in {r['hung_in']}" for r in ended if "hung_in" in r]  # which collectives never met
    causes = [r for r in ended if not r.get("waited") and not (end.interrupted and r.get("interrupted"))]
    if lost := [rank for rank in end.failed if rank in missing]:
        others = "; the others were stopped" if len(results) + len(missing) > 1 else ""
        return f"rank {lost[0]} {_exit_reason(end.failed[lost[0]])} without a result{others}", lost[0]
    if causes or (ended and not missing and not end.interrupted):
        first = min(causes or ended, key=lambda r: r["failed_at"])
        others = [w for w in waits if not w.startswith(f"rank {first['rank']} ")]
        return first["error"] + (f"; meanwhile {', '.join(others)}" if others else ""), first["rank"]
    if end.interrupted:
        left = f"; ranks {missing} were stopped before they reported" if missing else ""
        return f"interrupted by {end.interrupted} after {elapsed_s:.1f} s: the summary holds what was done{left}", None
    if missing:
        rank = missing[0]
        waited = f"; the others waited for it: {', '.join(waits)}" if waits else ""
        return f"rank {rank} never reported: {end.stopped.get(rank, 'its process state is unknown')}{waited}", rank
    return None, None


def whole_steps(rows: list[dict], cut: set[int]) -> list[dict]:
    """The trace less the last step of each rank a signal cut short (`cut`): that step is traced as the signal
    left it, half done, and would show a divergence no rank took."""
    last = {}
    for row in rows:
        if row["rank"] in cut:
            last[row["rank"]] = max(last.get(row["rank"], -1), row["step"])
    return [row for row in rows if last.get(row["rank"]) != row["step"]]


def summarize(cfg: RunConfig, out_dir: Path, elapsed_s: float, end: WorldEnd) -> dict:
    """Merge this run's rank results and traces into `summary.json`, with the cause of a failure (`blame`)."""
    world = cfg.parallel.world_size
    results = read_results(out_dir, end, world)
    missing = [rank for rank in range(world) if rank not in {r["rank"] for r in results}]
    error, failing = blame(results, missing, end, elapsed_s)
    first = next((r for r in results if r["rank"] == failing), None)
    completed = error is None and not missing
    cut = {r["rank"] for r in results if r.get("interrupted")} | (set(missing) if end.interrupted else set())
    divergence = first_divergence(whole_steps([row for row in read_trace(out_dir) if row["rank"] < world], cut))
    oracle = _merge_oracles(results)
    summary = {
        "config": dataclasses.asdict(cfg),
        "provenance": provenance(cfg),  # the command, commit, versions, host, date and seeds
        "sglang_flags": sglang_flags(cfg),
        "idle_flags": idle_flags(cfg),  # flags given that could do nothing here (preflight.IDLE_UNLESS)
        "run_id": end.run_id,
        "completed": completed,
        "crashed": not completed and failing is not None,
        "interrupted": end.interrupted,
        "error": error,
        "failing_rank": failing,
        "stopped_ranks": missing,
        "diverged": divergence is not None,
        "first_divergence": divergence,
        "rounds": results[0]["rounds"] if results and results[0]["rank"] == 0 else [],
        "per_rank_hit_rates": {str(r["rank"]): [row["hit_rate"] for row in r["rounds"]] for r in results},
        "scheduling": _merge_scheduling(results),
        "outputs_match_reference": oracle["ok"] if oracle else None,
        "oracle": oracle,
        "faults": _merge_faults(cfg, results),
        "elapsed_s": elapsed_s,
        "notes": end.notes,
        "left_behind": [f"thread {name!r} of rank {r['rank']}" for r in results for name in r.get("left_threads", ())],
    }
    if first and "traceback" in first:
        summary["traceback"] = first["traceback"]
    write_file(Path(out_dir) / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def passed(summary: dict) -> bool:
    """Whether a run did all it should: it completed, its ranks never diverged (whatever their outputs: ranks that
    ended apart failed), its outputs matched the reference where checked, and every fault asked for came."""
    return bool(
        summary["completed"]
        and not summary["diverged"]
        and summary["outputs_match_reference"] is not False
        and all(f["fired"] is not False for f in summary.get("faults", ()))
    )


def divergence_words(summary: dict) -> str | None:
    """The first step and quantity at which ranks differed, in words; None if they never did."""
    d = summary["first_divergence"]
    return f"ranks diverged at step {d['step']} on {d['quantity']} {d['values']}" if d else None


def print_summary(summary: dict) -> None:
    print(f"equivalent SGLang flags: {summary['sglang_flags']}")
    print(format_table(summary["rounds"], wall_clock=summary["config"]["device"] != "cpu"))
    if summary["diverged"]:
        d = summary["first_divergence"]
        print(f"diverged at step {d['step']} on {d['quantity']}: {d['values']}")
    if summary["crashed"]:
        print(f"crashed (rank {summary['failing_rank']}): {summary['error']}")
    elif summary["interrupted"]:
        print(summary["error"])
    if s := summary.get("scheduling"):
        print(
            f"scheduling: {s['chunked_prefills']} prefill chunks, {s['retractions']} retractions; "
            f"at most {s['max_relay_sends']} relay sends outstanding, {s['max_older_relay_sends']} of them "
            "from earlier steps"
        )
    if summary["outputs_match_reference"] is not None:
        print(f"outputs_match_reference: {summary['outputs_match_reference']}")
    for flag in summary.get("idle_flags", []):
        print(f"warning: {flag}")
    for note in summary.get("notes", []):
        print(f"note: {note}")
    for left in summary.get("left_behind", []):
        print(f"note: the run's code left {left} running; it was ended")


def storage_hit_rate(summary: dict) -> float:
    rows = [r for r in summary["rounds"] if r["round"] > 0]
    return sum(r["cached_storage"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))
