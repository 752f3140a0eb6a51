"""The soak's results: one CSV row per run, resumable, and the Markdown tables counted from every row.

A results folder holds `soak_seed{S}_ranks{M}.csv` and the `.md` beside it. The tables are rewritten from the
CSV after every invocation; what follows a `## Notes` heading in the `.md` (where the runs were made, what a
finding turned out to be) is written by hand and kept. A CSV written with other columns (an older soak's) is
refused rather than appended to misaligned.
"""

from __future__ import annotations

import csv
from pathlib import Path

from ...errors import ConfigError

OUTCOMES = ("diverged", "crashed", "hung", "mismatched")
NOTES = "## Notes"


def read_rows(csv_path: Path, columns: list[str]) -> list[dict]:
    """The rows already in `csv_path` (none if it does not exist), refusing a file of other columns."""
    if not csv_path.exists():
        return []
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != columns:
            missing = sorted(set(columns) - set(reader.fieldnames or []))
            raise ConfigError(
                f"{csv_path} was written by another version of the soak (columns missing: {', '.join(missing)}); "
                "give another --results folder or --seed"
            )
        return list(reader)


def write_table(md_path: Path, rows: list[dict], modes: list[str], invocation: str) -> str:
    """Rewrite `md_path`'s tables from `rows`, keeping its hand-written notes; the tables."""
    table = summarize_rows(rows, modes)
    notes = ""
    if md_path.exists() and NOTES in (old := md_path.read_text()):
        notes = "\n" + old[old.index(NOTES) :]
    md_path.write_text(f"# Soak: {len(rows)} runs\n\n{invocation}, cases appended\n\n{table}\n{notes}")
    return table


def summarize_rows(rows: list[dict], modes: list[str]) -> str:
    """Two Markdown tables: per mode, how many runs ended in each way and what pressure they ran under; per mode
    and world size, runs and failures."""
    lines = [
        "| mode | runs | divergences | crashes | hangs | output mismatches | divergence rate | runs with chunks "
        "| runs with retractions | allocation faults (fired) | page damage (fired) | rank pauses | plug-ins "
        "| interrupts |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        counts = [sum(is_true(r[k]) for r in mine) for k in OUTCOMES]
        rate = counts[0] / len(mine) if mine else 0.0
        pressure = [sum(int(r[k] or 0) > 0 for r in mine) for k in ("chunks", "retractions")]
        faults = []
        for kind in ("alloc-fail", "damage-page"):
            drawn = [r for r in mine if r["fault"].startswith(kind)]
            faults.append(f"{len(drawn)} ({sum(is_true(r['fault_fired']) for r in drawn)})")
        pauses = sum(r["paused"] == "paused" for r in mine)
        plugins = sum(bool(r.get("plugin")) for r in mine)  # a soak's older CSV has neither column
        interrupts = sum(r.get("interrupted") == "interrupted" for r in mine)
        lines.append(
            f"| {mode} | {len(mine)} | {' | '.join(map(str, counts))} | {rate:.1%} | "
            f"{' | '.join(map(str, pressure))} | {' | '.join(faults)} | {pauses} | {plugins} | {interrupts} |"
        )
    lines += ["", "| mode | ranks | runs | failures |", "|---|--:|--:|--:|"]
    for mode in modes:
        for ranks in sorted({int(r["ranks"]) for r in rows if r["mode"] == mode}):
            mine = [r for r in rows if r["mode"] == mode and int(r["ranks"]) == ranks]
            failed = sum(any(is_true(r[k]) for k in OUTCOMES) for r in mine)
            lines.append(f"| {mode} | {ranks} | {len(mine)} | {failed} |")
    return "\n".join(lines)


def is_true(value) -> bool:
    """A CSV cell (or a fresh row's value) as a bool."""
    return value is True or value == "True"
