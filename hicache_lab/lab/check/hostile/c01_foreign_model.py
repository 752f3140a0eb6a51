"""Class 1, storage serves another model's KV: a store filled by one model, read by another; or by one layout
of the model, read by another (its ranks hold other heads)."""

from __future__ import annotations

from pathlib import Path

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
]
