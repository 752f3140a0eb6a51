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
import multiprocessing
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..distributed.parallel_state import stage_layers
from ..errors import ConfigError
from ..mem_cache.memory_pool import kv_bytes_per_token
from .hooks import resolve
from .rank import run_rank
from .report import print_summary, summarize

GRACE_S = 2.0  # after the first rank fails, how long the others get to report before they are stopped


def _rank_main(cfg: RunConfig, rank: int, port: int, out_dir: Path) -> None:
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        cfg.parallel.world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=cfg.parallel.collective_timeout_s),
    )
    run_rank(cfg, rank, store, out_dir)


def join_world(rank: int, size: int, port: int, timeout_s: float) -> None:
    """This process becomes rank `rank` of a gloo world of `size` ranks that meet at 127.0.0.1:`port`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)


def spawn_ranks(target, size: int, args: tuple, timeout_s: float) -> list[int | None]:
    """Run `target(rank, size, port, *args)` in `size` spawned processes (each may `join_world(rank, size,
    port, ...)`); wait for all, killing any still running after `timeout_s`. Returns their exit codes."""
    ctx = multiprocessing.get_context("spawn")
    (port,) = free_ports(1)
    procs = [ctx.Process(target=target, args=(rank, size, port, *args)) for rank in range(size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
    return [proc.exitcode for proc in procs]


def spawn_world(cfg: RunConfig, out_dir: Path) -> dict[int, int]:
    """Start every rank as a process; once one fails, stop the rest after GRACE_S seconds. Returns the exit
    codes of the ranks that failed first, on their own (not those the launcher stopped)."""
    ctx = multiprocessing.get_context("spawn")
    (port,) = free_ports(1)
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
            c.host_tokens(kv_bytes_per_token(layers, m.num_heads // p.tp, m.head_dim))


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
        for stale in [*out.glob("rank*.json"), *out.glob("trace_rank*.jsonl"), *out.glob("rank*.cache_ops.jsonl")]:
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


def start_mooncake_master() -> tuple[subprocess.Popen, str, str]:
    """Start `mooncake_master` on 127.0.0.1 with its HTTP metadata server; returns (process, master address,
    metadata URL). The caller stops it."""
    import mooncake  # optional dependency: imported only when asked for

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    rpc, http, metrics = free_ports(3)
    process = subprocess.Popen(
        [
            str(binary),
            f"--port={rpc}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not _listening(rpc) and time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with code {process.returncode}")
        time.sleep(0.1)
    return process, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 right now."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
