"""The hostile-input cases (lab/hostile.py judges them), one section per class.

`R` is the issue's storage run: 4 clients x 3 rounds, host tier and file store (in `store/`, beside the run's
`out/`), caches flushed between rounds so every later round's hits come from storage.
"""

from __future__ import annotations

from pathlib import Path

from .hostile import Hostile, lab

R = [
    *("run", "--num-clients", "4", "--num-rounds", "3", "--enable-hierarchical-cache"),
    *("--hicache-storage-backend", "file", "--hicache-storage-dir", "store", "--flush-cache-between-rounds"),
    *("--storage-prefetch-threshold", "16", "--hicache-storage-prefetch-policy", "wait_complete"),
]
STORE = ("out", "store", "first")  # what a storage case's runs own


def _twice(first: list[str], second: list[str]):
    """A case that runs R twice on one store: `first` flags, then `second` flags (checked, into out/)."""

    def run(scratch: Path):
        lab(scratch, *R, *first, "--out", "first")
        return lab(scratch, *R, *second, "--check-outputs", "--out", "out")

    return run


# -- 1. Storage serves another model's KV ---------------------------------------------------------------------

STORAGE_IDENTITY = [
    Hostile(
        1,
        "fills a store with one model, then runs another `--mlp-size` on it",
        _twice([], ["--mlp-size", "64"]),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
]

# -- 2. A page under another page's name ----------------------------------------------------------------------

# -- 3. One stage's damaged page ------------------------------------------------------------------------------

# -- 4. Hangs no timeout covers -------------------------------------------------------------------------------

# -- 5. Orphan processes --------------------------------------------------------------------------------------

# -- 6. Lost or mixed files -----------------------------------------------------------------------------------

# -- 7. Ranks started with different flags --------------------------------------------------------------------

# -- 8. Failures that exit 0 ----------------------------------------------------------------------------------

# -- 9. Blame and summaries -----------------------------------------------------------------------------------

# -- 10. Values the preflight must refuse ---------------------------------------------------------------------

CASES: list[Hostile] = [*STORAGE_IDENTITY]
