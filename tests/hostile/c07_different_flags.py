"""Class 7, ranks started with different flags: a world started by hand, as torchrun would, each rank with
flags of its own; every flag that differs is named, with each rank's value. And processes that join another
world: a second RANK=0 on a port a world holds, a rank of another world on that world's MASTER_PORT."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from hicache_lab.entrypoints.mooncake_master import free_ports
from hicache_lab.lab.presets import WORLD

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


def _intruders(scratch: Path) -> Outcome:
    """A world of two started by hand, and while it runs, another world's rank 0 and rank 1 on its MASTER_PORT:
    each intruder is refused, naming the port or the rank; the world ends exact."""
    (port,) = free_ports(1)
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    world: dict[int, Outcome] = {}
    long = (
        *TWO_STAGES,
        "--num-rounds",
        "40",
        "--max-total-tokens",
        "4096",
        "--out",
        "out",
    )  # the intruders start meanwhile
    threads = [
        threading.Thread(target=lambda r=r: world.update({r: run_cli(scratch, *long, env=env | {"RANK": str(r)})}))
        for r in (0, 1)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120  # both ranks joined: each traces once it has met the other
    while len(list((scratch / "out").glob("trace_rank*.jsonl"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    intruders: list[Outcome] = [Outcome(None, ""), Outcome(None, "")]

    def intrude(r: int) -> None:
        intruders[r] = run_cli(scratch, *TWO_STAGES, "--out", f"other{r}", env=env | {"RANK": str(r)})

    for thread in (more := [threading.Thread(target=intrude, args=(r,)) for r in (0, 1)]):
        thread.start()
    for thread in threads + more:
        thread.join()
    outcomes = [world[0], world[1], *intruders]
    output = "".join(f"--- exit code {o.code}:\n{o.output}" for o in outcomes)
    refused = [o.code for o in intruders] == [2, 2] and {world[0].code, world[1].code} == {0}
    refused &= f"MASTER_PORT {port} is taken" in intruders[0].output
    return Outcome(2 if refused else None, output, [p for o in outcomes for p in o.leftover])


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
    Hostile(
        7,
        "another world's RANK=0 and RANK=1 started on the MASTER_PORT of a world running",
        _intruders,
        2,
        "RANK=1 has joined the world at 127.0.0.1:",
        owns=("out", "other0", "other1"),
        exact=True,
    ),
]
