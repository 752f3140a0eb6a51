"""Where one rank's SGLang cache sits in a lab world: its process groups, its stage, its model's name and its
storage backend, in the terms sglang 0.5.23's cache takes them (`CacheInitParams`, `ServerArgs`, `get_parallel()`).

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

from ...config import CacheConfig, ModelConfig, RunConfig
from ...distributed.parallel_state import Groups, group_rank_and_size
from ...mem_cache.build import KVShape
from ...mem_cache.hicache_storage import model_fingerprint


def served_model_name(model: ModelConfig) -> str:
    """The name SGLang gives its storage backend for the model (`get_serving().served_model_name`, which SGLang
    defaults to the model's path): its file keys are `{hash}_{name}_{tp_rank}_{tp_size}…` ('/' becomes '-'). It
    is the lab's model identity, the fingerprint of every field of the model that changes a page's bytes and the
    dtype (`hicache_storage.model_fingerprint`, the `m{fp}` of the lab's own keys): two models on one store never
    read each other's pages."""
    return f"hicache_lab/m{model_fingerprint(model)}"


@dataclass(frozen=True)
class PPGroup:
    """The PP group as SGLang's `GroupCoordinator` shows it where its host pool is sized
    (`get_parallel().pp_group`: `sync_fixed_hicache_size` reads `world_size` and all-reduces over `cpu_group`).
    Its `cpu_group` is the lab's gloo PP cache group, the one the cache is given too, as SGLang's scheduler gives
    its cache `pp_group.cpu_group`."""

    cpu_group: object
    world_size: int
    rank_in_group: int


@dataclass
class SGLangWorld:
    """One rank's place, and what of it SGLang reads: `cache_params` (CacheInitParams' fields), `server_args`
    (ServerArgs' fields: the model's name, the storage backend), `publish` (the ranks and the PP group
    `get_parallel()` answers)."""

    groups: dict = field(repr=False)  # CacheInitParams' group fields
    tp_rank: int  # SGLang's TP rank: cp_rank * T + tp_rank of the lab's
    tp_size: int  # T * C
    cp_rank: int
    cp_size: int
    pp_rank: int
    pp_size: int
    model_name: str = ""  # ServerArgs' served_model_name
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
        return {"served_model_name": self.model_name, **self.storage}

    def publish(self) -> None:
        """What SGLang's launcher records for the process: its storage keys are named by these ranks, and its
        host pool, sized in bytes, agrees with the other stages over this PP group."""
        from sglang.srt.runtime_context import get_parallel

        attn_tp = self.tp_size // self.cp_size
        rank_in_group, width = group_rank_and_size(self.groups["pp_cache_group"])
        get_parallel().override_permanently(
            pp_group=PPGroup(self.groups["pp_cache_group"], width, rank_in_group),
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
    if cfg.lab.dp_attention:  # SGLang's scheduler: `attn_tp_cpu_group if enable_dp_attention else tp_cpu_group`
        tp_group = groups.attn_tp_group
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
        model_name=served_model_name(cfg.model),
        storage=storage_args(cfg, storage_dir),
    )


def host_pool_args(cfg: CacheConfig, host_tokens: int, shape: KVShape, world: SGLangWorld | None) -> dict:
    """ServerArgs' host pool size, for a pool of exactly `host_tokens` tokens (the lab's). SGLang sizes its pool as
    `int(size_gb * 1e9 // bytes per token)` or `int(device tokens * ratio)` tokens, then adds a padding page past
    the last whole page (`HostKVCache.__init__`); the lab aligns down (docs/fidelity.md, H3). So a world sized in
    bytes (`--hicache-size`) gives SGLang the GB less one page of this stage's bytes (half a byte over, against
    rounding): SGLang sizes the pool itself and its stages agree on the smallest (`sync_fixed_hicache_size`, MIN
    over the PP group), the count the lab's stages agree on. Otherwise (a ratio, or the one-rank replay, which
    has no PP group) the ratio that gives `host_tokens`."""
    if not cfg.enable_hierarchical_cache:
        return {"hicache_ratio": 2.0, "hicache_size": 0}
    ps = cfg.page_size
    if cfg.hicache_size_gb > 0 and world is not None:
        size_bytes = int(cfg.hicache_size_gb * 1e9) - ps * shape.bytes_per_token
        return {"hicache_ratio": cfg.hicache_ratio, "hicache_size": (size_bytes + 0.5) / 1e9}
    return {"hicache_ratio": (host_tokens - ps) / cfg.max_total_tokens + 1e-9, "hicache_size": 0}
