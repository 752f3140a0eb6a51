"""Class 2, a page under another page's name: a filled store's page files swapped before a second run."""

from __future__ import annotations

from pathlib import Path

from .common import STORE, after_filling
from .judge import Hostile


def _rotate(files: list[Path]) -> None:
    """Every page file takes the bytes of the next one: intact pages, each under another page's name."""
    payloads = [f.read_bytes() for f in files]
    for file, payload in zip(files, payloads[1:] + payloads[:1], strict=True):
        file.write_bytes(payload)


def _other_shard(files: list[Path]) -> None:
    """TP rank 1's pages replaced by TP rank 0's pages of the same hash: the right page, the wrong shard."""
    for file in files:
        if "_tp1of2_h2-4_" in file.name:  # the small world's 4 heads: rank 1 holds heads 2-4, rank 0 heads 0-2
            file.write_bytes(file.with_name(file.name.replace("_tp1of2_h2-4_", "_tp0of2_h0-2_")).read_bytes())


CASES = [
    Hostile(
        2,
        "rotates a filled store's page files, so every valid page sits under another page's name",
        after_filling(_rotate),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
    Hostile(
        2,
        "copies TP rank 0's pages over TP rank 1's (`--tp 2`): the right page of the wrong shard",
        after_filling(_other_shard, ("--tp", "2")),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
]
