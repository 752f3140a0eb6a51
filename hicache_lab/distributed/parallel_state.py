"""Rank layout and process groups. Even one rank is a world: every group exists, of size one.

World rank = pp_rank * (cp * tp) + cp_rank * tp + tp_rank. The lab's `--tp T --cp C` is SGLang's
`--tp-size T*C --attn-cp-size C`: SGLang's TP group spans all T*C ranks of a stage, split into an attention-TP
group (size T, same CP rank) and an attention-CP group (size C, same TP rank); those two are what the cache
and the model use, so the lab builds only them. The PP group links the ranks
that hold the same shard in every stage.

Cache agreement always runs on gloo CPU groups (as SGLang's cache groups do); the model's own traffic runs on
compute groups (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from ..parallel_config import ParallelConfig


@dataclass(frozen=True)
class RankLayout:
    tp: int
    cp: int
    pp: int
    rank: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp % self.cp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp)

    def rank_of(self, tp_rank: int, cp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.cp * self.tp + cp_rank * self.tp + tp_rank

    def group_rank_lists(self) -> dict[str, list[list[int]]]:
        """Every group of every kind, each a rank list, in one order that all ranks share."""
        tp, cp, pp = self.tp, self.cp, self.pp
        r = self.rank_of
        return {
            "attn_tp": [[r(t, c, p) for t in range(tp)] for p in range(pp) for c in range(cp)],
            "attn_cp": [[r(t, c, p) for c in range(cp)] for p in range(pp) for t in range(tp)],
            "pp": [[r(t, c, p) for p in range(pp)] for c in range(cp) for t in range(tp)],
        }


@dataclass
class Groups:
    """The groups one rank belongs to. Cache groups are gloo; `*_compute` carry model traffic."""

    layout: RankLayout
    timeout: datetime.timedelta  # of every collective, from --collective-timeout
    attn_tp_group: object
    attn_cp_group: object
    pp_cache_group: object
    attn_tp_compute: object  # heads are split over attention-TP; their outputs all-reduced here
    attn_cp_compute: object
    pp_compute: object
    pp_control: object  # gloo: requests, hidden-state shapes and sampled tokens between stages


def build_groups(layout: RankLayout, cfg: ParallelConfig) -> Groups:
    """Create every group (collectively: all ranks call this in the same order)."""
    timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
    compute_backend = "nccl" if cfg.device == "cuda" else "gloo"
    mine: dict[str, object] = {}
    for kind, rank_lists in layout.group_rank_lists().items():
        flavours = [("gloo", kind)]
        if kind in ("attn_tp", "attn_cp", "pp"):
            flavours.append((compute_backend, f"{kind}_compute"))
        if kind == "pp":
            flavours.append(("gloo", "pp_control"))
        for backend, name in flavours:
            for ranks in rank_lists:
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                if layout.rank in ranks:
                    mine[name] = group
    return Groups(
        layout,
        timeout,
        attn_tp_group=mine["attn_tp"],
        attn_cp_group=mine["attn_cp"],
        pp_cache_group=mine["pp"],
        attn_tp_compute=mine["attn_tp_compute"],
        attn_cp_compute=mine["attn_cp_compute"],
        pp_compute=mine["pp_compute"],
        pp_control=mine["pp_control"],
    )


def group_rank_and_size(group) -> tuple[int, int]:
    """(rank, size) within `group`; (0, 1) for no group."""
    if group is None:
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def get_attn_cp_rank_and_size(groups: Groups) -> tuple[int, int]:
    """SGLang's name for it: this rank's attention-CP rank and the CP size, (0, 1) without CP."""
    return group_rank_and_size(groups.attn_cp_group)


def stage_layers(num_layers: int, pp: int, pp_rank: int, partition: tuple[int, ...] = ()) -> range:
    """Contiguous layer ranges: as `partition` says, or the last stages taking the remainder, one layer each
    (4 layers over 3 stages: 1, 1, 2), as SGLang's `get_pp_indices`."""
    if partition:
        start = sum(partition[:pp_rank])
        return range(start, start + partition[pp_rank])
    base, extra = divmod(num_layers, pp)
    plain = pp - extra  # the first stages, without an extra layer
    start = pp_rank * base + max(0, pp_rank - plain)
    return range(start, start + base + (pp_rank >= plain))
