"""One rank: its parts wired together (`build_rank`), run start to end, and its result written (`run_rank`)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..args import FIELD_FLAGS
from ..config import RunConfig
from ..distributed.cache_sync import CacheSync
from ..distributed.parallel_state import (
    Groups,
    RankLayout,
    build_groups,
    get_attn_cp_rank_and_size,
    local_device,
    stage_layers,
)
from ..errors import ConfigError
from ..managers.scheduler import Scheduler
from ..managers.scheduler_pp import StageLoop
from ..managers.step_trace import TraceWriter, trace_path
from ..managers.workload import Feeder, make_workload
from ..mem_cache.base import BasePrefixCache, StorageBackend
from ..mem_cache.build import KVShape, build_cache
from ..mem_cache.hicache_storage import FileStorage, is_storage_writer, storage_suffix
from ..mem_cache.mooncake_store import MooncakeStorage
from ..model import TinyModel
from .binders import Binder, RankParts
from .ending import Interrupted, SignalGuard
from .oracle import check_outputs
from .outdir import OutputError, cannot_write, open_run_file, write_file
from .report import round_rows, scheduling_counts, write_requests

# what a rank sees when a peer fails it: a collective or the store waiting for one that never came, a connection lost
# or never made (gloo's connectFullMesh, when a group is created, with a peer that does not answer)
PEER_LOST = (
    "Timed out",
    "wait timeout",
    "Connect timeout",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
)


@dataclass
class Built:
    """One rank, built: what `run_rank` needs of it after the run."""

    loop: StageLoop
    cache: BasePrefixCache  # what the scheduler asks: the cache, or what a binder put in front of it
    reports: list[Callable[[], dict]]  # what the binders add to the rank's result


def build_storage(cfg: RunConfig, sync: CacheSync, layers: range, kv: KVShape, directory: Path) -> StorageBackend:
    """The L3 backend under this rank's keys. `--hicache-storage-writers every-rank` (SGLang's MHA keys): the
    global TP rank of T x C, so CP peers keep separate copies; `one` (rank-replicated KV): the attention-TP rank,
    a key set the CP group shares (and, without the `storage_keys` fix, the CP rank: `storage_key_cp_rank`)."""
    layout, c = sync.groups.layout, cfg.cache
    tp_rank, tp = layout.tp_rank, layout.tp
    if c.storage_writers == "every-rank":
        tp_rank, tp = layout.cp_rank * layout.tp + layout.tp_rank, layout.tp * layout.cp
    heads = range(layout.tp_rank * kv.num_heads, (layout.tp_rank + 1) * kv.num_heads)  # the attention-TP shard
    suffix = storage_suffix(cfg.model, tp_rank, tp, heads, layers, sync.storage_key_cp_rank())
    if c.storage_backend == "mooncake":
        return MooncakeStorage(c.mooncake_master, c.mooncake_metadata_url, suffix, kv.bytes_per_token * c.page_size)
    backend = FileStorage(directory, suffix)
    if not c.storage_dir and is_storage_writer(c, layout):
        backend.clear()  # a run-local store starts empty (its writer clears its key set)
    return backend


def build_rank(cfg: RunConfig, groups: Groups, out_dir: Path, binders: tuple[Binder, ...] = ()) -> Built:
    """Model, cache (mem_cache/build.py), scheduler and event loop of one rank, and what `binders` bind into them
    (entrypoints/binders.py)."""
    m, c, p, layout = cfg.model, cfg.cache, cfg.parallel, groups.layout
    layers = stage_layers(m.num_layers, p.pp, layout.pp_rank, p.pp_layer_partition)
    cp_size = get_attn_cp_rank_and_size(groups)[1]
    model = TinyModel(
        m,
        cfg.device,
        layers,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp,
        attn_tp_group=groups.attn_tp_compute,
        attn_cp_group=groups.attn_cp_compute if cp_size > 1 else None,
    )
    sync = CacheSync(groups, p, storage=c.storage_backend != "none")
    kv = KVShape(len(layers), m.num_heads // layout.tp, m.head_dim, cfg.device, model.dtype)
    storage_dir = Path(c.storage_dir or out_dir / "storage")
    built = next(filter(None, (binder.build_cache(cfg, sync, kv, storage_dir) for binder in binders)), None)
    backend = None
    if built is not None:
        pool, cache = built
    else:
        backend = build_storage(cfg, sync, layers, kv, storage_dir) if c.storage_backend != "none" else None
        pool, cache = build_cache(c, kv, sync, backend=backend, check_copies=cfg.check_outputs, seed=cfg.workload.seed)
    asked = cache
    for binder in binders:
        asked = binder.wrap_cache(cfg, asked, out_dir, layout.rank)
    s = cfg.scheduler
    scheduler = Scheduler(asked, s.max_running_requests, s.chunk_size, s.max_prefill_tokens, p.micro_batches, p.pp)
    prior = backend.stored_hashes() if isinstance(backend, FileStorage) else set()  # a store filled before the run
    feeder = Feeder(make_workload(cfg.workload, m.vocab_size), c.page_size, prior) if layout.pp_rank == 0 else None
    trace = TraceWriter(open_run_file(trace_path(out_dir, layout.rank)), layout.rank)
    loop = StageLoop(groups, sync, scheduler, model, pool, feeder, trace, p.consensus_check)
    parts = RankParts(layout.rank, sync, cache, loop)
    reports = [report for binder in binders if (report := binder.bind(cfg, parts, out_dir)) is not None]
    return Built(loop, asked, reports)


def meet(cfg: RunConfig, out_dir: Path, run_id: str | None) -> list[dict]:
    """One gather as the ranks join: every rank's configuration and output directory (flattened, as text), run
    id, process (host, pid) and GPU, in rank order."""
    config = {"out": repr(str(Path(out_dir).resolve()))}
    for key, value in asdict(cfg).items():
        config |= {f"{key}.{k}": repr(v) for k, v in value.items()} if isinstance(value, dict) else {key: repr(value)}
    gpu = torch.cuda.current_device() if cfg.device == "cuda" else None
    mine = {"config": config, "run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(), "gpu": gpu}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def agree_on_config(every: list[dict]) -> None:
    """Every rank runs the same configuration. Each process parses its own flags (by hand, or under torchrun):
    any difference in what the ranks gathered (`meet`) is a ConfigError on every rank that names each flag that
    differs and each rank's value. No field may differ per rank: a rank's place in the world comes from its rank,
    never from a flag."""
    flags = FIELD_FLAGS | {"out": "--out"}
    differ = []
    for key in dict.fromkeys(k for rank in every for k in rank["config"]):
        ranks = {}  # value -> the ranks that have it
        for rank, gathered in enumerate(every):
            ranks.setdefault(gathered["config"].get(key, "nothing"), []).append(str(rank))
        if len(ranks) > 1:
            where = ", ".join(f"{v} on rank{'s' * (len(r) > 1)} {', '.join(r)}" for v, r in ranks.items())
            differ.append(f"{flags.get(key, key)} ({key.rpartition('.')[2]}: {where})")
    if differ:
        dist.destroy_process_group()  # every rank leaves the world it could not run in, none aborts at exit
        raise ConfigError(
            f"ranks were started with different flags: {'; '.join(differ)}; start every rank with the same flags"
        )


def run_rank(
    cfg: RunConfig,
    rank: int,
    store: dist.Store | None,
    out_dir: Path,
    run_id: str | None,
    guard: SignalGuard,
    binders: tuple[Binder, ...] = (),
) -> dict:
    """One rank, start to end: returns (and writes) its result; never raises for a failure of the run. `run_id`:
    the run's (None where only rank 0 knows it: torchrun); the ranks agree on rank 0's at start and write it into
    their results. SIGINT/SIGTERM (`guard`) end the rank with what it has, as an interrupted result."""
    p = cfg.parallel
    if cfg.device == "cpu":
        torch.set_num_threads(1)  # tensors are tiny and ranks share the cores: more threads only spin
    else:
        torch.cuda.set_device(local_device(rank))
    timeout = datetime.timedelta(seconds=p.collective_timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=p.world_size, timeout=timeout)
    every = meet(cfg, out_dir, run_id)
    agree_on_config(every)
    layout = RankLayout(p.tp, p.cp, p.pp, rank)
    result = new_result(rank, layout, every[0]["run_id"])  # rank 0's id: under torchrun only it knows the run's
    result["peers"] = {str(r): e["pid"] for r, e in enumerate(every) if e["host"] == socket.gethostname()}
    built = None
    try:
        groups = build_groups(layout, p, cfg.device, [(e["host"], e["gpu"]) for e in every])
        result["compute_backends"] = groups.compute_backends
        built = build_rank(cfg, groups, out_dir, binders)
        guard.owe(lambda name: _write(cfg, out_dir, record_interrupt(result, name), built, closing=False))
        built.loop.run()
        result["completed"] = True
    except Interrupted as exc:
        record_interrupt(result, exc.name)
    except Exception as exc:  # a crash is a result: it goes in the summary
        record_crash(result, exc, p.collective_timeout_s, out_dir)
    guard.finish()
    try:
        _write(cfg, out_dir, result, built, closing=True)
    finally:  # a result that cannot be written (a full disk) still leaves this process out of the world
        if result["completed"] or p.world_size == 1:
            dist.destroy_process_group()  # else peers may be blocked on us: the caller leaves at once (os._exit)
    return result


def new_result(rank: int, layout: RankLayout, run_id: str | None) -> dict:
    """A rank's result before it runs: nothing done yet."""
    where = {"tp_rank": layout.tp_rank, "cp_rank": layout.cp_rank, "pp_rank": layout.pp_rank}
    return {"rank": rank, "run_id": run_id, **where, "completed": False, "crashed": False, "error": None, "rounds": []}


def record_crash(result: dict, exc: Exception, timeout_s: float, out_dir: Path) -> None:
    """`exc` ended the rank. A timeout or a lost connection is `waited`: this rank waited for a peer, a symptom;
    the cause is that peer. A file of the run that could not be written says which, and what to do."""
    error = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OutputError):
        error = str(exc)
    elif isinstance(exc, OSError) and exc.filename and Path(exc.filename).parent == Path(out_dir):
        error = str(cannot_write(exc.filename, exc))
    elif any(words in str(exc) for words in PEER_LOST):
        result["waited"] = True
        if "Timed out" in str(exc):
            result["hung_in"] = _lab_calls(exc)
            error = f"collective timed out after --collective-timeout {timeout_s:g} s in {result['hung_in']} ({error})"
    result.update(crashed=True, error=error, traceback=traceback.format_exc(), failed_at=time.time())


def record_interrupt(result: dict, name: str) -> dict:
    """A signal (`name`) ended the rank early: not a crash, a run cut short."""
    result.update(interrupted=name, error=f"interrupted by {name}", failed_at=time.time())
    return result


def write_result(out_dir: Path, result: dict) -> None:
    """`rank{R}.json`, once the rank knows the run's id (a rank that never met rank 0 writes nothing: the
    directory may be another run's), else its error on stderr."""
    if result["run_id"] is None:
        print(f"rank {result['rank']}: {result['error']} (before it met rank 0: no result written)", file=sys.stderr)
        return
    write_file(out_dir / f"rank{result['rank']}.json", json.dumps(result, indent=1) + "\n")


def _write(cfg: RunConfig, out_dir: Path, result: dict, built: Built | None, closing: bool) -> None:
    """What the rank did, into its result (and, rank 0, the request log), then `write_result`. `closing`: the
    main thread's own end (it closes the cache and checks outputs); else a signal found it stuck. A file of the
    run that cannot be written on the way (a recording closed with the cache, the request log) ends the rank as
    a crash naming it, and the result is still written."""
    if built is not None:
        try:
            _gather(cfg, out_dir, result, built, closing)
        except OutputError as exc:
            if not result["crashed"]:
                result["completed"] = False
                record_crash(result, exc, cfg.parallel.collective_timeout_s, out_dir)
    write_result(out_dir, result)


def _gather(cfg: RunConfig, out_dir: Path, result: dict, built: Built, closing: bool) -> None:
    p, loop, cache = cfg.parallel, built.loop, built.cache
    loop.trace.close()
    result.update(cache.summary())
    for report in built.reports:
        result.update(report())
    answered = [r for r in loop.reqs if r.finished]
    result["rounds"] = round_rows(answered, loop.records)
    result["scheduling"] = scheduling_counts(loop)
    if closing:
        cache.close()
    if result["rank"] == 0:
        write_requests(out_dir, loop.reqs)
    if closing and cfg.check_outputs and result["completed"]:
        layout = RankLayout(p.tp, p.cp, p.pp, result["rank"])
        is_reference_rank = layout.pp_rank == p.pp - 1 and layout.tp_rank == 0 and layout.cp_rank == 0
        reqs = answered if is_reference_rank else []
        result["oracle"] = check_outputs(cfg.model, cfg.device, reqs, cache.copy_check())


def _lab_calls(exc: BaseException, depth: int = 4) -> str:
    """The innermost calls of the lab's own code where `exc` was raised: which collective hung."""
    package = str(Path(__file__).resolve().parents[1])
    names = [f.name for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(package)]
    return " > ".join(names[-depth:]) or "an unknown call"
