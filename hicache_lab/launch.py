"""Run a world of ranks: in this process (one rank), as spawned processes on 127.0.0.1, or as one rank
under `torchrun`.

Every rank writes `rank{R}.json` (its result) and `trace_rank{R}.jsonl` (its steps) into the output
directory; `summarize` merges them into `summary.json`. A rank that raises records the error and exits at
once; the launcher then stops the others after a short grace period, so a failed world ends in seconds
instead of waiting for collective timeouts, and the summary names the rank that failed first.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .config import ConfigError, ParallelConfig, RunConfig
from .controller import HiCacheController
from .hiradix import HiRadixCache
from .l3 import StorageTier
from .memory import DeviceKVPool, HostKVPool, PageAllocator
from .model import TinyModel
from .oracle import check_outputs
from .parallel import Groups, RankLayout, build_groups, get_attn_cp_rank_and_size
from .pipeline import StageLoop
from .report import format_table, round_rows, summarize, write_requests
from .scheduler import Scheduler
from .storage import FileStorage, MooncakeStorage, start_mooncake_master, storage_suffix
from .sync import CacheSync
from .sync_impl import install, resolve
from .trace import TraceWriter, trace_path
from .transfer import make_copy_engine
from .workload import Feeder, make_workload

GRACE_S = 2.0  # after the first rank fails, how long the others get to report before they are stopped


def stage_layers(num_layers: int, pp: int, pp_rank: int, partition: tuple[int, ...] = ()) -> range:
    """Contiguous layer ranges: as `partition` says, or earlier stages taking the remainder (4 layers over
    3 stages: 2, 1, 1)."""
    if partition:
        start = sum(partition[:pp_rank])
        return range(start, start + partition[pp_rank])
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


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


def _rank_main(cfg: RunConfig, rank: int, port: int, out_dir: Path) -> None:
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        cfg.parallel.world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=cfg.parallel.collective_timeout_s),
    )
    run_rank(cfg, rank, store, out_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_world(cfg: RunConfig, out_dir: Path) -> dict[int, int]:
    """Start every rank as a process; once one fails, stop the rest after GRACE_S seconds. Returns the exit
    codes of the ranks that failed first, on their own (not those the launcher stopped)."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(cfg, r, port, out_dir), daemon=True)
        for r in range(cfg.parallel.world_size)
    ]
    for proc in procs:
        proc.start()
    failed_at, failed, killed = None, {}, False

    def note_failures() -> None:  # every rank that ended badly before the launcher stopped anyone
        for rank, proc in enumerate(procs):
            if proc.exitcode not in (None, 0) and rank not in failed:
                failed[rank] = proc.exitcode

    while any(proc.is_alive() for proc in procs):
        if not killed:
            note_failures()
            failed_at = failed_at or (time.monotonic() if failed else None)
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S and not killed:
            for proc in procs:
                proc.kill()
            killed = True
        time.sleep(0.05)
    for proc in procs:
        proc.join()
    if not killed:
        note_failures()
    return failed


def preflight(cfg: RunConfig, out_dir: Path | None) -> None:
    """What the config alone cannot check, checked before any rank starts (ConfigError names the flag)."""
    m, c, p = cfg.model, cfg.cache, cfg.parallel
    if p.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this machine has no CUDA device: use --device cpu")
    for path, flag in (
        (out_dir, "--out"),
        (c.storage_dir if c.storage_backend == "file" else None, "--hicache-storage-dir"),
    ):
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"{flag} {path} is a file: give a directory")
    if c.enable_hierarchical_cache:  # sized in bytes, every stage must still hold more than its device pool
        for stage in range(p.pp):
            layers = len(stage_layers(m.num_layers, p.pp, stage, p.pp_layer_partition))
            c.host_tokens(2 * layers * (m.num_heads // p.tp) * m.head_dim * 4)


def run(cfg: RunConfig, out_dir: Path | None = None, verbose: bool = True) -> dict:
    """Run the workload on the whole world; returns (and writes) the merged summary."""
    started = time.perf_counter()
    resolve(cfg.parallel.sync_impls)  # a --sync-impl that cannot load fails here, before any rank starts
    preflight(cfg, out_dir)
    master = None
    if cfg.cache.storage_backend == "mooncake" and not cfg.cache.mooncake_master:
        master, address, url = start_mooncake_master()
        cache = dataclasses.replace(cfg.cache, mooncake_master=address, mooncake_metadata_url=url)
        cfg = dataclasses.replace(cfg, cache=cache)
    try:
        return _run_world(cfg, out_dir, verbose, started)
    finally:
        if master is not None:
            master.terminate()
            master.wait()


def _run_world(cfg: RunConfig, out_dir: Path | None, verbose: bool, started: float) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(out_dir) if out_dir is not None else Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("rank*.json"), *out.glob("trace_rank*.jsonl")]:
            stale.unlink()
        failed = {}
        if cfg.parallel.world_size == 1:
            run_rank(cfg, 0, dist.HashStore(), out)
        else:
            failed = spawn_world(cfg, out)
        summary = summarize(cfg, out, time.perf_counter() - started, failed)
    if verbose:
        print_summary(summary)
    return summary


def run_under_torchrun(cfg: RunConfig, out_dir: Path) -> dict | None:
    """One rank of a world started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT set); rank 0 summarizes."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != cfg.parallel.world_size:
        raise ConfigError(f"torchrun started {world} ranks but --tp x --cp x --pp = {cfg.parallel.world_size}")
    if cfg.cache.storage_backend == "mooncake" and not cfg.cache.mooncake_master:
        raise ConfigError("under torchrun, start mooncake_master yourself and pass --mooncake-master/-metadata-url")
    resolve(cfg.parallel.sync_impls)
    preflight(cfg, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").unlink(missing_ok=True)  # rank 0 counts these to know when all are done
    started = time.perf_counter()
    run_rank(cfg, rank, None, out_dir)  # no store: torch.distributed reads MASTER_ADDR/PORT (env://)
    if rank != 0:
        return None
    deadline = time.monotonic() + cfg.parallel.collective_timeout_s
    while len(list(out_dir.glob("rank*.json"))) < world and time.monotonic() < deadline:
        time.sleep(0.1)
    summary = summarize(cfg, out_dir, time.perf_counter() - started)
    print_summary(summary)
    return summary


def print_summary(summary: dict) -> None:
    print(f"equivalent SGLang flags: {summary['sglang_flags']}")
    print(format_table(summary["rounds"]))
    if summary["diverged"]:
        d = summary["first_divergence"]
        print(f"diverged at step {d['step']} on {d['quantity']}: {d['values']}")
    if summary["crashed"]:
        print(f"crashed (rank {summary['failing_rank']}): {summary['error']}")
    if summary["outputs_match_reference"] is not None:
        print(f"outputs_match_reference: {summary['outputs_match_reference']}")
