"""Where a run came from, for its `summary.json`: the command that started it, the commit of the checkout the lab
runs from ("not a checkout" otherwise: an installed package), the versions of Python, torch, sglang and the lab,
the host and its processor (`machine`: what a figure's caption names), the date (UTC) and the seeds. Nothing here
can fail a run: what cannot be found is said so."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from . import __version__
from .config import RunConfig

PACKAGE = Path(__file__).resolve().parent
GIT_TIMEOUT_S = 2.0


def provenance(cfg: RunConfig) -> dict:
    """The run's provenance, as `summary.json` holds it (`load_runs` makes each key a column)."""
    commit, dirty = _commit()
    return {
        "command": command_line(sys.argv),
        "commit": commit,
        "dirty": dirty,  # uncommitted changes to tracked files; None where there is no checkout
        "python": platform.python_version(),
        "torch": _installed("torch"),
        "sglang": _installed("sglang"),
        "hicache_lab": __version__,
        "host": platform.node(),
        "machine": machine(cfg.device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seed": cfg.workload.seed,
        "model_seed": cfg.model.seed,
    }


def command_line(argv: list[str]) -> str:
    """`argv` as a shell would take it, the package's own `__main__.py` as `python -m hicache_lab` and a script
    (the Python API's) as `python SCRIPT`."""
    if not argv or not argv[0]:
        return "python (no script: an interactive session)"
    head = "python -m hicache_lab" if Path(argv[0]).resolve() == PACKAGE / "__main__.py" else f"python {argv[0]}"
    return " ".join([head, *map(shlex.quote, argv[1:])])


def machine(device: str = "cpu") -> str:
    """The processor a run computes on, in words: under CUDA the GPU's model (nvidia-smi's name: no CUDA context
    is made for it), else the CPU's model and how many this process may use."""
    if device == "cuda":
        try:
            names = _output("nvidia-smi", "--query-gpu=name", "--format=csv,noheader").splitlines()
            return ", ".join(dict.fromkeys(name.strip() for name in names if name.strip())) or "a CUDA GPU"
        except (OSError, subprocess.SubprocessError):
            return "a CUDA GPU (nvidia-smi did not name it)"
    model = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.partition(":")[2].strip() for line in lines if line.startswith("model name")), "")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model or platform.processor() or platform.machine() or 'a CPU'}, {cpus} CPUs"


def _commit() -> tuple[str, bool | None]:
    """(HEAD's commit, whether tracked files changed) of the checkout whose root holds the package."""
    try:
        found = _output("git", "rev-parse", "--show-toplevel", "HEAD").split()
        if len(found) != 2 or Path(found[0]).resolve() != PACKAGE.parent:  # an install inside another checkout
            return "not a checkout", None
        return found[1], bool(_output("git", "status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):  # no git, not a repository, a git that hangs
        return "not a checkout", None


def _output(*command: str) -> str:
    return subprocess.run(
        command, cwd=PACKAGE.parent, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=True
    ).stdout


def _installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
