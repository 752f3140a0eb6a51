"""What went wrong in a bug-zoo run (zoo.py), read from its summary and its directory: each symptom returns
the failure in words, or None. An entry's broken run must show its symptom, its fixed run must not."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

from ...entrypoints.report import divergence_words, storage_hit_rate
from ...managers.step_trace import read_trace


def diverged(summary: dict, out: Path) -> str | None:
    """The first step at which ranks differ, and the crash it led to."""
    words = []
    if divergence := divergence_words(summary):
        words.append(divergence)
    if summary["crashed"]:
        words.append(f"rank {summary['failing_rank']} crashed: {summary['error']}")
    return "; ".join(words) or None


def no_storage_hits(summary: dict, out: Path) -> str | None:
    rate = storage_hit_rate(summary)
    return f"storage hit rate {rate:.1%}: every prefetch revoked" if summary["completed"] and rate == 0 else None


def prefetches_revoked(summary: dict, out: Path) -> str | None:
    """Storage holds pages, yet most prefetches find too few leading ones and are revoked (rank 0's counters)."""
    stats = json.loads((out / "rank0.json").read_text()).get("storage", {})
    revoked, issued, backed_up = stats.get("revoked", 0), stats.get("prefetches", 0), stats.get("pages_backed_up", 0)
    if not summary["completed"] or backed_up == 0 or 2 * revoked <= issued:
        return None
    return (
        f"{revoked} of {issued} prefetches revoked though {backed_up} pages were backed up: "
        f"storage hit rate {storage_hit_rate(summary):.1%}"
    )


def relay_sends_only_grow(summary: dict, out: Path) -> str | None:
    """Relay send handles never freed: on a rank that sends, the count grows and never falls during the run (with
    the fix it stays at one step's sends)."""
    by_rank: dict[int, list[int]] = {}
    for row in read_trace(out):
        by_rank.setdefault(row["rank"], []).append(row["relay_sends"])
    growing = {r: c[-1] for r, c in by_rank.items() if c[-1] > c[0] and all(a <= b for a, b in pairwise(c))}
    if not growing:
        return None
    steps = max(len(c) for c in by_rank.values())
    return f"relay send handles never freed: {growing} still held after {steps} steps (one per relayed agreement)"
