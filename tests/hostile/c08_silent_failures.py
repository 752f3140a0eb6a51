"""Class 8, failures that exit 0: user code that calls sys.exit(0), and faults that never fire; each must make
the run fail, naming it. And `conform` on a recording it cannot vouch for: cut short, from another version of
the lab, or made under a fault (its differences are the fault's)."""

from __future__ import annotations

import json
from pathlib import Path

from hicache_lab.lab.presets import WORKLOAD, WORLD
from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, sglang_version

from .common import ONE_RANK, USER_CODE, cli, user_code
from .judge import Hostile, Outcome, run_cli

NEVER_FIRES = ["run", *WORLD.split(), "--num-rounds", "3"]
L1_ONLY = ["run", *WORKLOAD.split(), "--num-rounds", "3", "--check-outputs"]  # no host tier: no host writes

RECORDED = ["run", *WORKLOAD.split(), "--enable-hierarchical-cache", "--num-rounds", "3", "--record-cache-ops"]


def _recorded(change, *flags: str):
    """A case that records a run's cache operations into `out/`, changes its rank 0 file (`change(lines)` returns
    the new lines), then runs `conform out`."""

    def run(scratch: Path) -> Outcome:
        if (first := run_cli(scratch, *RECORDED, *flags, "--out", "out")).code not in (0, 1):
            return first
        path = scratch / "out" / "rank0.cache_ops.jsonl"
        path.write_text("".join(change(path.read_text().splitlines(keepends=True))))
        return run_cli(scratch, "conform", "out")

    return run


def _newer_config(lines: list[str]) -> list[str]:
    config = json.loads(lines[0])
    config["cache"]["eviction_policy"] = "lru"  # a field a newer lab (or a newer SGLang) might add
    return [json.dumps(config) + "\n", *lines[1:]]


def _sglang_missing() -> str | None:
    return None if sglang_version() == SGLANG_VERSION else f"conform replays through sglang {SGLANG_VERSION}"


CASES = [
    Hostile(
        8,
        "`--sync-impl writing_check=...` that calls sys.exit(0), one rank (in a process of its own, as any plug-in)",
        user_code(*ONE_RANK, "--sync-impl", "writing_check=user_sync:leave"),
        1,
        "--sync-impl writing_check=user_sync:leave called sys.exit(0): it must return, or raise an exception",
        owns=USER_CODE,
    ),
    Hostile(
        8,
        "`--sync-impl pp_sync=...` that calls sys.exit(0) on stage 1 of two",
        user_code(*ONE_RANK, "--pp", "2", "--sync-impl", "pp_sync=user_sync:leave_on_stage_1"),
        1,
        "crashed (rank 1): SyncImplError: --sync-impl pp_sync=user_sync:leave_on_stage_1 called sys.exit(0)",
        owns=USER_CODE,
    ),
    Hostile(
        8,
        "a `--sync-impl` module that calls sys.exit(0) as it is imported",
        user_code(*ONE_RANK, "--sync-impl", "pp_sync=user_sync_top:f", top="sys.exit(0)"),
        2,
        "cannot import 'user_sync_top': its import called sys.exit(0)",
        owns=USER_CODE,
    ),
    Hostile(
        8,
        "`--fault alloc-fail:0@100000`: far more allocations than the run makes",
        cli(*NEVER_FIRES, "--fault", "alloc-fail:0@100000"),
        1,
        "--fault alloc-fail:0@100000 never fired: rank 0 made only ",
    ),
    Hostile(
        8,
        "`--fault kill-rank:1@99999` on two stages: the run ends before that iteration",
        cli(*NEVER_FIRES, "--pp", "2", "--fault", "kill-rank:1@99999"),
        1,
        "--fault kill-rank:1@99999 never fired: rank 1 began only ",
    ),
    Hostile(
        8,
        "`--fault tear-copy:0@0` on a run without the host tier (it makes no host writes)",
        cli(*L1_ONLY, "--fault", "tear-copy:0@0"),
        1,
        "--fault tear-copy:0@0 never fired: rank 0 made no host writes",
    ),
    Hostile(
        8,
        "`--skip-load-wait` on a device pool the conversations never overflow (nothing is loaded back)",
        cli(*NEVER_FIRES, "--max-total-tokens", "4096", "--skip-load-wait"),
        1,
        "--skip-load-wait never fired: rank 0 ran no batches that read loaded KV",
    ),
    Hostile(
        8,
        "`conform` on a recording whose last 40 operations were cut off",
        _recorded(lambda lines: lines[:-40]),
        2,
        "without its end line (its run was killed, or the file was cut)",
    ),
    Hostile(
        8,
        "`conform` on a recording whose configuration has a cache field this lab does not know",
        _recorded(_newer_config),
        2,
        "recorded by another version of the lab (cache fields unknown here: eviction_policy)",
    ),
    Hostile(
        8,
        "`conform` on a run recorded with `--fault alloc-fail:0@5`",
        _recorded(lambda lines: lines, "--fault", "alloc-fail:0@5"),
        1,
        "the run was recorded with --fault alloc-fail:0@5",
        needs=_sglang_missing,
    ),
]
