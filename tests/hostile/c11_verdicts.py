"""Class 11, verdicts that could be fooled: an interrupted `exercise` never passes a wrong answer, `compare` of
two runs that went wrong alike never says a bare "equal", a deliberate change that cannot act is refused, and a
student's module that ends its process at import is named, never an exit 0."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from hicache_lab.lab.presets import WORLD
from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, sglang_version

from .common import OUT, USER_CODE, user_code
from .judge import Hostile, Outcome, run_cli

WRONG = "teaching/mistakes/pp_sync.py:two_stages_only"  # right at PP = 2, wrong from PP = 3: the second world


def _sglang_missing() -> str | None:
    return None if sglang_version() == SGLANG_VERSION else f"compare runs sglang {SGLANG_VERSION}'s cache"


def _exercise_interrupted(scratch: Path) -> Outcome:
    """Ctrl-C (SIGINT) as the check's second world starts, the one that would show the mistake: the check is
    interrupted (130) and never passes. Where the world showed the mistake before the signal came (it takes a
    second; a busy machine can be slower to send it), FAILED is the right verdict too, and counts as 130."""
    answer = Path(__file__).resolve().parents[2] / WRONG.partition(":")[0]

    def during(proc: subprocess.Popen) -> None:
        marker = scratch / "out" / "world1" / ".hicache_lab_run"
        while proc.poll() is None and not marker.exists():
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)

    outcome = run_cli(scratch, "exercise", "--pp-sync", f"{answer}:two_stages_only", *OUT, during=during)
    if "PASSED" in outcome.output:
        return Outcome(None, outcome.output, outcome.leftover)
    if outcome.code == 1 and outcome.output.rstrip().endswith("FAILED"):  # the world showed the mistake before
        return Outcome(128 + signal.SIGINT, outcome.output, outcome.leftover)  # the signal came (a busy machine)
    return outcome


CASES = [
    Hostile(
        11,
        "Ctrl-C during `exercise`, as the world that would show the wrong answer starts",
        _exercise_interrupted,
        128 + signal.SIGINT,
        "PP=3: ",  # "could not judge: interrupted by SIGINT ...", or the mistake it showed before the signal
        needs=lambda: None if (Path(__file__).resolve().parents[2] / "teaching").is_dir() else "no teaching/ here",
    ),
    Hostile(
        11,
        "`compare` of a world whose two runs diverge alike (`--disable-fix pp_relay`)",
        user_code("compare", *WORLD.split(), "--pp", "2", "--num-rounds", "3", "--disable-fix", "pp_relay"),
        1,
        "both diverged alike at step 3 on acks_write, parting the same ranks: the same bug in both",
        owns=USER_CODE,
        needs=_sglang_missing,
    ),
    Hostile(
        11,
        "`compare` of two stages whose host pools are sized in bytes (`--hicache-size`): SGLang's own agreement on "
        "the host capacity (#29258) must run, not be blamed for the crash it prevents",
        user_code("compare", *WORLD.split(), "--pp", "2", "--hicache-size", "0.0004"),
        0,
        "equal: ",
        owns=USER_CODE,
        needs=_sglang_missing,
    ),
    Hostile(
        11,
        "`compare --mutant relay_skips_stage` on two stages, where the mutant changes nothing",
        user_code("compare", *WORLD.split(), "--pp", "2", "--mutant", "relay_skips_stage"),
        2,
        "--mutant relay_skips_stage changes nothing in this world",
        owns=USER_CODE,
        needs=_sglang_missing,
    ),
    Hostile(
        11,
        "`exercise` with a module that calls os._exit(0) as it is imported",
        user_code("exercise", "--pp-sync", "user_sync_top.py:f", top="import os\nos._exit(0)"),
        2,
        "importing it ended the process (exit code 0) before the import returned",
        owns=USER_CODE,
    ),
]
