"""What the benchmarks share: where results go, how a CSV is written, the machine a result was measured on, and
an assertion that `python -O` keeps."""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def check(ok: bool, message: str) -> None:
    """An assertion that `python -O` keeps: a broken comparison must fail loudly."""
    if not ok:
        raise AssertionError(message)


def ratio(a: float, b: float) -> float:
    """a / b, NaN where b is 0 (a measurement that did not happen)."""
    return a / b if b else float("nan")


def write_csv(path: Path, rows: list[dict], fields: list[str] | None = None) -> None:
    """One row per dict, columns `fields` (default: the first row's keys, in order)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields or list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def machine_info(**extra) -> dict:
    """What a result was measured with: Python, torch, the platform and its CPU count, then `extra`, what the
    benchmark's figures also depend on. The key names are those of the results already recorded: keep them, so
    that a new result compares with an old one."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **extra,
    }


def code_state() -> dict:
    """The commit measured and the package's files changed since it (a result depends on them too)."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=RESULTS.parents[1], timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout if done.returncode == 0 else ""

    code = ("hicache_lab", "bench", ":(exclude)bench/results")
    changed = [line[3:] for line in git("status", "--porcelain", "--", *code).splitlines()]
    return {"commit": git("log", "-1", "--format=%h").strip() or None, "changed": changed}


def usable_cpus() -> int | None:
    """CPUs this process may run on (its affinity), None where the platform does not say."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def write_json(path: Path, result: dict) -> None:
    """`result` as indented JSON at `path` (its folder made where missing), and a line that says so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def save(name: str, rows: list[dict]) -> None:
    """bench/results/NAME.json: the machine (`machine_info` and the GPU) and one entry per measurement."""
    write_json(RESULTS / f"{name}.json", {"machine": machine_info(gpu=torch.cuda.get_device_name()), "rows": rows})
