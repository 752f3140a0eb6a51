"""Class 9, blame and summaries: a rank stopped, killed or out of disk; the summary names the rank that caused
it and why, not the ranks that waited for it. And numbers that must not contradict each other: no round's hit
rate above its infinite-cache bound, with a store filled before the run or a trace replayed without barriers;
a run whose ranks diverged does not exit 0; a flag that can do nothing says so."""

from __future__ import annotations

import json
import resource
import subprocess
from collections.abc import Callable
from pathlib import Path

from .common import SMALL, STORE, WORLD2, R, lines, run_torchrun, signalled
from .judge import Hostile, Outcome, run_cli

STOPPED = "rank 1 never reported: its process was stopped by a signal (state T)"


def _file_size_limit(limit: int, *args: str) -> Callable[[Path], Outcome]:
    """A full disk, without root: the run with RLIMIT_FSIZE at `limit` bytes (Python ignores SIGXFSZ, so a write
    past it fails with EFBIG), set on the launcher as it starts (before it writes) and inherited by its ranks."""

    def during(proc: subprocess.Popen) -> None:
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))

    return lambda scratch: run_cli(scratch, *args, "--out", "out", during=during)


def _within_bound(first: list[str] | None, *args: str) -> Callable[[Path], Outcome]:
    """A run (after a `first` run that fills its store, if any) whose every round must find at most what an
    infinite cache would; without one, `t.jsonl` beside it: a trace of 12 requests sharing a 3-block head."""

    def run(scratch: Path) -> Outcome:
        if first:
            run_cli(scratch, *first, "--out", "first")
        else:  # 4 blocks of 512 tokens each (16 lab tokens), the first 3 shared
            head = {"timestamp": 0, "input_length": 2048, "output_length": 4}
            (scratch / "t.jsonl").write_text(lines(*({**head, "hash_ids": [1, 2, 3, 10 + i]} for i in range(12))))
        outcome = run_cli(scratch, *args, "--out", "out")
        rounds = json.loads((scratch / "out" / "summary.json").read_text())["rounds"]
        if above := [r["round"] for r in rounds if r["hit_rate"] > r["upper_bound_hit_rate"] + 1e-9]:
            return Outcome(None, f"{outcome.output}\nrounds {above}: hit rate above the bound", outcome.leftover)
        return outcome

    return run


TRACE = (
    "--trace-file",
    "t.jsonl",
    "--num-rounds",
    "2",
    "--no-round-barrier",
    "--max-total-tokens",
    "256",
    "--check-outputs",
)


CASES = [
    Hostile(9, "SIGSTOP on rank 1 mid-run", signalled("--collective-timeout", "5", stop="running"), 1, STOPPED),
    Hostile(
        9,
        "SIGSTOP on rank 1 before it joins the world",
        signalled("--collective-timeout", "5", stop="starts"),
        1,
        STOPPED,
    ),
    Hostile(
        9,
        "torchrun, --fault kill-rank:1@10 (torchrun then SIGTERMs rank 0)",
        lambda s: run_torchrun(s, *WORLD2, "--fault", "kill-rank:1@10", "--out", "out"),
        1,
        "crashed (rank 1): rank 1 died (its process is gone) without a result",
    ),
    Hostile(
        9,
        "a full disk (a file-size limit of 8 KiB) under one rank",
        _file_size_limit(8192, *SMALL),
        1,
        "cannot write out/trace_rank0.jsonl: File too large (EFBIG)",
    ),
    Hostile(
        9,
        "a full disk (a file-size limit of 8 KiB) under two ranks",
        _file_size_limit(8192, *WORLD2),
        1,
        "cannot write out/trace_rank",
    ),
    Hostile(
        9,
        "torchrun, SIGSTOP on rank 1 mid-run",
        signalled("--collective-timeout", "5", stop="running", torchrun=True),
        1,
        "rank 1 never reported: its process is stopped by a signal (state T)",
        slow=True,
    ),
    Hostile(
        9,
        "a store filled by one run, read by the same run again: every round within its bound",
        _within_bound(R, *R, "--check-outputs"),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
    Hostile(
        9,
        "a trace of requests sharing a head, replayed at once on two stages: within its bound",
        _within_bound(None, "run", *TRACE, "--pp", "2", "--enable-hierarchical-cache"),
        0,
        "outputs_match_reference: True",
        owns=("out", "t.jsonl"),
        exact=True,
    ),
    Hostile(
        9,
        "a run whose stages diverge (`--disable-fix pp_relay`) though its outputs stay exact",
        lambda scratch: run_cli(scratch, *WORLD2, "--disable-fix", "pp_relay", "--num-rounds", "2", "--out", "out"),
        1,
        "diverged at step",
    ),
    Hostile(
        9,
        "`--max-copy-delay-steps 5` under `--latency real`, where it cannot act",
        lambda scratch: run_cli(scratch, *SMALL, "--latency", "real", "--max-copy-delay-steps", "5", "--out", "out"),
        0,
        "warning: --max-copy-delay-steps 5 does nothing without --latency virtual",
        exact=True,
    ),
]
