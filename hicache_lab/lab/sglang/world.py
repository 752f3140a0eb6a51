"""Where one rank's SGLang cache sits in a lab world: its process groups, its stage and its storage backend, in
the terms sglang 0.5.23's cache takes them (`CacheInitParams`, `ServerArgs`, `get_parallel()`).

The lab's `--tp T --cp C` is SGLang's `--tp-size T*C --attn-cp-size C` (distributed/parallel_state.py): SGLang's
cache is given the stage's whole TP group (T*C ranks, built here: the lab builds only its two halves), its
attention-CP and attention-TP groups and the PP group, all gloo, as SGLang's scheduler gives their CPU groups.
Every rank builds the world in the same order (`dist.new_group` is collective over the whole world).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from ...config import RunConfig
from ...distributed.parallel_state import Groups


@dataclass
class SGLangWorld:
    """One rank's place, and what of it SGLang reads: `cache_params` (CacheInitParams' fields), `server_args`
    (ServerArgs' fields: the storage backend), `publish` (the ranks `get_parallel()` answers)."""

    groups: dict = field(repr=False)  # CacheInitParams' group fields
    tp_rank: int  # SGLang's TP rank: cp_rank * T + tp_rank of the lab's
    tp_size: int  # T * C
    cp_rank: int
    cp_size: int
    pp_rank: int
    pp_size: int
    storage: dict = field(default_factory=dict)  # ServerArgs' storage fields

    def cache_params(self) -> dict:
        return {
            **self.groups,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "attn_cp_rank": self.cp_rank,
            "attn_cp_size": self.cp_size,
        }

    def server_args(self) -> dict:
        return dict(self.storage)

    def publish(self) -> None:
        """What SGLang's launcher records for the process: its storage keys are named by these ranks."""
        from sglang.srt.runtime_context import get_parallel

        attn_tp = self.tp_size // self.cp_size
        get_parallel().override_permanently(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            attn_tp_rank=self.tp_rank % attn_tp,
            attn_tp_size=attn_tp,
            attn_cp_rank=self.cp_rank,
            attn_cp_size=self.cp_size,
            moe_tp_size=self.tp_size,
        )


def _stage_tp_group(groups: Groups):
    """The TP group of this rank's stage (all T*C of its ranks), created on every rank, stage by stage."""
    layout = groups.layout
    per_stage = layout.tp * layout.cp
    mine = None
    for stage in range(layout.pp):
        ranks = list(range(stage * per_stage, (stage + 1) * per_stage))
        group = dist.new_group(ranks, backend="gloo", timeout=groups.timeout)
        if stage == layout.pp_rank:
            mine = group
    return mine


def storage_args(cfg: RunConfig, directory: Path) -> dict:
    """ServerArgs' L3 fields for the lab's storage flags: SGLang's own file backend in `directory` (its keys are
    its own: `{hash}_{model}_{tp_rank}_{tp_size}[_{pp_size}_{pp_rank}][_cp{r}_{C}]`), the lab's prefetch policy,
    threshold and timeouts."""
    c = cfg.cache
    if c.storage_backend == "none":
        return {}
    extra = {
        "prefetch_threshold": c.prefetch_threshold,
        "prefetch_timeout_base": c.prefetch_timeout_base_s,
        "prefetch_timeout_per_ki_token": c.prefetch_timeout_per_ki_token_s,
    }
    return {
        "hicache_storage_backend": c.storage_backend,
        "hicache_storage_prefetch_policy": c.prefetch_policy,
        "hicache_storage_backend_extra_config": json.dumps(extra),
        "file_storage_path": str(directory),
    }


def sglang_world(cfg: RunConfig, groups: Groups, storage_dir: Path) -> SGLangWorld:
    """This rank's place (collective: every rank calls it, in the same order)."""
    layout = groups.layout
    tp_group = _stage_tp_group(groups)
    return SGLangWorld(
        groups={
            "tp_cache_group": tp_group,
            "attn_cp_cache_group": groups.attn_cp_group,
            "attn_tp_cache_group": groups.attn_tp_group,
            "pp_cache_group": groups.pp_cache_group,
        },
        tp_rank=layout.cp_rank * layout.tp + layout.tp_rank,
        tp_size=layout.tp * layout.cp,
        cp_rank=layout.cp_rank,
        cp_size=layout.cp,
        pp_rank=layout.pp_rank,
        pp_size=layout.pp,
        storage=storage_args(cfg, storage_dir),
    )
