"""`--cache-impl sglang`, bound into a run (entrypoints/binders.py): every rank builds sglang 0.5.23's own cache
(rank_cache.py) in its place in the world (world.py), with the seed's bugs put back where the run's sync mode
lacks their fixes (reverts.py). What SGLang's cache cannot be asked in a lab run is refused before any rank
starts, each with its reason.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import torch.distributed as dist

from ...config import CacheConfig, RunConfig
from ...distributed.cache_sync import CacheSync
from ...entrypoints.binders import Binder
from ...errors import ConfigError, require
from ...mem_cache.build import KVShape
from ...mem_cache.copy_engine import make_copy_engine
from . import releases, reverts
from .cpu import prepare_imports
from .hiradix import HiRadixRankCache
from .rank_cache import SGLangRankCache
from .world import sglang_world

DEFAULTS = CacheConfig()  # a lab-only knob set to anything else would do nothing in SGLang's cache: refused


def refusals(cfg: RunConfig) -> list[str]:
    """Why SGLang's cache cannot run `cfg`: each a sentence that says what to change."""
    c, p = cfg.cache, cfg.parallel
    named = set(p.enable_fixes) | set(p.disable_fixes)
    checks = (
        (
            cfg.device == "cpu",
            "--device cuda: sglang's CUDA kernels are not installed beside the lab; use --device cpu",
        ),
        (p.sync != "off", "--sync off: SGLang always agrees; use --sync legacy (its code before the fixes) or fixed"),
        (c.storage_backend != "mooncake", "--hicache-storage-backend mooncake: SGLang's file backend only, for now"),
        (
            not cfg.lab.fault and not cfg.lab.skip_load_wait,
            "--fault / --skip-load-wait inject into the lab's cache: drop them",
        ),
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
        (not cfg.lab.sync_impls, "--sync-impl replaces the lab's agreement: SGLang's is its own"),
        (not cfg.lab.record_cache_ops, "--record-cache-ops records the lab's cache for `conform`: use `compare`"),
        (
            not named & set(reverts.NO_SGLANG_SITE),
            f"--enable-fix/--disable-fix {', '.join(sorted(named & set(reverts.NO_SGLANG_SITE)))}: sglang 0.5.23 has "
            f"no site for it to revert (lab/sglang/reverts.py); SGLang's cache does what 0.5.23 does",
        ),
    )
    return [reason for ok, reason in checks if not ok]


def release_refusals(cfg: RunConfig, version: str) -> list[str]:
    """Why release `version` cannot run `cfg` (0.5.23's refusals, and what the adapter of its generation does not
    bridge): each a sentence that says what to change."""
    c, p = cfg.cache, cfg.parallel
    hiradix = releases.RELEASES[version].generation == "hiradix"
    checks = (
        (
            p.sync == "fixed" and not p.enable_fixes and not p.disable_fixes,
            f"--sync / --enable-fix / --disable-fix switch the lab's agreement: sglang {version} agrees as its own "
            "code does; drop them",
        ),
        (
            c.storage_backend == "none" or not hiradix,
            f"--hicache-storage-backend: sglang {version}'s storage flow (prefetch revokes, host slots held from "
            "issue) is not bridged by the lab's adapter of its API; run L3 worlds on sglang==0.5.22 or sglang",
        ),
        (
            c.hicache_size_gb == 0 or not hiradix,
            f"--hicache-size: sglang {version} sizes its host pool per stage from bytes; give --hicache-ratio",
        ),
    )
    return [reason for ok, reason in checks if not ok] + [r for r in refusals(cfg) if not r.startswith("--sync off")]


SPECIAL_FILES = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_file(directory: str) -> tuple[str, str] | None:
    """The first file in `directory` (or a link in it to one) that is not a regular file or a directory, and
    what it is; None if there is none (or no directory). Entries the directory listing says are regular files or
    directories cost no stat."""
    try:
        entries = os.scandir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False) or entry.is_dir(follow_symlinks=False):
                continue
            try:
                mode = os.stat(entry.path).st_mode  # a link: what it names
            except OSError:
                continue  # a dangling link: opening it fails at once
            kind = next((name for test, name in SPECIAL_FILES if test(mode)), None)
            if kind is not None:
                return entry.path, kind
    return None


def refuse_special_files(cfg: RunConfig) -> None:
    """SGLang's file backend opens a page's file with a blocking open(), whatever the file is: a FIFO under a
    page's name blocks its reading thread forever (the run never ends and ignores SIGTERM). Refused before any
    rank starts, at the first special file of the store (the lab's own backend reads such a file as a miss)."""
    c = cfg.cache
    if c.storage_backend != "file" or not c.storage_dir:
        return
    found = special_file(c.storage_dir)
    if found is not None:
        path, kind = found
        raise ConfigError(
            f"--cache-impl sglang: {path} in --hicache-storage-dir is {kind}, and SGLang's file backend would block "
            "forever opening it: remove it, or choose another --hicache-storage-dir"
        )


class SGLangCacheBinder(Binder):
    fields = ("cache_impl", "dp_attention")

    def check(self, cfg: RunConfig) -> None:
        require(
            cfg.lab.cache_impl in ("lab", "sglang") or bool(re.fullmatch(r"sglang==\d+\.\d+\.\d+", cfg.lab.cache_impl)),
            f"unknown --cache-impl {cfg.lab.cache_impl!r}: use lab, sglang, or sglang==X for an SGLang release",
        )
        if cfg.lab.cache_impl == "lab":
            return
        try:
            version = releases.parse(cfg.lab.cache_impl)
            if version == releases.REFERENCE:
                prepare_imports()
            elif reason := releases.missing(version):
                raise RuntimeError(reason)
        except (ValueError, RuntimeError) as exc:
            raise ConfigError(f"--cache-impl {cfg.lab.cache_impl}: {exc}") from None
        reasons = refusals(cfg) if version == releases.REFERENCE else release_refusals(cfg, version)
        if reasons:
            raise ConfigError(f"--cache-impl {cfg.lab.cache_impl} cannot run this: " + "; ".join(reasons))
        refuse_special_files(cfg)

    def build_cache(self, cfg: RunConfig, sync: CacheSync, kv: KVShape, storage_dir: Path):
        if cfg.lab.cache_impl == "lab":
            return None
        c, layout, version = cfg.cache, sync.groups.layout, releases.parse(cfg.lab.cache_impl)
        world = sglang_world(cfg, sync.groups, storage_dir)
        clock = make_copy_engine(
            c.latency, kv.device, c.max_copy_delay_steps, c.injected_delay_ms, seed=cfg.workload.seed, rank=layout.rank
        )
        # the lab's count, which SGLang's own sizing must reach (world.host_pool_args): checked as it is built
        host_tokens = sync.agree_host_capacity(c.host_tokens(kv.bytes_per_token)) if c.enable_hierarchical_cache else 0
        undone = reverts.reverts_for(cfg.parallel.fixes) if version == releases.REFERENCE else []
        if releases.RELEASES[version].generation == "hiradix":
            cache = HiRadixRankCache.for_release(version)(c, host_tokens, clock, kv, world)
        else:
            adapter = SGLangRankCache if version == releases.REFERENCE else SGLangRankCache.for_release(version)
            with reverts.applied(
                undone, lambda: {"UnifiedRadixCache": cache.cache, "HiCacheController": cache.controller}
            ):
                cache = adapter(c, host_tokens, clock, kv, world)
        self.host_tokens = cache.host_tokens
        self.replaced = reverts.described(undone)
        if c.storage_backend != "none" and not c.storage_dir:
            if layout.rank == 0:
                cache.controller.storage_backend.clear()  # a run-local store starts empty, as the lab's
            dist.barrier()  # before any rank writes to it
        return cache.pool, cache

    def runs_unbounded_code(self, cfg: RunConfig) -> bool:
        return cfg.lab.cache_impl != "lab"  # SGLang's storage threads and collectives: a rank of its own, watched

    def bind(self, cfg: RunConfig, parts, out_dir: Path):
        if cfg.lab.cache_impl == "lab":
            return None
        observe_relay(parts.sync, parts.cache.cache)
        impl, replaced, host_tokens = cfg.lab.cache_impl, self.replaced, self.host_tokens
        return lambda: {"cache_impl": impl, "sglang_reverts": replaced, "sglang_host_tokens": host_tokens}


def observe_relay(sync: CacheSync, sglang) -> None:
    """The step trace counts relay sends in the lab's `CacheSync.work_list` (StageLoop): point it at SGLang's
    own, the same list (SGLang drains it in place; releases before the relay have none). Observation only."""
    sync.work_list = getattr(sglang, "work_list", [])


SGLANG_CACHE = SGLangCacheBinder()
