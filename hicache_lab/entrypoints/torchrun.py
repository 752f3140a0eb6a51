"""One rank of a world that `torchrun` started (RANK, WORLD_SIZE, MASTER_ADDR/PORT set; `started_by_torchrun`
checks them): rank 0 owns the output directory and writes the summary, even when a rank died; what each rank that
left no result was doing, or that it completed where rank 0 cannot see its result (an --out not shared)."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from functools import cache, partial
from pathlib import Path

import torch.distributed as dist

from ..config import RunConfig
from ..errors import ConfigError
from .binders import Binder, check_all
from .ending import Interrupted, SignalGuard, cpu_seconds, die_with_parent, process_state
from .launch import GRACE_S, exit_code, join_and_run
from .outdir import Claim
from .preflight import preflight
from .report import WorldEnd, print_summary, read_results, summarize

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
WORKING_BOUND = 10  # rank 0 waits at most this many collective timeouts for a peer that still works
VISIBLE_S = 3.0  # how long a result a rank said it wrote gets to appear in rank 0's --out


def started_by_torchrun(environ: dict[str, str]) -> bool:
    """Whether this process is one rank of a world torchrun started: RANK < WORLD_SIZE (> 1), MASTER_ADDR and
    MASTER_PORT set. With neither RANK nor WORLD_SIZE it runs a world of its own. Anything between (an `export`
    left in a shell, a typo) is a ConfigError naming the variables: guessing either way would hang or mislead."""
    if "RANK" not in environ and "WORLD_SIZE" not in environ:
        return False

    def integer(name: str) -> int | None:
        try:
            return int(environ[name])
        except (KeyError, ValueError):
            return None

    rank, world, port = integer("RANK"), integer("WORLD_SIZE"), integer("MASTER_PORT")
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        problem = f"{'WORLD_SIZE' if 'RANK' in environ else 'RANK'} is missing"
    elif world is None or world < 1:
        problem = "WORLD_SIZE is not a positive integer"
    elif rank is None or not 0 <= rank < world:
        problem = f"RANK is not an integer in 0..{world - 1} (WORLD_SIZE {world})"
    elif world > 1 and not environ.get("MASTER_ADDR"):
        problem = "MASTER_ADDR is missing"
    elif world > 1 and (port is None or not 1 <= port <= 65535):
        problem = "MASTER_PORT is not a port number"
    else:
        return world > 1
    seen = ", ".join(f"{name}={environ[name]!r}" for name in TORCHRUN_VARIABLES if name in environ)
    raise ConfigError(
        f"the environment says this is a torchrun rank, but {problem} ({seen}): to run on its own, "
        f"unset {' '.join(TORCHRUN_VARIABLES)}; or start it under torchrun"
    )


def run_under_torchrun(cfg: RunConfig, out_dir: Path, binders: tuple[Binder, ...] = ()) -> dict | None:
    """One rank of a world started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT set); rank 0 owns the output
    directory and summarizes, even when a rank died (torchrun then SIGTERMs the others: rank 0 writes the summary
    before it leaves); the others write only once they met rank 0 (its run id)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != cfg.parallel.world_size:
        raise ConfigError(f"torchrun started {world} ranks but --tp x --cp x --pp = {cfg.parallel.world_size}")
    if cfg.cache.storage_backend == "mooncake" and not cfg.cache.mooncake_master:
        raise ConfigError("under torchrun, start mooncake_master yourself and pass --mooncake-master/-metadata-url")
    die_with_parent(os.getppid())  # torchrun's agent: no rank outlives it
    check_all(cfg, binders)
    preflight(cfg, out_dir)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        run_id = stack.enter_context(Claim(out_dir)).run_id if rank == 0 else None
        guard = stack.enter_context(SignalGuard())
        if rank == 0:
            end = WorldEnd(run_id)
            guard.owe(lambda name: print_summary(summarize(cfg, out_dir, time.perf_counter() - started, end)))
        joined = cache(partial(env_store, rank, world, cfg.parallel.collective_timeout_s))  # one store, kept
        result = join_and_run(cfg, rank, joined, out_dir, run_id, guard, binders)
        if rank != 0:
            if not result["completed"]:  # peers may be blocked on us: torchrun stops them
                os._exit(exit_code(result.get("interrupted"), ok=False))
            with contextlib.suppress(RuntimeError, OSError):  # tell rank 0 (its store gone: nobody to tell)
                joined().set(_key("completed", rank), socket.gethostname())
            return None
        store = joined() if result["completed"] else None  # where the others said they completed
        cut_short = _await_peers(cfg, out_dir, result, end, store)
        end.interrupted = result.get("interrupted") or cut_short
        guard.finish()
        _name_missing(cfg, out_dir, result, end, store)
        summary = summarize(cfg, out_dir, time.perf_counter() - started, end)
    print_summary(summary)
    return summary


def env_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The world's store at MASTER_ADDR:MASTER_PORT: torchrun's agent serves it (TORCHELASTIC_USE_AGENT_STORE),
    else rank 0 does (ranks started by hand). A port another world holds, or a RANK another process has joined
    with, is a ConfigError naming both: else the second rank 0 fails on a bare EADDRINUSE, and a rank that found
    another world's store waits in it until that world ends."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    serves = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world, is_master=serves, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        if serves and "EADDRINUSE" in str(exc):
            raise ConfigError(
                f"MASTER_PORT {port} is taken: another world, or a second process with RANK=0, listens there; give "
                "each world its own MASTER_PORT and each rank its own RANK"
            ) from None
        raise
    if store.add(f"hicache_lab/{_key('joined', rank)}", 1) > 1:
        raise ConfigError(
            f"RANK={rank} has joined the world at {host}:{port} already: another world uses this MASTER_PORT, or "
            f"two processes were given RANK={rank}; give each world its own MASTER_PORT and each rank its own RANK"
        )
    return dist.PrefixStore("hicache_lab", store)


def _key(name: str, rank: int) -> str:
    """A rank's key `name` in the world's store, this attempt's (torchrun's restart count)."""
    return f"{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/rank{rank}"


def _completed_on(store: dist.Store | None, rank: int) -> str | None:
    """The host on which `rank` said (over the world's store) that it completed, if it did."""
    with contextlib.suppress(RuntimeError, OSError):  # the store is gone: its host's torchrun ended
        if store is not None and store.check([_key("completed", rank)]):
            return store.get(_key("completed", rank)).decode()
    return None


def _await_peers(cfg: RunConfig, out_dir: Path, result: dict, end: WorldEnd, store: dist.Store | None) -> str | None:
    """Rank 0 waits for the other results: when it completed, up to the collective timeout, and beyond it for as
    long as a rank that has not reported still works on this host (its CPU time grew within the last collective
    timeout: a loaded machine, the reference outputs computed) up to WORKING_BOUND timeouts; GRACE_S when it
    waited for a peer (the cause may still report) or was interrupted (so were they); not at all when it failed
    on its own; VISIBLE_S once every rank missing said over the store that it completed. Returns the signal that
    cut the wait short (torchrun stops the world once a rank died), if any."""
    p = cfg.parallel
    wait = p.collective_timeout_s if result["completed"] else GRACE_S
    wait = 0 if result["crashed"] and not result.get("waited") else wait
    started = time.monotonic()
    working = _Working(result, p.collective_timeout_s) if result["completed"] else None
    said = None  # when every rank missing had said it completed
    try:
        while (missing := _missing(cfg, out_dir, end)) and time.monotonic() - started < wait * WORKING_BOUND:
            if all(_completed_on(store, rank) for rank in missing):
                said = said or time.monotonic()
            waited = time.monotonic() - started >= wait and not (working and working.any(missing))
            if waited or (said and time.monotonic() - said >= VISIBLE_S):
                break
            time.sleep(0.1)
    except Interrupted as exc:
        return exc.name
    return None


def _missing(cfg: RunConfig, out_dir: Path, end: WorldEnd) -> list[int]:
    reported = {r["rank"] for r in read_results(out_dir, end, cfg.parallel.world_size)}
    return [rank for rank in range(cfg.parallel.world_size) if rank not in reported]


class _Working:
    """Which ranks on this host still work: their CPU time grew within the last `window_s` seconds."""

    def __init__(self, result: dict, window_s: float):
        self.pids = {int(rank): pid for rank, pid in result.get("peers", {}).items()}
        self.window_s, self.seen = window_s, {}  # rank -> (CPU seconds, when they last grew)

    def any(self, ranks: list[int]) -> bool:
        now, working = time.monotonic(), False
        for rank in ranks:
            cpu = cpu_seconds(self.pids[rank]) if rank in self.pids else None
            if cpu is None or process_state(self.pids[rank]).startswith(("stopped", "a zombie", "dead")):
                continue
            last, since = self.seen.get(rank, (cpu, now))
            self.seen[rank] = (cpu, now if cpu > last else since)
            working |= now - self.seen[rank][1] < self.window_s
        return working


def _name_missing(cfg: RunConfig, out_dir: Path, result: dict, end: WorldEnd, store: dist.Store | None) -> None:
    """What each rank that left no result is doing now: it completed (it said so over the store) where rank 0
    cannot see its result; else its process on this host (from the ranks' meeting) gone (it died: the cause), or
    still there (stuck)."""
    reported = {r["rank"] for r in read_results(out_dir, end, cfg.parallel.world_size)}
    for rank in (rank for rank in range(cfg.parallel.world_size) if rank not in reported):
        pid, host = result.get("peers", {}).get(str(rank)), _completed_on(store, rank)
        if host:
            end.stopped[rank] = (
                f"its result is not visible here in {out_dir}, though it completed on host {host}: is --out one "
                "directory shared by every node?"
            )
        elif pid is None:
            end.stopped[rank] = "no process of it known here (on another host, or it never met rank 0)"
        elif (state := process_state(pid)) == "gone" or state.startswith("a zombie"):
            end.failed[rank] = "died (its process is gone)"
        else:
            end.stopped[rank] = f"its process is {state}"
