"""Class 7, ranks started with different flags: a world started by hand, as torchrun would, each rank with
flags of its own; every flag that differs is named, with each rank's value."""

from __future__ import annotations

import threading
from pathlib import Path

from ....entrypoints.launch import free_ports
from ...presets import WORLD
from .judge import Hostile, Outcome, run_cli

TWO_STAGES = ["run", *WORLD.split(), "--pp", "2", "--num-rounds", "3", "--collective-timeout", "20"]


def _by_hand(*per_rank: tuple[str, ...]):
    """A world whose ranks are started by hand, as torchrun would: each its own `python -m hicache_lab` with
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, TWO_STAGES and `--out out` plus flags of its own. The
    outcome's code is the one every rank gave (None where they differ); its output, every rank's in turn."""

    def run(scratch: Path) -> Outcome:
        (port,) = free_ports(1)
        outcomes: dict[int, Outcome] = {}

        def rank(r: int) -> None:
            env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(len(per_rank))}
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            outcomes[r] = run_cli(scratch, *TWO_STAGES, "--out", "out", *per_rank[r], env=env)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(per_rank))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        codes = {o.code for o in outcomes.values()}
        output = "".join(f"--- rank {r}, exit code {o.code}:\n{o.output}" for r, o in sorted(outcomes.items()))
        leftover = [p for o in outcomes.values() for p in o.leftover]
        return Outcome(codes.pop() if len(codes) == 1 else None, output, leftover)

    return run


CASES = [
    Hostile(
        7,
        "two ranks started by hand (RANK, WORLD_SIZE, MASTER_ADDR/PORT) with the same flags",
        _by_hand((), ()),
        0,
        "outputs_match_reference: True",
        exact=True,
    ),
    Hostile(
        7,
        "two ranks by hand, rank 1 given `--num-layers 2` beside rank 0's 3",
        _by_hand((), ("--num-layers", "2")),
        2,
        "ranks were started with different flags: --num-layers (num_layers: 3 on rank 0, 2 on rank 1)",
    ),
    Hostile(
        7,
        "two ranks by hand, rank 0 with `--no-round-barrier`, rank 1 with `--sync legacy`: each flag is named",
        _by_hand(("--no-round-barrier",), ("--sync", "legacy")),
        2,
        "--no-round-barrier (round_barrier: False on rank 0, True on rank 1); --sync (sync: 'fixed' on rank 0, "
        "'legacy' on rank 1)",
    ),
    Hostile(
        7,
        "two ranks by hand, rank 1 writing to another `--out`",
        _by_hand((), ("--out", "elsewhere")),
        2,
        "--out (out: ",
        owns=("out", "elsewhere"),
    ),
]
