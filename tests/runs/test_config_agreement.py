"""Ranks started by hand or under torchrun parse their own flags: they agree on the whole configuration as they
join the world (`rank.agree_on_config`). Started alike they pass; a rank started with other flags stops every
rank with one message that names each flag that differs and each rank's value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from hicache_lab.entrypoints.launch import join_world, spawn_ranks
from hicache_lab.entrypoints.rank import agree_on_config, meet
from hicache_lab.errors import ConfigError
from hicache_lab.lab.presets import WORKLOAD, config

pytestmark = pytest.mark.spawns


def _join_and_agree(rank: int, size: int, port: int, flags: tuple[str, ...], out: Path) -> None:
    join_world(rank, size, port, 30)
    try:
        agree_on_config(meet(config(WORKLOAD, flags[rank]), out / "run", None))
        said = "agreed"
    except ConfigError as exc:
        said = str(exc)
    (out / f"rank{rank}.txt").write_text(said)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--seed 3", "--seed 3"), "agreed"),
        (
            ("", "--num-layers 2 --no-round-barrier"),
            "ranks were started with different flags: --num-layers (num_layers: 4 on rank 0, 2 on rank 1); "
            "--no-round-barrier (round_barrier: True on rank 0, False on rank 1); start every rank with the same flags",
        ),
    ],
    ids=["alike", "two-flags-differ"],
)
def test_ranks_agree_on_their_flags_or_every_rank_names_each_difference(tmp_path, flags, said):
    assert spawn_ranks(_join_and_agree, 2, (flags, tmp_path), 60) == [0, 0]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == [said, said]
