"""The seed's bugs put back into sglang 0.5.23's own objects: `run --cache-impl sglang --sync legacy`.

Each `Revert` replaces one function of SGLang's, at runtime, with the lab's own version of what SGLang's code did
before the PR that fixed it (the lab writes these; nothing of SGLang's is copied). It names the function it
replaces and the PR whose lines it undoes, and refuses (RuntimeError) where the function no longer holds the
lines it undoes: an upgraded sglang fails here, loudly, instead of reverting something else.

A revert belongs to one of the lab's sync fixes (parallel_config.SYNC_FIXES): it is applied when that fix is off
(`--sync legacy` turns them all off; `--disable-fix NAME` one). The fixes that 0.5.23 has no site for are
named in `NO_SGLANG_SITE`: with SGLang's cache they are what 0.5.23 does, on or off.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...parallel_config import SYNC_FIXES
from .modules import sglang_modules

MIN = dist.ReduceOp.MIN


def _attn_tp_only(self, tensor: torch.Tensor, op, *, released) -> None:
    """Before #20460: the attention-TP group only; CP peers never agree."""
    group = self.attn_tp_group
    if group is not None and dist.get_world_size(group=group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _each_stage_alone(self, data: torch.Tensor, tp_reduce_op, *, released) -> None:
    """Before #27285: every stage agrees with its own attention peers; nothing is relayed down the pipeline."""
    self._all_reduce_attn_groups(data, tp_reduce_op)


def _every_stage_polls(self, *, released):
    """Before #27285/#27010: every stage counts its own finished acks (no PP-rank-0 count to relay) and agrees
    them with its attention peers only (`_all_reduce`, reverted with it)."""
    cc = self.cache_controller
    names = tuple(getattr(cc, "extra_host_mem_release_queues", {})) if self.enable_storage else ()
    queues = (
        (cc.prefetch_hit_queue, cc.ack_prefetch_queue, cc.ack_backup_queue, cc.host_mem_release_queue)
        if self.enable_storage
        else ()
    )
    sizes = [q.qsize() for q in queues] + [cc.extra_host_mem_release_queues[n].qsize() for n in names]
    own = [self._count_ready_acks(cc.ack_write_queue), self._count_ready_acks(cc.ack_load_queue)]
    counts = torch.tensor([*own, *sizes], dtype=torch.int64)
    self._all_reduce(counts, MIN)
    values = list(map(int, counts.tolist()))
    return values[0], values[1], tuple(values[2:]), names


def _own_load_acks(self, finish_count=None, *, released):
    """Before load acks were agreed (the first link of #26921's chain): a rank consumes the load acks it sees
    finished itself, whatever count the ranks agreed."""
    return released(self, self._count_ready_acks(self.cache_controller.ack_load_queue))


def _reap_by_polling(self, *, released):
    """Before #28916: the relay sends are reaped by polling instead of waited for. gloo's `is_completed()` stays
    False until `wait()`, so none is reaped and the list grows with every step (#28902: ~12 GB/h on PP0)."""
    self.work_list[:] = [work for work in self.work_list if not work.is_completed()]


def _own_stage_size(size: int, host_size, *, released) -> int:
    """Before #29258: a host pool sized in bytes keeps the tokens its own stage's bytes per token give; stages
    holding fewer layers hold more tokens, and evict from the host later than the others."""
    return size


def _prefetch_groups_tp_only(self, *, released):
    """Before #20460/#27010: the storage threads agree over the TP group of their stage alone."""
    from sglang.srt.distributed.parallel_state import create_custom_parallel_group  # sglang: only where it runs

    group = self.attn_tp_group if self.attn_tp_group is not None else self.tp_group
    if group is None or dist.get_world_size(group=group) == 1:
        return []
    return [create_custom_parallel_group(group_ranks=list(dist.get_process_group_ranks(group)), backend="gloo")]


@dataclass(frozen=True)
class Revert:
    fix: str  # the lab's sync fix whose absence this is
    module: str
    owner: str  # the class, or "" for a function of the module
    name: str  # the function replaced
    pr: str  # the PR whose lines it undoes
    holds: tuple[str, ...]  # lines of 0.5.23's function that the revert undoes: they must be there
    replacement: Callable  # (self, *args, released=0.5.23's function): the lab's own code of the older behaviour

    @property
    def where(self) -> str:
        return f"{self.owner or self.module.removeprefix('sglang.srt.')}.{self.name}"

    def target(self):
        """The class (or module) and its 0.5.23 function; RuntimeError where the function no longer holds `holds`."""
        sglang_modules()  # sglang imported the lab's way (its CPU stand-ins) before a module of it is
        module = importlib.import_module(self.module)
        owner = getattr(module, self.owner) if self.owner else module
        function = owner.__dict__.get(self.name)
        source = inspect.getsource(function) if function is not None else ""
        moved = [line for line in self.holds if line not in source]
        if moved:
            raise RuntimeError(
                f"sglang's {self.where} no longer holds {moved}: the revert of {self.pr} follows sglang 0.5.23 "
                "(lab/sglang/reverts.py)"
            )
        return owner, function


URC, CC = "sglang.srt.mem_cache.unified_radix_cache", "sglang.srt.managers.cache_controller"
REVERTS = (
    Revert(
        "cp_groups",
        URC,
        "UnifiedRadixCache",
        "_all_reduce_attn_groups",
        "#20460",
        ("for group in (self.attn_cp_group, self.attn_tp_group):",),
        _attn_tp_only,
    ),
    Revert(
        "pp_relay",
        URC,
        "UnifiedRadixCache",
        "_all_reduce",
        "#27285",
        ("if self.pp_rank == 0:", "self._pp_sync(data)"),
        _each_stage_alone,
    ),
    Revert(
        "pp_relay",
        URC,
        "UnifiedRadixCache",
        "_sync_hicache_ready_counts",
        "#27285, #27010",
        ("self.pp_rank > 0",),
        _every_stage_polls,
    ),
    Revert(
        "prefetch_groups",
        CC,
        "HiCacheController",
        "_create_sync_groups",
        "#20460, #27010",
        ("base_groups = [self.attn_cp_group, self.attn_tp_group]", "base_groups.append(self.pp_group)"),
        _prefetch_groups_tp_only,
    ),
    Revert(
        "agree_loads",
        URC,
        "UnifiedRadixCache",
        "loading_check",
        "the load-ack agreement",
        ("while finish_count > 0:",),
        _own_load_acks,
    ),
    Revert(
        "bounded_drain",
        URC,
        "UnifiedRadixCache",
        "_drain_async_work",
        "#28916",
        ("work.wait()", "self.work_list.clear()"),
        _reap_by_polling,
    ),
    Revert(
        "host_capacity_min",
        "sglang.srt.mem_cache.pool_host.base",
        "",
        "sync_fixed_hicache_size",
        "#29258",
        ("op=torch.distributed.ReduceOp.MIN", "group=pp_group.cpu_group"),
        _own_stage_size,
    ),
)
# The lab's fixes with no site in 0.5.23 to revert (lab proposals, closed PRs, fixes of other releases): SGLang's
# cache does what 0.5.23 does whatever they are.
NO_SGLANG_SITE = tuple(fix for fix in SYNC_FIXES if fix not in {revert.fix for revert in REVERTS})


def reverts_for(fixes: frozenset[str]) -> list[Revert]:
    """The reverts a run with `fixes` on applies: those of every fix that is off."""
    return [r for r in REVERTS if r.fix not in fixes]


@contextlib.contextmanager
def applied(reverts: list[Revert], built: Callable[[], dict]):
    """Each revert in place while the cache is built (SGLang's controller builds its prefetch groups as it is
    built, its host pool is sized there), then bound to the objects built (`built()`: owner class name -> object)
    and the classes and modules restored: the replacements live in this rank's own objects only (a one-rank run
    shares its process with its caller); a module's function is called only while the cache is built."""
    targets = [(revert, *revert.target()) for revert in reverts]  # every one checked before any is applied
    for revert, owner, original in targets:
        bound = functools.partialmethod if revert.owner else functools.partial  # a method, or a module's function
        setattr(owner, revert.name, bound(revert.replacement, released=original))
    try:
        yield
    finally:
        for revert, owner, original in targets:
            setattr(owner, revert.name, original)
    objects = built()
    for revert, _, original in targets:
        if revert.owner and (obj := objects.get(revert.owner)) is not None:
            setattr(obj, revert.name, types.MethodType(functools.partial(revert.replacement, released=original), obj))


def described(reverts: list[Revert]) -> list[str]:
    """What each revert replaced, for the rank's result."""
    return [f"{revert.where} ({revert.pr} undone)" for revert in reverts]
