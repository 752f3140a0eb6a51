"""Run a world of ranks: in this process (one rank running only the lab's code), as spawned processes on
127.0.0.1 that the launcher watches (watch.py), or as one rank under `torchrun`.

Every rank writes `rank{R}.json` (its result, with the run's id) and `trace_rank{R}.jsonl` (its steps) into the
output directory, which the run owns while it runs (outdir.py); `summarize` merges this run's results into
`summary.json`. A rank that raises records the error and exits at once; the launcher then stops the others after
a short grace period, so a failed world ends in seconds instead of waiting for collective timeouts, and the
summary names the cause (report.blame): a rank that waited for a peer is a symptom, the peer that never reported
is named with what its process was doing. No process outlives the launcher (ending.py): ranks and the
`mooncake_master` it starts die with it, and SIGINT/SIGTERM end the world with a summary that says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from ..config import RunConfig
from ..distributed.parallel_state import RankLayout, placement_words
from ..errors import ConfigError
from .binders import Binder, check_all
from .ending import Adopted, Interrupted, SignalGuard, die_with_parent, exited, process_state
from .mooncake_master import start_mooncake_master, stop_master
from .outdir import Claim, OutputError, cannot_write
from .preflight import idle_flags, preflight
from .rank import new_result, record_crash, record_interrupt, run_rank, write_result
from .report import WorldEnd, print_summary, summarize
from .watch import Watch, release_stopped_server, silence_bound, start_beating

GRACE_S = 2.0  # after the first rank fails (or a signal), how long the others get to report before they are stopped


def join_and_run(
    cfg: RunConfig,
    rank: int,
    store: Callable[[], dist.Store | None],
    out_dir: Path,
    run_id: str | None,
    guard,
    binders: tuple[Binder, ...],
) -> dict:
    """`run_rank` on the store `store()` makes; a rank that could not join the world (a peer that never came: a
    timeout, a symptom) or was interrupted while joining still leaves a result."""
    try:
        return run_rank(cfg, rank, store(), out_dir, run_id, guard, binders)
    except ConfigError:
        raise
    except Interrupted as exc:
        result = record_interrupt(_new(cfg, rank, run_id), exc.name)
    except Exception as exc:
        result = _new(cfg, rank, run_id)
        record_crash(result, exc, cfg.parallel.collective_timeout_s, out_dir)
    guard.finish()
    write_result(out_dir, result)
    return result


def _new(cfg: RunConfig, rank: int, run_id: str | None) -> dict:
    p = cfg.parallel
    return new_result(rank, RankLayout(p.tp, p.cp, p.pp, rank), run_id)


def exit_code(interrupted: str | None, ok: bool) -> int:
    """The exit status of a rank (its result) or of a run (`python -m hicache_lab`, its summary): 128 + the signal
    that cut it short (`interrupted`, a name: 130 for SIGINT, as a shell reports Ctrl-C); else 0 when it did what
    it should (`ok`: a rank completed, a run `report.passed`), else 1."""
    if interrupted:
        return 128 + signal.Signals[interrupted]
    return 0 if ok else 1


def rank_processes() -> multiprocessing.context.BaseContext:
    """How ranks are started: forked by a server that imported torch and the rank's code once (a `spawn` imports
    them anew in every rank: 2-3 s each). The server is this process's child, started with the first rank, and
    ends as soon as this process does; the ranks it forks die with it (ending.die_with_parent). A rank takes this
    process's working directory and `sys.path` as it starts (multiprocessing passes them) and its environment
    (`_as_launched`)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["hicache_lab.entrypoints.fork_server"])
    return ctx


def _as_launched(environ: dict[str, str], launcher: int) -> None:
    """A rank starts in the launcher's environment as it was at the start (not the fork server's), and dies with
    the launcher."""
    die_with_parent(launcher)
    sys.excepthook = sys.__excepthook__  # the fork server's quiets a start cut short (fork_server.py), not a rank
    os.environ.clear()
    os.environ.update(environ)


def _rank_main(
    cfg: RunConfig,
    rank: int,
    port: int,
    out_dir: Path,
    run_id: str,
    launcher: tuple,
    binders: tuple[Binder, ...],
    beats,
) -> None:
    """A spawned rank: it dies with the launcher (`launcher`: its environment and pid), beats its heartbeat into
    `beats` (watch.py), and leaves with os._exit once its result is written: peers may be blocked on a rank that
    did not complete (the launcher stops them), and a thread the run's code left running (`left_threads`, in
    the result) must not hold the process open."""
    _as_launched(*launcher)
    start_beating(beats, rank)
    timeout = datetime.timedelta(seconds=cfg.parallel.collective_timeout_s)
    world = cfg.parallel.world_size

    def store() -> dist.Store:
        return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)

    with SignalGuard() as guard:  # left by os._exit: a signal after the result finds the guard, not a traceback
        try:
            result = join_and_run(cfg, rank, store, out_dir, run_id, guard, binders)
            if left := [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]:
                write_result(out_dir, {**result, "left_threads": left})
        except OutputError as exc:  # its result could not be written: the launcher finds none
            print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code(result.get("interrupted"), result["completed"]))


def join_world(rank: int, size: int, port: int, timeout_s: float) -> None:
    """This process becomes rank `rank` of a gloo world of `size` ranks that meet at the store on
    127.0.0.1:`port` (`spawn_ranks` serves it)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)


def _with_lifeline(launcher: tuple, target, *args) -> None:
    _as_launched(*launcher)
    target(*args)


def spawn_ranks(target, size: int, args: tuple, timeout_s: float) -> list[int | None]:
    """Run `target(rank, size, port, *args)` in `size` processes (`rank_processes`; each may `join_world(rank, size,
    port, ...)`, and dies with this one); wait for all, killing any still running after `timeout_s`. Returns
    their exit codes."""
    ctx, launcher = rank_processes(), (dict(os.environ), os.getpid())
    server = serve_store(timeout_s)
    procs = [
        ctx.Process(target=_with_lifeline, args=(launcher, target, rank, size, server.port, *args))
        for rank in range(size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(GRACE_S)
    return [proc.exitcode for proc in procs]


def spawn_world(cfg: RunConfig, out_dir: Path, run_id: str, binders: tuple[Binder, ...] = ()) -> WorldEnd:
    """Start every rank as a process (each dies with this one) and watch them (watch.Watch: exits, heartbeats,
    the fork server); once one fails, stop the rest after GRACE_S seconds. On SIGINT/SIGTERM (`Interrupted`)
    every rank is asked to end (SIGTERM: each writes what it has), and what is left after GRACE_S is stopped.
    The WorldEnd holds how the ranks that failed first failed, on their own (not those the launcher stopped),
    and what each rank the launcher stopped was doing."""
    ctx, world = rank_processes(), cfg.parallel.world_size
    server = serve_store(cfg.parallel.collective_timeout_s)
    try:
        beats = ctx.Array("d", world, lock=False)  # shared memory: a file of a page in the temporary directory
    except OSError as exc:
        raise cannot_write(f"the ranks' heartbeats (shared memory, {tempfile.gettempdir()})", exc) from None
    args = (out_dir, run_id, (dict(os.environ), os.getpid()), binders, beats)
    procs = [ctx.Process(target=_rank_main, args=(cfg, r, server.port, *args)) for r in range(world)]
    end, failed_at = WorldEnd(run_id), None
    watch = Watch(procs, beats, out_dir, run_id, silence_bound(cfg.parallel.collective_timeout_s, GRACE_S))
    try:
        for proc in procs:
            proc.start()
        while watch.look(end):
            failed_at = failed_at or (time.monotonic() if end.failed else None)
            if failed_at is not None and time.monotonic() - failed_at >= GRACE_S:
                break
            time.sleep(0.05)
    except Interrupted as exc:
        end.interrupted = exc.name
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        end.stopped = _stop(procs, end)
    return end


def serve_store(timeout_s: float) -> dist.TCPStore:
    """The store a spawned world meets at, served by this process on a port the OS picks while binding it (a port
    found free and bound later by a rank can be taken meanwhile by another run's: EADDRINUSE)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)


def _stop(procs: list, end: WorldEnd) -> dict[int, str]:
    """Kill every rank still running; what each was doing then, by rank. Every wait is bounded: an exit the fork
    server does not report within GRACE_S (a stopped server) ends the server (watch.release_stopped_server)."""
    stopped = {}
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            if not exited(proc.pid):  # a zombie whose exit the fork server has not reported was not stopped
                stopped[rank] = f"its process was {process_state(proc.pid)} when the launcher stopped it"
            proc.kill()
    for attempt in range(2):
        deadline = time.monotonic() + GRACE_S
        for proc in procs:
            if proc.pid is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        if attempt == 0 and any(proc.is_alive() for proc in procs) and (words := release_stopped_server()):
            end.notes.append(words)
    return stopped


def run_world(
    cfg: RunConfig, out_dir: Path | None = None, verbose: bool = True, binders: tuple[Binder, ...] = ()
) -> dict:
    """Run the workload on the whole world; returns (and writes) the merged summary. `out_dir` (None: a scratch
    directory) is the run's own while it runs (outdir.Claim). `binders` attach tooling to every rank
    (binders.py); a lab field none of them serves is a ConfigError, before any rank starts."""
    started = time.perf_counter()
    check_all(cfg, binders)
    preflight(cfg, out_dir)
    for flag in idle_flags(cfg) if verbose else ():  # said at the start, and in the summary (report.summarize)
        print(f"warning: {flag}", file=sys.stderr)
    if verbose and (where := placement_words(cfg)):
        print(f"placement: {where}")
    with contextlib.ExitStack() as stack:
        out = Path(out_dir) if out_dir is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        run_id = stack.enter_context(Claim(out)).run_id
        adopted = stack.enter_context(Adopted(_servers))
        guard = stack.enter_context(SignalGuard())
        if cfg.cache.storage_backend == "mooncake" and not cfg.cache.mooncake_master:
            master, address, url = start_mooncake_master()
            stack.callback(stop_master, master)
            cache = dataclasses.replace(cfg.cache, mooncake_master=address, mooncake_metadata_url=url)
            cfg = dataclasses.replace(cfg, cache=cache)

        def summary(end: WorldEnd) -> dict:
            return summarize(cfg, out, time.perf_counter() - started, end)

        guard.owe(lambda name: print_summary(summary(WorldEnd(run_id, interrupted=name))))  # main thread stuck
        if cfg.parallel.world_size == 1 and not runs_unbounded_code(cfg, binders):
            result = join_and_run(cfg, 0, dist.HashStore, out, run_id, guard, binders)
            end = WorldEnd(run_id, interrupted=result.get("interrupted"))
        else:
            end = spawn_world(cfg, out, run_id, binders)
        guard.finish()
        merged = summary(end)
    if adopted.left:  # what the run's code forked and left (ended now): said aloud, in the summary too
        merged["left_behind"] += adopted.left
        print(f"ended {len(adopted.left)} process(es) the run left behind: {', '.join(adopted.left)}", file=sys.stderr)
    if verbose:
        print_summary(merged)
    return merged


def runs_unbounded_code(cfg: RunConfig, binders: tuple[Binder, ...]) -> bool:
    """Whether a rank runs code the lab cannot bound from inside the process (a plug-in's, SGLang's, Mooncake's
    client): a thread that holds the interpreter, exits the process or never ends. Such a rank runs in a process
    of its own, even alone, which the launcher watches and can stop (watch.py)."""
    return cfg.cache.storage_backend == "mooncake" or any(binder.runs_unbounded_code(cfg) for binder in binders)


def _servers() -> set[int]:
    """The pids of this process's children that serve every run: the rank fork server, the resource tracker."""
    from multiprocessing import forkserver, resource_tracker

    return {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid} - {None}
