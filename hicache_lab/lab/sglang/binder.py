"""`--cache-impl sglang`, bound into a run (entrypoints/binders.py): every rank builds sglang 0.5.23's own cache
(rank_cache.py) in its place in the world (world.py), with the seed's bugs put back where the run's sync mode
lacks their fixes (reverts.py). What SGLang's cache cannot be asked in a lab run is refused before any rank
starts, each with its reason.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ...config import CacheConfig, RunConfig
from ...distributed.cache_sync import CacheSync
from ...entrypoints.binders import Binder
from ...errors import ConfigError
from ...mem_cache.build import KVShape
from ...mem_cache.copy_engine import make_copy_engine
from . import reverts
from .cpu import prepare_imports
from .rank_cache import SGLangRankCache
from .world import sglang_world

DEFAULTS = CacheConfig()  # a lab-only knob set to anything else would do nothing in SGLang's cache: refused


def refusals(cfg: RunConfig) -> list[str]:
    """Why SGLang's cache cannot run `cfg`: each a sentence that says what to change."""
    c, p = cfg.cache, cfg.parallel
    named = set(p.enable_fixes) | set(p.disable_fixes)
    checks = (
        (p.device == "cpu", "--device cuda: sglang's CUDA kernels are not installed beside the lab; use --device cpu"),
        (p.sync != "off", "--sync off: SGLang always agrees; use --sync legacy (its code before the fixes) or fixed"),
        (c.storage_backend != "mooncake", "--hicache-storage-backend mooncake: SGLang's file backend only, for now"),
        (not p.fault and not c.skip_load_wait, "--fault / --skip-load-wait inject into the lab's cache: drop them"),
        (
            c.storage_writers == "every-rank",
            "--hicache-storage-writers one is the lab's: SGLang's file backend writes from every rank (MHA KV)",
        ),
        (
            c.load_back_threshold == DEFAULTS.load_back_threshold,
            "--load-back-threshold is the lab's knob: SGLang's is fixed at 10 (init_hicache); drop it",
        ),
        (
            c.prefetch_timeout_steps == DEFAULTS.prefetch_timeout_steps,
            "--storage-prefetch-timeout-steps is the lab's virtual deadline: SGLang's `timeout` waits in seconds "
            "(--prefetch-timeout-base, --prefetch-timeout-per-ki-token)",
        ),
        (not c.copy_checksum, "--copy-checksum checks the lab's copies: SGLang's are checked by --check-outputs"),
        (not p.sync_impls, "--sync-impl replaces the lab's agreement: SGLang's is its own"),
        (not cfg.record_cache_ops, "--record-cache-ops records the lab's cache for `conform`: use `compare`"),
        (
            not named & set(reverts.NO_SGLANG_SITE),
            f"--enable-fix/--disable-fix {', '.join(sorted(named & set(reverts.NO_SGLANG_SITE)))}: sglang 0.5.23 has "
            f"no site for it to revert (lab/sglang/reverts.py); SGLang's cache does what 0.5.23 does",
        ),
    )
    return [reason for ok, reason in checks if not ok]


class SGLangCacheBinder(Binder):
    fields = ("cache_impl",)

    def check(self, cfg: RunConfig) -> None:
        if cfg.cache_impl != "sglang":
            return
        try:
            prepare_imports()
        except RuntimeError as exc:
            raise ConfigError(f"--cache-impl sglang: {exc}") from None
        reasons = refusals(cfg)
        if reasons:
            raise ConfigError("--cache-impl sglang cannot run this: " + "; ".join(reasons))

    def build_cache(self, cfg: RunConfig, sync: CacheSync, kv: KVShape, storage_dir: Path):
        if cfg.cache_impl != "sglang":
            return None
        c, layout = cfg.cache, sync.groups.layout
        world = sglang_world(cfg, sync.groups, storage_dir)
        clock = make_copy_engine(
            c.latency, kv.device, c.max_copy_delay_steps, c.injected_delay_ms, seed=cfg.workload.seed, rank=layout.rank
        )
        undone = reverts.reverts_for(cfg.parallel.fixes)
        with reverts.applied(undone, lambda: {"UnifiedRadixCache": cache.cache, "HiCacheController": cache.controller}):
            cache = SGLangRankCache(c, c.host_tokens(kv.bytes_per_token), clock, kv, world)
        self.replaced = reverts.described(undone)
        if c.storage_backend != "none" and not c.storage_dir:
            if layout.rank == 0:
                cache.controller.storage_backend.clear()  # a run-local store starts empty, as the lab's
            dist.barrier()  # before any rank writes to it
        return cache.pool, cache

    def bind(self, cfg: RunConfig, parts, out_dir: Path):
        if cfg.cache_impl != "sglang":
            return None
        observe_relay(parts.sync, parts.cache.cache)
        replaced = self.replaced
        return lambda: {"cache_impl": "sglang", "sglang_reverts": replaced}


def observe_relay(sync: CacheSync, sglang) -> None:
    """The step trace counts relay sends in the lab's `CacheSync.work_list` (StageLoop): point it at SGLang's
    own, the same list (SGLang drains it in place). Observation only: nothing is decided here."""
    sync.work_list = sglang.work_list


SGLANG_CACHE = SGLangCacheBinder()
