"""Class 1, storage serves another model's KV: a store filled by one model, read by another."""

from __future__ import annotations

from pathlib import Path

from .common import STORE, R
from .judge import Hostile, run_cli


def _twice(first: list[str], second: list[str]):
    """A case that runs R twice on one store: `first` flags, then `second` flags (checked, into out/)."""

    def run(scratch: Path):
        run_cli(scratch, *R, *first, "--out", "first")
        return run_cli(scratch, *R, *second, "--check-outputs", "--out", "out")

    return run


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
]
