"""Per-rank, per-step trace and divergence detection.

Each rank writes one JSON line per step, flushed as it is written, so a run that crashes or hangs keeps its
history up to the last step. Steps are numbered by iteration, the same on every rank, so ranks can be
compared step by step: `first_divergence` finds the first step at which two ranks consumed different ack
counts, ran different batches, or hold different trees. `load_trace` gives every rank's steps as one pandas
table for notebooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

# In causal order: acks decide locks, locks decide batches, batches decide the tree.
DIVERGENCE_QUANTITIES = ("acks_write", "acks_load", "extend_tokens", "prefix_tokens", "digest")


@dataclass
class StepRecord:
    step: int
    kind: str  # "prefill", "decode" or "idle"
    ms: float  # wall clock
    requests: list[int]
    extend_tokens: int
    prefix_tokens: int
    ready_write: int  # write acks this rank saw finished (its own poll; may differ between ranks)
    ready_load: int
    acks_write: int  # write acks consumed this step (the agreed count: must not differ)
    acks_load: int
    digest: str  # the tree after the step: equal on ranks that took the same decisions
    device_free: int
    host_free: int
    relay_sends: int = 0  # relay send handles this rank still holds (grows without bound when reaped by polling)
    host_write_tokens: int = 0  # device -> host tokens whose write-through started in this step
    host_load_tokens: int = 0  # host -> device tokens whose load back started in this step
    relay_sent: int = 0  # relay sends this rank issued in this step: with the drain, relay_sends <= relay_sent
    # For the causal chain (lab/teach/chain.py): what the step's acks unlocked and its evictions took, as [node id,
    # tokens] (node ids agree across ranks while their trees do), and each request's cached prefix and new tokens
    unlocked_nodes: list[list[int]] = dataclasses.field(default_factory=list)  # by the acks consumed this step
    evicted_nodes: list[list[int]] = dataclasses.field(default_factory=list)  # device copies dropped this step
    prefix_lens: list[int] = dataclasses.field(default_factory=list)  # a prefill's, per request (as `requests`)
    extend_lens: list[int] = dataclasses.field(default_factory=list)
    modelled_ms: float = 0.0  # the step's modelled time (latency_model.py): deterministic where its batch is


def consensus_values(record: StepRecord) -> dict[str, int]:
    """What `--consensus-check` compares across ranks: acks consumed, batch tokens and the tree (its digest's
    first 60 bits)."""
    return {
        "acks_write": record.acks_write,
        "acks_load": record.acks_load,
        "extend_tokens": record.extend_tokens,
        "digest": int(record.digest[:15], 16),
    }


class TraceWriter:
    """One rank's trace file, flushed line by line. A write that fails (a full disk) raises OSError naming the
    file; `close()` then does not raise again for the line it could not write."""

    def __init__(self, file: TextIO, rank: int):
        self.rank, self.path, self.file = rank, file.name, file  # held open for the whole run, closed by close()

    def write(self, record: StepRecord) -> None:
        try:
            self.file.write(json.dumps({"rank": self.rank, **dataclasses.asdict(record)}) + "\n")
            self.file.flush()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()


def trace_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"trace_rank{rank}.jsonl"


def read_trace(out_dir: Path) -> list[dict]:
    """Every rank's steps; a last line cut short (a full disk, a rank killed as it wrote) is not a step."""
    rows = []
    for path in sorted(Path(out_dir).glob("trace_rank*.jsonl")):
        lines = path.read_text().split("\n")
        rows += [json.loads(line) for line in lines[:-1]]  # the last piece: "" after a whole line, or cut short
    return rows


def load_trace(out_dir: Path):
    """Every rank's steps as one DataFrame (columns: rank, step, kind, acks_write, acks_load, digest, ...)."""
    import pandas as pd  # for notebooks: ranks do not load pandas

    return pd.DataFrame(read_trace(out_dir))


def first_divergence(rows: list[dict]) -> dict | None:
    """The first step and quantity at which ranks differ: {step, quantity, values: {rank: value}}."""
    by_step: dict[int, list[dict]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    for step in sorted(by_step):
        ranks = sorted(by_step[step], key=lambda r: r["rank"])
        for quantity in DIVERGENCE_QUANTITIES:
            values = {str(r["rank"]): r[quantity] for r in ranks}
            if len(set(values.values())) > 1:
                return {"step": step, "quantity": quantity, "values": values}
    return None
