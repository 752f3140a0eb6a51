"""Check your own `_pp_sync` / `writing_check` (`--sync-impl`) on the worlds where the legacy sync diverges.

`check(...)` runs PP = 2 and PP = 3 with the fixed sync and your functions in every rank, on a small
workload whose device pool overflows (so write-through, eviction and load-back all happen) with virtual
latency (so every run is reproducible), and says in words what went wrong: the first step at which two
stages consumed different numbers of acks, the crash that followed, a stage that waited for a message no one
sent, or outputs that differ from the from-scratch reference. notebooks/06_exercises.ipynb uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig
from ..entrypoints.launch import run
from .presets import WORLD, config

QUANTITIES = {
    "acks_write": "write acks",
    "acks_load": "load acks",
    "extend_tokens": "new tokens in its batch",
    "prefix_tokens": "cached tokens in its batch",
}


def exercise_config(pp: int, sync_impls: tuple[str, ...] = (), device: str = "cpu", quick: bool = True) -> RunConfig:
    """The divergence scenario of the test suite (presets.WORLD): 3 layers over `pp` stages, a device pool of 256
    tokens that the conversations overflow by round 3, a host pool 3x larger. Not `quick`: twice the clients,
    rounds and device pool."""
    larger = "" if quick else "--max-total-tokens 512 --num-clients 8 --num-rounds 8"
    impls = " ".join(f"--sync-impl {spec}" for spec in sync_impls)
    return config(WORLD, larger, f"--pp {pp} --device {device} --collective-timeout 15", impls)


@dataclass
class Verdict:
    ok: bool = True
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join([*self.lines, "PASSED" if self.ok else "FAILED"])


def explain(summary: dict) -> tuple[bool, str]:
    """One run's outcome in words: (passed, explanation)."""
    d = summary["first_divergence"]
    words = []
    if d:
        values = {int(rank): v for rank, v in d["values"].items()}  # tp = cp = 1: rank r is stage r
        first = min(values)
        odd = next(r for r, v in values.items() if v != values[first])
        step, quantity = d["step"], d["quantity"]
        if quantity == "digest":
            words.append(f"at step {step} stage {odd}'s tree differs from stage {first}'s (shape, tiers or locks)")
        elif quantity in ("acks_write", "acks_load"):
            words.append(
                f"at step {step} stage {odd} consumed {values[odd]} {QUANTITIES[quantity]} "
                f"while stage {first} consumed {values[first]}"
            )
        else:
            words.append(
                f"at step {step} stage {odd} and stage {first} differ in {QUANTITIES[quantity]}: "
                f"{values[odd]} vs {values[first]}"
            )
    if summary["crashed"]:
        error = summary["error"] or ""
        if "Timed out" in error or "timed out" in error:
            words.append(
                f"rank {summary['failing_rank']} waited {summary['config']['parallel']['collective_timeout_s']:g} s "
                "for a message no one sent: every stage but the first must receive from the previous stage, and "
                "every stage but the last must send to the next"
            )
        else:
            words.append(f"rank {summary['failing_rank']} crashed: {error.splitlines()[0] if error else '?'}")
    elif summary["outputs_match_reference"] is False:
        oracle = summary["oracle"]
        wrong = oracle["requests_with_wrong_logits"] or oracle["copy_mismatches"]
        words.append(f"outputs differ from the from-scratch reference ({len(wrong)} requests or copies: {wrong[:3]})")
    if words:
        return False, "; then ".join(words)
    return True, "every stage consumed the same acks at every step; outputs match the reference"


def check(sync_impls: tuple[str, ...], out_dir: Path, pps=(2, 3), device: str = "cpu", quick: bool = True) -> Verdict:
    """Run each PP size with `sync_impls` and explain the outcome of each."""
    verdict = Verdict()
    for pp in pps:
        summary = run(exercise_config(pp, sync_impls, device, quick), Path(out_dir) / f"pp{pp}", verbose=False)
        passed, why = explain(summary)
        verdict.lines.append(f"PP={pp}: {'ok' if passed else 'WRONG'} - {why}")
        verdict.ok &= passed
    return verdict
