"""Class 1, storage serves another model's KV: a store filled by one model, read by another (by the lab's cache
or by SGLang's own, `--cache-impl sglang`); or by one layout of the model, read by another (its ranks hold other
heads)."""

from __future__ import annotations

import json
from pathlib import Path

from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, sglang_version

from .common import STORE, R
from .judge import Hostile, Outcome, run_cli


def _twice(first: list[str], second: list[str]):
    """A case that runs R twice on one store: `first` flags, then `second` flags (checked, into out/)."""

    def run(scratch: Path):
        run_cli(scratch, *R, *first, "--out", "first")
        return run_cli(scratch, *R, *second, "--check-outputs", "--out", "out")

    return run


def _two_layouts(scratch: Path) -> Outcome:
    """`--tp 2` fills a store, `--cp 2` runs on it: both write the global TP rank 1 of 2, with 2 heads a page
    and with 4. The second run must neither take the first's pages for damaged ones nor rewrite them."""
    run_cli(scratch, *R, "--tp", "2", "--out", "first")
    first = {p.name: p.read_bytes() for p in (scratch / "store").glob("*.bin")}
    outcome = run_cli(scratch, *R, "--cp", "2", "--check-outputs", "--out", "out")
    if "truncated" in outcome.output or "corrupted" in outcome.output:
        return Outcome(None, outcome.output + "\nthe other layout's pages were read as damaged", outcome.leftover)
    if changed := [name for name, data in first.items() if (scratch / "store" / name).read_bytes() != data]:
        return Outcome(
            None, outcome.output + f"\n{len(changed)} of the first layout's pages rewritten", outcome.leftover
        )
    return outcome


def _sglang_missing() -> str | None:
    return None if sglang_version() == SGLANG_VERSION else f"--cache-impl sglang runs sglang {SGLANG_VERSION}"


def _two_models_on_sglangs_store(scratch: Path) -> Outcome:
    """SGLang's own cache fills a store with one model, then runs another `--model-seed` (same page shape) on it:
    SGLang's keys name the model, so the second model's first round finds nothing in the store."""
    sglang = ("--cache-impl", "sglang")
    run_cli(scratch, *R, *sglang, "--out", "first")
    outcome = run_cli(scratch, *R, *sglang, "--model-seed", "7", "--check-outputs", "--out", "out")
    summary = scratch / "out" / "summary.json"
    rounds = json.loads(summary.read_text())["rounds"] if summary.is_file() else []
    if rounds and (hits := rounds[0]["cached_storage"]):
        return Outcome(
            None, outcome.output + f"\nround 0 read {hits} tokens of the other model's pages", outcome.leftover
        )
    return outcome


CASES = [
    Hostile(
        1,
        "fills a store with one model, then runs another `--mlp-size` on it",
        _twice([], ["--mlp-size", "64"]),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
    Hostile(
        1,
        "fills a store, then runs a model of another `--vocab-size` (same page shape) on it",
        _twice([], ["--vocab-size", "200"]),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
    Hostile(
        1,
        "fills a store with `--tp 2`, then runs `--cp 2` on it: ranks of both are `tp1of2`, with other heads",
        _two_layouts,
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
    Hostile(
        1,
        "fills a store with SGLang's own cache (`--cache-impl sglang`), then runs another `--model-seed` on it",
        _two_models_on_sglangs_store,
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
        needs=_sglang_missing,
    ),
]
