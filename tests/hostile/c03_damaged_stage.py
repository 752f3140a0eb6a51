"""Class 3, one stage's damaged page: `--pp 2`, a page that a rank of stage 1 reads is damaged on disk."""

from __future__ import annotations

from .common import STORE, R
from .judge import Hostile, run_cli


def _damaged(policy: str, *flags: str, rank: int = 1, slow: bool = False) -> Hostile:
    """`--pp 2` (and `flags`): rank `rank`, on stage 1, finds its 4th page read damaged on disk."""
    run = [*R, "--pp", "2", "--hicache-storage-prefetch-policy", policy, *flags, "--fault", f"damage-page:{rank}@3"]
    return Hostile(
        3,
        f"damages a page of stage 1's shard before rank {rank} reads it (`--pp 2`, {policy}"
        f"{', ' if flags else ''}{' '.join(flags)})",
        lambda scratch: run_cli(scratch, *run, "--check-outputs", "--out", "out"),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
        slow=slow,
    )


CASES = [  # (best_effort takes a prefetch before it reads anything here: the fault would never fire)
    _damaged("wait_complete"),
    _damaged("timeout", "--latency", "real"),
    _damaged("wait_complete", "--tp", "2", rank=3, slow=True),  # 4 ranks
]
