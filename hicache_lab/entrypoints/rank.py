"""One rank: its parts wired together (`build_stage`), run start to end, and its result written (`run_rank`)."""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ParallelConfig, RunConfig
from ..distributed.cache_sync import CacheSync
from ..distributed.parallel_state import Groups, RankLayout, build_groups, get_attn_cp_rank_and_size, stage_layers
from ..managers.scheduler import Scheduler
from ..managers.scheduler_pp import StageLoop
from ..managers.step_trace import TraceWriter, trace_path
from ..managers.workload import Feeder, make_workload
from ..mem_cache.cache_controller import HiCacheController
from ..mem_cache.copy_engine import make_copy_engine
from ..mem_cache.hicache_storage import FileStorage, MooncakeStorage, storage_suffix
from ..mem_cache.hiradix_cache import HiRadixCache
from ..mem_cache.memory_pool import DeviceKVPool, PageAllocator
from ..mem_cache.memory_pool_host import HostKVPool
from ..mem_cache.storage_tier import StorageTier
from ..model import TinyModel
from .hooks import install, resolve
from .oracle import check_outputs
from .report import round_rows, write_requests


def host_pool_tokens(cfg: RunConfig, bytes_per_token: int) -> int:
    """Host pool size of this rank. Sized in bytes, stages with fewer layers fit more tokens: the fixed sync
    agrees on the minimum (a symmetric collective is safe here, at start, before the scheduler loop)."""
    tokens = cfg.cache.host_tokens(bytes_per_token)
    if "host_capacity_min" in cfg.parallel.fixes and cfg.parallel.world_size > 1:
        agreed = torch.tensor([tokens])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        tokens = int(agreed.item())
    return tokens


def build_storage_tier(cfg: RunConfig, groups: Groups, layers: range, cache: HiRadixCache, directory: Path):
    """The file backend under this rank's keys, and the tier moving pages between it and the host pool."""
    layout, fixes = groups.layout, cfg.parallel.fixes
    cp_rank, cp_size = get_attn_cp_rank_and_size(groups)
    suffix = storage_suffix(
        cfg.model.seed, layout.tp_rank, layout.tp, layers, None if "storage_keys" in fixes else cp_rank
    )
    c = cfg.cache
    if c.storage_backend == "mooncake":
        page_bytes = 4 * torch.Size(cache.controller.host_pool.page_shape(c.page_size)).numel()
        backend = MooncakeStorage(c.mooncake_master, c.mooncake_metadata_url, suffix, page_bytes)
    else:
        backend = FileStorage(directory, suffix)
        if not c.storage_dir and cp_rank == 0:  # a run-local store starts empty (one writer per key set)
            backend.clear()
    controller = cache.controller
    return StorageTier(
        cfg.cache,
        backend,
        cache.tree,
        controller.host_pool,
        controller.host_alloc,
        cache.sync,
        cp_rank,
        cp_size,
        cfg.workload.seed,
        layout.rank,
    )


def build_stage(cfg: RunConfig, groups: Groups, out_dir: Path) -> StageLoop:
    """Model, pools, copy engine, cache, scheduler and event loop of one rank."""
    m, c, p, layout = cfg.model, cfg.cache, cfg.parallel, groups.layout
    layers = stage_layers(m.num_layers, p.pp, layout.pp_rank, p.pp_layer_partition)
    model = TinyModel(
        m,
        p.device,
        layers,
        layout.tp_rank,
        layout.tp,
        groups.attn_tp_compute,
        groups.attn_cp_compute if get_attn_cp_rank_and_size(groups)[1] > 1 else None,
    )
    pool = DeviceKVPool(c.max_total_tokens, len(layers), m.num_heads // layout.tp, m.head_dim, p.device)
    device_alloc = PageAllocator(c.max_total_tokens, c.page_size, "device pool")
    engine = make_copy_engine(
        c.latency, p.device, c.max_copy_delay_steps, c.injected_delay_ms, cfg.workload.seed, layout.rank
    )
    controller = None
    if c.enable_hierarchical_cache:
        host_tokens = host_pool_tokens(cfg, pool.bytes_per_token)
        host_pool = HostKVPool(host_tokens, pool, c.host_layout)
        host_alloc = PageAllocator(host_tokens, c.page_size, "host pool")
        controller = HiCacheController(
            pool,
            device_alloc,
            host_pool,
            host_alloc,
            engine,
            cfg.check_outputs,
            c.copy_checksum,
            bad_write(p, layout.rank),
        )
    sync = CacheSync(p.sync, groups, p.fixes, storage=c.storage_backend != "none")
    cache = HiRadixCache(c, device_alloc, sync, controller)
    install(resolve(p.sync_impls), sync, cache)
    if c.storage_backend != "none":
        cache.storage = build_storage_tier(cfg, groups, layers, cache, Path(c.storage_dir or out_dir / "storage"))
    scheduler = Scheduler(cache, engine, cfg.workload.max_running_requests, c.skip_load_wait)
    feeder = Feeder(make_workload(cfg.workload, m.vocab_size), c.page_size) if layout.pp_rank == 0 else None
    trace = TraceWriter(trace_path(out_dir, layout.rank), layout.rank)
    loop = StageLoop(groups, scheduler, model, pool, feeder, trace, p.consensus_check)
    loop.die_at = fault_here(p, "kill-rank", layout.rank)
    return loop


def bad_write(p: ParallelConfig, rank: int) -> tuple[str, int] | None:
    """(kind, N) when `--fault` tears or misplaces this rank's Nth host write."""
    kind = p.fault.partition(":")[0]
    n = fault_here(p, kind, rank) if kind in ("tear-copy", "misplace-copy") else None
    return None if n is None else (kind, n)


def fault_here(p: ParallelConfig, kind: str, rank: int) -> int | None:
    """N of `--fault KIND:RANK@N` when it names this kind of fault and this rank."""
    if not p.fault:
        return None
    fault_kind, fault_rank, n = p.fault_spec
    return n if (fault_kind, fault_rank) == (kind, rank) else None


def run_rank(cfg: RunConfig, rank: int, store: dist.Store | None, out_dir: Path) -> dict:
    """One rank, start to end: returns (and writes) its result; never raises for a failure of the run."""
    p = cfg.parallel
    if p.device == "cpu":
        torch.set_num_threads(1)  # tensors are tiny and ranks share the cores: more threads only spin
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=p.collective_timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=p.world_size, timeout=timeout)
    layout = RankLayout(p.tp, p.cp, p.pp, rank)
    result = {
        "rank": rank,
        "tp_rank": layout.tp_rank,
        "cp_rank": layout.cp_rank,
        "pp_rank": layout.pp_rank,
        "completed": False,
        "crashed": False,
        "error": None,
        "rounds": [],
    }
    loop = None
    try:
        loop = build_stage(cfg, build_groups(layout, p), out_dir)
        loop.run()
        result["completed"] = True
    except Exception as exc:  # a crash is a result: it goes in the summary
        error = f"{type(exc).__name__}: {exc}"
        if "Timed out" in str(exc):
            error = f"collective timed out after --collective-timeout {p.collective_timeout_s:g} s ({error})"
        result.update(crashed=True, error=error, traceback=traceback.format_exc(), failed_at=time.time())
    if loop is not None:
        loop.trace.close()
        loop.scheduler.engine.close()
        storage = loop.scheduler.cache.storage
        if storage is not None:
            result["storage"] = {**storage.summary(), **storage.backend.stats}
            storage.close()
        answered = [r for r in loop.reqs if r.finished]
        result["rounds"] = round_rows(answered, loop.records)
        if rank == 0:
            write_requests(out_dir, loop.reqs)
        if cfg.check_outputs and result["completed"]:
            is_reference_rank = layout.pp_rank == p.pp - 1 and layout.tp_rank == 0 and layout.cp_rank == 0
            copies = loop.scheduler.cache.controller.copy_check if loop.scheduler.cache.enabled else None
            result["oracle"] = check_outputs(cfg.model, p.device, answered if is_reference_rank else [], copies)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["crashed"] and p.world_size > 1:
        os._exit(1)  # peers may be blocked on us: leave now, the launcher stops them
    dist.destroy_process_group()
    return result


