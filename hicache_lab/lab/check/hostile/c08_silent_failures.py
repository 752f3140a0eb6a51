"""Class 8, failures that exit 0: user code that calls sys.exit(0), and faults that never fire; each must make
the run fail, naming it."""

from __future__ import annotations

from ...presets import WORKLOAD, WORLD
from .common import ONE_RANK, USER_CODE, cli, user_code
from .judge import Hostile

NEVER_FIRES = ["run", *WORLD.split(), "--num-rounds", "3"]
L1_ONLY = ["run", *WORKLOAD.split(), "--num-rounds", "3", "--check-outputs"]  # no host tier: no host writes

CASES = [
    Hostile(
        8,
        "`--sync-impl writing_check=...` that calls sys.exit(0), one rank (it runs in the launcher's process)",
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
]
