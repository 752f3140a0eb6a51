"""Rank layout and process groups. Even one rank is a world: every group exists, of size one.

World rank = pp_rank * (cp * tp) + cp_rank * tp + tp_rank. The lab's `--tp T --cp C` is SGLang's
`--tp-size T*C --attn-cp-size C`: SGLang's TP group spans all T*C ranks of a stage, split into an attention-TP
group (size T, same CP rank) and an attention-CP group (size C, same TP rank); those two are what the cache
and the model use, so the lab builds only them. The PP group links the ranks
that hold the same shard in every stage.

Cache agreement always runs on gloo CPU groups (as SGLang's cache groups do); the model's own traffic runs on
compute groups: gloo on CPU; on CUDA, NCCL where the group's ranks sit on distinct GPUs, and gloo where some share
one (NCCL refuses two ranks on one device), its CUDA tensors staged through host memory (`all_reduce`,
`all_gather`, `isend`, `recv` below: the model and the pipeline call these, never torch's directly).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import RunConfig
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
    compute_backends: dict = field(default_factory=dict)  # "attn_tp" / "attn_cp" / "pp" -> this rank's group's


def local_device(rank: int) -> int:
    """The GPU world rank `rank` runs on: its local rank (torchrun's LOCAL_RANK; else its world rank, every rank
    on this host) modulo the visible GPUs, so that ranks beyond the GPUs share them, round-robin."""
    local = os.environ.get("LOCAL_RANK", "")
    return (int(local) if local.isdigit() else rank) % torch.cuda.device_count()


def placement_words(cfg: RunConfig) -> str | None:
    """Where a world launched on this host runs its ranks and how its compute groups talk, in words (None on
    CPU): said as it starts."""
    p = cfg.parallel
    if cfg.device != "cuda":
        return None
    gpus = torch.cuda.device_count()
    places = [("", local_device(rank)) for rank in range(p.world_size)]
    layout = RankLayout(p.tp, p.cp, p.pp, 0)
    used = {
        kind: sorted({compute_backend(ranks, places, cfg.device) for ranks in rank_lists})
        for kind, rank_lists in layout.group_rank_lists().items()
        if len(rank_lists[0]) > 1
    }
    said = "; ".join(f"{kind} over {' and '.join(b)}" for kind, b in used.items()) or "no compute groups"
    staged = (
        " (gloo: CUDA tensors staged through host memory, as ranks share a GPU)"
        if any("gloo" in b for b in used.values())
        else ""
    )
    return f"{p.world_size} rank(s) on {gpus} GPU(s), round-robin: {said}{staged}"


def compute_backend(ranks: list[int], places: list | None, device: str) -> str:
    """The backend of a compute group of `ranks`, each placed at `places[rank]` (host, GPU): NCCL where they are
    on distinct GPUs, gloo (staged through host memory) where two share one; gloo on CPU."""
    if device != "cuda":
        return "gloo"
    if places is None:
        return "nccl"
    at = [tuple(places[r]) for r in ranks]
    return "nccl" if len(set(at)) == len(at) else "gloo"


def build_groups(layout: RankLayout, cfg: ParallelConfig, device: str = "cpu", places: list | None = None) -> Groups:
    """Create every group (collectively: all ranks call this in the same order). `places`: every rank's (host,
    GPU), which chooses each compute group's backend on `device` (`compute_backend`; None: every rank on a GPU of
    its own)."""
    timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
    mine: dict[str, object] = {}
    backends: dict[str, str] = {}
    for kind, rank_lists in layout.group_rank_lists().items():
        for ranks in rank_lists:
            flavours = [("gloo", kind)]
            if kind in ("attn_tp", "attn_cp", "pp"):
                flavours.append((compute_backend(ranks, places, device), f"{kind}_compute"))
            if kind == "pp":
                flavours.append(("gloo", "pp_control"))
            for backend, name in flavours:
                group = dist.new_group(ranks, backend=backend, timeout=timeout)
                if layout.rank in ranks:
                    mine[name] = group
                    if name.endswith("_compute"):
                        backends[kind] = backend
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
        compute_backends=backends,
    )


# -- the compute groups' traffic: CUDA tensors staged through host memory on a gloo group ------------------


def _staged(group) -> bool:
    return group is not None and dist.get_backend(group) == "gloo"


def all_reduce(tensor: torch.Tensor, group) -> None:
    if tensor.is_cuda and _staged(group):
        host = tensor.cpu()
        dist.all_reduce(host, group=group)
        tensor.copy_(host)
    else:
        dist.all_reduce(tensor, group=group)


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group) -> None:
    if tensor.is_cuda and _staged(group):
        hosts = [torch.empty_like(out, device="cpu") for out in outputs]
        dist.all_gather(hosts, tensor.cpu(), group=group)
        for out, host in zip(outputs, hosts, strict=True):
            out.copy_(host)
    else:
        dist.all_gather(outputs, tensor, group=group)


def isend(tensor: torch.Tensor, dst: int, group) -> tuple[dist.Work, torch.Tensor]:
    """A send, and the tensor that must live until it completes (the host copy, where it is staged)."""
    sent = tensor.cpu() if tensor.is_cuda and _staged(group) else tensor
    return dist.isend(sent, group_dst=dst, group=group), sent


def recv(tensor: torch.Tensor, src: int, group) -> None:
    if tensor.is_cuda and _staged(group):
        host = torch.empty_like(tensor, device="cpu")
        dist.recv(host, group_src=src, group=group)
        tensor.copy_(host)
    else:
        dist.recv(tensor, group_src=src, group=group)


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
