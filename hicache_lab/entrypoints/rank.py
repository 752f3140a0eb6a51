"""One rank: its parts wired together (`build_stage`), run start to end, and its result written (`run_rank`)."""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..distributed.cache_sync import CacheSync
from ..distributed.parallel_state import Groups, RankLayout, build_groups, get_attn_cp_rank_and_size, stage_layers
from ..managers.scheduler import Scheduler
from ..managers.scheduler_pp import StageLoop
from ..managers.step_trace import TraceWriter, trace_path
from ..managers.workload import Feeder, make_workload
from ..mem_cache.base import BasePrefixCache, StorageBackend
from ..mem_cache.build import KVShape, build_cache
from ..mem_cache.hicache_storage import FileStorage, MooncakeStorage, is_storage_writer, storage_suffix
from ..mem_cache.recording import RecordingCache, ops_path
from ..model import TinyModel
from .hooks import install, install_faults, resolve
from .oracle import check_outputs
from .report import round_rows, scheduling_counts, write_requests


@dataclass
class Stage:
    """One rank's parts, as `run_rank` needs them after the run."""

    loop: StageLoop
    cache: BasePrefixCache


def build_storage(cfg: RunConfig, sync: CacheSync, layers: range, kv: KVShape, directory: Path) -> StorageBackend:
    """The L3 backend under this rank's keys. `--hicache-storage-writers every-rank` (SGLang's MHA keys): the
    global TP rank of T x C, so CP peers keep separate copies; `one` (rank-replicated KV): the attention-TP rank,
    a key set the CP group shares (and, without the `storage_keys` fix, the CP rank: `storage_key_cp_rank`)."""
    layout, c = sync.groups.layout, cfg.cache
    tp_rank, tp = layout.tp_rank, layout.tp
    if c.storage_writers == "every-rank":
        tp_rank, tp = layout.cp_rank * layout.tp + layout.tp_rank, layout.tp * layout.cp
    suffix = storage_suffix(cfg.model, tp_rank, tp, layers, sync.storage_key_cp_rank())
    if c.storage_backend == "mooncake":
        return MooncakeStorage(c.mooncake_master, c.mooncake_metadata_url, suffix, kv.bytes_per_token * c.page_size)
    backend = FileStorage(directory, suffix)
    if not c.storage_dir and is_storage_writer(c, layout):
        backend.clear()  # a run-local store starts empty (its writer clears its key set)
    return backend


def build_stage(cfg: RunConfig, groups: Groups, out_dir: Path) -> Stage:
    """Model, cache (mem_cache/build.py), scheduler and event loop of one rank, with the hooks its flags ask for."""
    m, c, p, layout = cfg.model, cfg.cache, cfg.parallel, groups.layout
    layers = stage_layers(m.num_layers, p.pp, layout.pp_rank, p.pp_layer_partition)
    cp_size = get_attn_cp_rank_and_size(groups)[1]
    model = TinyModel(
        m,
        p.device,
        layers,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp,
        attn_tp_group=groups.attn_tp_compute,
        attn_cp_group=groups.attn_cp_compute if cp_size > 1 else None,
    )
    sync = CacheSync(p.sync, groups, p.fixes, storage=c.storage_backend != "none")
    kv = KVShape(len(layers), m.num_heads // layout.tp, m.head_dim, p.device)
    backend = None
    if c.storage_backend != "none":
        backend = build_storage(cfg, sync, layers, kv, Path(c.storage_dir or out_dir / "storage"))
    pool, cache = build_cache(c, kv, sync, backend=backend, check_copies=cfg.check_outputs, seed=cfg.workload.seed)
    asked = RecordingCache(cache, ops_path(out_dir, layout.rank), layout.rank) if cfg.record_cache_ops else cache
    w = cfg.workload
    scheduler = Scheduler(asked, w.max_running_requests, w.chunk_size, w.max_prefill_tokens, p.micro_batches, p.pp)
    install(resolve(p.sync_impls), sync, cache)
    feeder = Feeder(make_workload(cfg.workload, m.vocab_size), c.page_size) if layout.pp_rank == 0 else None
    trace = TraceWriter(trace_path(out_dir, layout.rank), layout.rank)
    loop = StageLoop(groups, sync, scheduler, model, pool, feeder, trace, p.consensus_check)
    install_faults(cfg, layout.rank, cache, loop)
    return Stage(loop, asked)


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
    stage = None
    try:
        stage = build_stage(cfg, build_groups(layout, p), out_dir)
        stage.loop.run()
        result["completed"] = True
    except Exception as exc:  # a crash is a result: it goes in the summary
        error = f"{type(exc).__name__}: {exc}"
        if "Timed out" in str(exc):
            result["hung_in"] = _lab_calls(exc)
            timeout_s = p.collective_timeout_s
            error = f"collective timed out after --collective-timeout {timeout_s:g} s in {result['hung_in']} ({error})"
        result.update(crashed=True, error=error, traceback=traceback.format_exc(), failed_at=time.time())
    if stage is not None:
        loop, cache = stage.loop, stage.cache
        loop.trace.close()
        result.update(cache.summary())
        cache.close()
        answered = [r for r in loop.reqs if r.finished]
        result["rounds"] = round_rows(answered, loop.records)
        result["scheduling"] = scheduling_counts(loop)
        if rank == 0:
            write_requests(out_dir, loop.reqs)
        if cfg.check_outputs and result["completed"]:
            is_reference_rank = layout.pp_rank == p.pp - 1 and layout.tp_rank == 0 and layout.cp_rank == 0
            reqs = answered if is_reference_rank else []
            result["oracle"] = check_outputs(cfg.model, p.device, reqs, cache.copy_check())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["crashed"] and p.world_size > 1:
        os._exit(1)  # peers may be blocked on us: leave now, the launcher stops them
    dist.destroy_process_group()
    return result


def _lab_calls(exc: BaseException, depth: int = 4) -> str:
    """The innermost calls of the lab's own code where `exc` was raised: which collective hung."""
    package = str(Path(__file__).resolve().parents[1])
    names = [f.name for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(package)]
    return " > ".join(names[-depth:]) or "an unknown call"
