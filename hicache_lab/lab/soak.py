"""Randomized soak: many small random worlds, each run once per sync mode, counted by outcome.

Every case draws a world (tp 1-2, cp 1-2, pp 1-4, at most `--max-ranks` ranks), a write policy, a page size,
the storage tier on or off (with a prefetch policy, maybe flushing between rounds), virtual or real latency,
a chunked prefill size, an answer length (long answers run out of decode memory: retractions), in a third of
the cases one rank's allocation fault (`--fault alloc-fail:R@N`: its Nth slot allocation for a copy fails), and
a workload seed; the same case then runs once in each mode (`fixed`, `legacy`), as its own
`python -m hicache_lab run` process group with a hard wall-clock limit. A run is counted as

* a **hang** if it outlives the limit (its whole process group is killed),
* a **crash** if any rank raised or ended without a result,
* a **divergence** if ranks consumed different acks, ran different batches or hold different trees,
* an **output mismatch** if a served request's logits or tokens differ from a from-scratch computation.

Results: a CSV with one row per run and a Markdown table per mode, `DIR/soak_{tag}.csv` / `.md`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..config import PREFETCH_POLICIES, SYNC_MODES, WRITE_POLICIES
from .presets import BENCH_RESULTS, WORLD


@dataclass
class Case:
    case: int
    seed: int
    tp: int
    cp: int
    pp: int
    write_policy: str
    page_size: int
    storage: bool
    prefetch_policy: str
    flush: bool
    latency: str
    delay: int  # virtual: max copy delay in steps; real: mean injected delay in ms
    chunk: int  # --chunked-prefill-size (-1: off)
    output_length: int  # 8, or 32: decode memory runs short and requests are retracted
    alloc_fault: str  # "R@N": rank R's Nth slot allocation for a copy fails; "" for none

    @property
    def ranks(self) -> int:
        return self.tp * self.cp * self.pp

    def args(self, mode: str) -> list[str]:
        """The `run` flags of this case: the small world (presets.WORLD) on 4 layers for 3 rounds."""
        args = [
            *WORLD.split(), "--num-layers", "4", "--num-rounds", "3",
            "--tp", str(self.tp), "--cp", str(self.cp), "--pp", str(self.pp), "--sync", mode,
            "--page-size", str(self.page_size), "--hicache-write-policy", self.write_policy,
            "--latency", self.latency, "--seed", str(self.seed), "--collective-timeout", "30",
        ]  # fmt: skip
        delay_flag = "--max-copy-delay-steps" if self.latency == "virtual" else "--injected-delay-ms"
        args += [delay_flag, str(self.delay)]
        args += ["--chunked-prefill-size", str(self.chunk), "--output-length", str(self.output_length)]
        if self.alloc_fault:
            args += ["--fault", f"alloc-fail:{self.alloc_fault}"]
        if self.storage:
            args += ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", self.prefetch_policy]
            args += ["--storage-prefetch-threshold", "16"]
            if self.flush:
                args.append("--flush-cache-between-rounds")
        return args


def draw_cases(runs: int, seed: int, max_ranks: int) -> list[Case]:
    """`runs` random cases, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < runs:
        tp, cp, pp = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 5))
        if tp * cp * pp > max_ranks:
            continue
        latency = str(rng.choice(["virtual", "real"]))
        cases.append(
            Case(
                case=len(cases),
                seed=int(rng.integers(0, 2**31)),
                tp=tp,
                cp=cp,
                pp=pp,
                write_policy=str(rng.choice(WRITE_POLICIES)),
                page_size=int(rng.choice([1, 2, 4])),
                storage=bool(rng.random() < 0.4),
                prefetch_policy=str(rng.choice(PREFETCH_POLICIES)),
                flush=bool(rng.random() < 0.5),
                latency=latency,
                delay=int(rng.integers(1, 4)) if latency == "virtual" else int(rng.integers(0, 3)),
                chunk=int(rng.choice([-1, 16, 48, 4096])),
                output_length=int(rng.choice([8, 32])),
                alloc_fault=f"{rng.integers(0, tp * cp * pp)}@{rng.integers(0, 30)}" if rng.random() < 1 / 3 else "",
            )
        )
    return cases


def run_case(case: Case, mode: str, out_dir: Path, limit_s: float) -> dict:
    """One run in its own process group; killed as a whole past `limit_s`."""
    run_dir = out_dir / f"case{case.case:04d}_{mode}"
    command = [sys.executable, "-m", "hicache_lab", "run", *case.args(mode), "--out", str(run_dir)]
    started = time.monotonic()
    with open(out_dir / f"case{case.case:04d}_{mode}.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=limit_s)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it spawned
            proc.wait()
            hung = True
    row = {**asdict(case), "ranks": case.ranks, "mode": mode, "elapsed_s": round(time.monotonic() - started, 1)}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() and not hung else None
    crashed = not hung and (summary is None or summary["crashed"])
    divergence = summary["first_divergence"] if summary else None
    row.update(
        hung=hung,
        crashed=crashed,
        diverged=bool(divergence),
        mismatched=bool(summary) and summary["outputs_match_reference"] is False,
        first_divergence=f"step {divergence['step']} {divergence['quantity']}" if divergence else "",
        chunks=(summary or {}).get("scheduling", {}).get("chunked_prefills", 0),
        retractions=(summary or {}).get("scheduling", {}).get("retractions", 0),
        error=(summary or {}).get("error") or ("" if summary or hung else f"no summary (exit {proc.returncode})"),
    )
    return row


def summarize_rows(rows: list[dict], modes: list[str]) -> str:
    """The Markdown table: per mode, how many runs ended in each way."""
    lines = [
        "| mode | runs | divergences | crashes | hangs | output mismatches | divergence rate "
        "| runs with chunks | runs with retractions | runs with an allocation fault |",
        "|------|-----:|------------:|--------:|------:|------------------:|----------------:"
        "|-----------------:|----------------------:|------------------------------:|",
    ]
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        counts = [sum(r[k] for r in mine) for k in ("diverged", "crashed", "hung", "mismatched")]
        rate = counts[0] / len(mine) if mine else 0.0
        pressure = [sum(bool(r[k]) for r in mine) for k in ("chunks", "retractions", "alloc_fault")]
        lines.append(
            f"| {mode} | {len(mine)} | {' | '.join(map(str, counts))} | {rate:.1%} | {' | '.join(map(str, pressure))} |"
        )
    return "\n".join(lines)


def add_soak_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=200, help="random cases; each runs once per mode (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case draw (default 0)")
    parser.add_argument("--jobs", type=int, default=1, help="worlds run at once (default 1)")
    parser.add_argument("--modes", nargs="+", default=["fixed", "legacy"], choices=SYNC_MODES)
    parser.add_argument("--max-ranks", type=int, default=8, help="largest world drawn (default 8)")
    parser.add_argument("--limit-s", type=float, default=240, help="wall-clock limit of one run (default 240)")
    parser.add_argument("--out", default="runs/soak", help="run directories and logs (default runs/soak)")
    parser.add_argument("--results", default=str(BENCH_RESULTS), help="where the CSV and table go")
    parser.add_argument("--tag", default="", help="results file name: soak_{tag}.csv (default: runs and seed)")


def cmd_soak(args: argparse.Namespace) -> int:
    out_dir, results = Path(args.out), Path(args.results)
    out_dir.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    tag = args.tag or f"{args.runs}runs_seed{args.seed}"
    cases = draw_cases(args.runs, args.seed, args.max_ranks)
    jobs = [(case, mode) for mode in args.modes for case in cases]  # mode by mode: a cut-short soak still counts
    rows = []
    csv_path, table_path = results / f"soak_{tag}.csv", results / f"soak_{tag}.md"
    command = " ".join(["python -m hicache_lab soak", *sys.argv[2:]])
    with ThreadPoolExecutor(args.jobs) as pool, open(csv_path, "w", newline="") as f:
        writer = None
        futures = [pool.submit(run_case, case, mode, out_dir, args.limit_s) for case, mode in jobs]
        for done, future in enumerate(futures, 1):
            row = future.result()
            rows.append(row)
            writer = writer or csv.DictWriter(f, fieldnames=list(row))
            if done == 1:
                writer.writeheader()
            writer.writerow(row)
            f.flush()
            flags = [k for k in ("diverged", "crashed", "hung", "mismatched") if row[k]]
            world = f"tp{row['tp']} cp{row['cp']} pp{row['pp']}"
            print(f"[{done}/{len(jobs)}] case {row['case']} {row['mode']:<6} {world} {','.join(flags) or 'ok'}")
            table = summarize_rows(rows, args.modes)
            table_path.write_text(f"# Soak: {done} of {len(jobs)} runs\n\n`{command}`\n\n{table}\n")
    print(table)
    fixed = [r for r in rows if r["mode"] == "fixed"]
    return 1 if any(r[k] for r in fixed for k in ("diverged", "crashed", "hung", "mismatched")) else 0
