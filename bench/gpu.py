"""What the GPU benchmarks share: where results go and the machine they were measured on."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def save(name: str, rows: list[dict]) -> None:
    """bench/results/NAME.json: the machine (GPU, torch, platform) and one entry per measurement."""
    machine = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "platform": platform.platform()}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
