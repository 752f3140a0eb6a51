"""Per-rank, per-step trace: one JSON line per step, flushed as it is written, so a run that crashes or hangs
keeps its history up to the last step. `load_trace` reads every rank's trace into one pandas table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


class TraceWriter:
    def __init__(self, path: Path, rank: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.file = path.open("w")  # noqa: SIM115 - held open for the whole run, closed by close()

    def write(self, record) -> None:
        self.file.write(json.dumps({"rank": self.rank, **dataclasses.asdict(record)}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def trace_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"trace_rank{rank}.jsonl"


def load_trace(out_dir: Path):
    """Every rank's steps as one DataFrame (columns: rank, step, kind, acks_write, acks_load, digest, ...)."""
    import pandas as pd

    paths = sorted(Path(out_dir).glob("trace_rank*.jsonl"))
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    return pd.DataFrame(rows)
