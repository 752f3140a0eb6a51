"""Run a world of ranks. Today a world of one: the same groups, sync call sites and summary as many ranks."""

from __future__ import annotations

import dataclasses
import datetime
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .config import RunConfig
from .controller import HiCacheController
from .hiradix import HiRadixCache
from .memory import DeviceKVPool, HostKVPool, PageAllocator
from .model import TinyModel
from .oracle import check_outputs
from .parallel import Groups, RankLayout, build_groups
from .report import format_table, round_rows, sglang_flags, write_outputs
from .scheduler import Scheduler
from .sync import CacheSync
from .trace import TraceWriter, trace_path
from .transfer import make_copy_engine
from .workload import MultiTurnWorkload, run_workload


def build_scheduler(cfg: RunConfig, groups: Groups, trace: TraceWriter | None = None) -> Scheduler:
    """Pools, copy engine, cache, model and scheduler of one rank."""
    m, c, layout = cfg.model, cfg.cache, groups.layout
    device = cfg.parallel.device
    model = TinyModel(m, device, tp_rank=layout.tp_rank, tp_size=layout.tp, tp_group=groups.tp_compute)
    pool = DeviceKVPool(c.max_total_tokens, len(model.layers), m.num_heads // layout.tp, m.head_dim, device)
    device_alloc = PageAllocator(c.max_total_tokens, c.page_size, "device pool")
    engine = make_copy_engine(
        c.latency, device, c.max_copy_delay_steps, c.injected_delay_ms, cfg.workload.seed, layout.rank
    )
    controller = None
    if c.enable_hierarchical_cache:
        host_tokens = c.host_tokens(pool.bytes_per_token)
        host_pool = HostKVPool(host_tokens, pool, c.host_layout)
        host_alloc = PageAllocator(host_tokens, c.page_size, "host pool")
        controller = HiCacheController(pool, device_alloc, host_pool, host_alloc, engine, cfg.check_outputs)
    cache = HiRadixCache(c, device_alloc, CacheSync(cfg.parallel.sync, groups), controller)
    return Scheduler(model, pool, cache, engine, cfg.workload.max_running_requests, c.skip_load_wait, trace)


def run(cfg: RunConfig, out_dir: Path | None = None, verbose: bool = True) -> dict:
    """Run the whole workload on a world of one rank; returns (and writes) the summary."""
    started = time.perf_counter()
    p = cfg.parallel
    if p.device == "cpu":
        torch.set_num_threads(1)  # tensors are tiny and ranks share the cores: more threads only spin
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=p.collective_timeout_s),
    )
    summary = {
        "config": dataclasses.asdict(cfg),
        "sglang_flags": sglang_flags(cfg),
        "completed": False,
        "crashed": False,
        "error": None,
        "rounds": [],
        "outputs_match_reference": None,
    }
    reqs, scheduler = [], None
    trace = TraceWriter(trace_path(Path(out_dir), 0), rank=0) if out_dir is not None else None
    try:
        scheduler = build_scheduler(cfg, build_groups(RankLayout(p.tp, p.cp, p.pp, 0), p), trace)
        cache = scheduler.cache

        def between_rounds() -> None:  # the scheduler is idle: check the cache, free last round's sends
            cache.check_integrity(scheduler.held_by_requests())
            cache.sync.drain_async_work()

        reqs = run_workload(scheduler, MultiTurnWorkload(cfg.workload, cfg.model.vocab_size), between_rounds)
        summary["completed"] = True
        summary["rounds"] = round_rows(reqs, scheduler.records)
        if cfg.check_outputs:
            copies = cache.controller.copy_check if cache.enabled else None
            summary["oracle"] = check_outputs(cfg.model, p.device, reqs, copies)
            summary["outputs_match_reference"] = summary["oracle"]["ok"]
    except Exception as exc:  # a crash is a result: it goes in the summary
        summary.update(crashed=True, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    finally:
        if scheduler is not None:
            scheduler.engine.close()
        if trace is not None:
            trace.close()
        dist.destroy_process_group()
    summary["elapsed_s"] = time.perf_counter() - started
    if out_dir is not None:
        write_outputs(Path(out_dir), summary, reqs)
    if verbose:
        print(f"equivalent SGLang flags: {summary['sglang_flags']}")
        print(format_table(summary["rounds"]))
        if summary["crashed"]:
            print(f"crashed: {summary['error']}")
        if cfg.check_outputs:
            print(f"outputs_match_reference: {summary['outputs_match_reference']}")
    return summary
