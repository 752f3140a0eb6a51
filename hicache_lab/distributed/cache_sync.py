"""Every cross-rank agreement the cache makes, readable top to bottom.

A rank-local observation (how many of my host writes have finished?) becomes an agreed value before the tree
changes, so that every rank takes identical cache decisions. The modes:

* `off`    - no agreement: each rank trusts its own polls.
* `legacy` - SGLang before both fixes: write acks agreed (MIN) over the attention-TP group only; load acks
             not agreed; no relay down the pipeline.
* `fixed`  - released SGLang 0.5.23, every fix below but the two no release has (`alloc_agreement`,
             `prefetch_vote`: `parallel_config.PROPOSALS`, on only by name): only PP rank 0 polls; it agrees
             with its attention-CP and attention-TP peers;
             the count is relayed down the pipeline (`_pp_sync`); every rank consumes exactly that many
             acks, waiting on its own copies where they are not done yet.

The fixes, each switchable alone (`--enable-fix NAME` / `--disable-fix NAME`) so each bug can be shown alone:

* `pp_relay`          - only PP rank 0 polls and agrees; later stages receive its count (PP fix).
* `cp_groups`         - agree over the attention-CP group too, not only attention-TP (CP fix).
* `agree_loads`       - load acks are agreed like write acks.
* `host_capacity_min` - ranks sized in bytes agree on the smallest host pool (`agree_host_capacity`).
* `bounded_drain`     - the previous step's relay sends are waited for at the start of every
                        `check_hicache_events` (SGLang #28916), instead of reaped by polling, which grew without
                        bound (#28902); at most one step's sends are outstanding, and a stage cannot run more
                        than a step ahead of the next one's agreement.
* `prefetch_groups`   - storage hit counts and prefetch progress are agreed over gloo groups built from the
                        attention-CP, attention-TP and PP groups, not the attention-TP group alone (CP fix).
* `storage_keys`      - storage keys leave the CP rank out, so CP peers find each other's pages (CP fix;
                        `storage_key_cp_rank`).
* `multi_hop_relay`   - the relayed count travels through every stage; without it only stage 1 receives it and
                        later stages keep their own polls (SGLang #22878: right for 2 stages, wrong for 3+).
* `always_agree`      - every rank enters the agreement every step; without it a rank with nothing in flight
                        returns before the collective, as SGLang 0.5.10-0.5.13's `writing_check` did. Harmless
                        while ranks agree on what is in flight; once something else made that differ (#26921:
                        unagreed load acks; #28429: an allocation that failed on one rank), the rank with
                        nothing in flight skips the collective its peers wait in: a deadlock (#27489 fixed it).
* `alloc_agreement`   - the slots a copy needs (a write to the host, a write-back eviction, a load back) are
                        taken on every rank or on none: each rank allocates, the ranks agree (MIN of success),
                        and where one failed the others free theirs (SGLang #28429, the reserve/commit of
                        #31425). Across stages PP rank 0's verdict is relayed; a later stage whose own
                        allocation failed retries once and otherwise ends the run with `AllocationError` (a
                        one-way relay cannot carry its refusal back: SGLang has no answer for this either).
* `prefetch_completion` - the pages a prefetch has read are agreed after every batch on the read thread, as the
                        MIN over the prefetch worker's groups (every rank that reads them, across stages with
                        `prefetch_groups`: SGLang 0.5.23's progressive acks on `prefetch_completion_sync_groups`);
                        without it each rank counts its own, PP rank 0's attention peers agree at admission, and
                        a page damaged on a later stage alone leaves it short of the relayed count: a crash.
* `prefetch_vote`     - a rank that holds no prefetch for a request still enters `check_prefetch_progress`'s
                        collectives (voting ready, 0 pages), as SGLang #38273 proposed; without it the rank
                        returns before them, and a peer whose prefetches differ waits there alone (a deadlock).

Rules every path obeys: each rank enters every collective of a step in the same order (a rank-local early
return before a collective deadlocks), and no symmetric collective spans PP stages in the scheduler loop: only
the one-way relay crosses stages, so that a stage runs ahead of a slower one. A symmetric collective that every
stage enters at the same point of every step does not deadlock here: it forces the stages into lockstep (stage
0 no longer leaves a step ahead of the last stage; `python -m hicache_lab exercise` measures it against this
relay). One that only some stages enter deadlocks: a group of `_attn_groups` with ranks of other stages is
entered by PP rank 0 alone. The two world-wide agreements obey the rule by where they run:
`agree_host_capacity` once, at start; `check_consensus` between iterations.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ConsensusError
from ..parallel_config import ParallelConfig
from .parallel_state import Groups, RankLayout, get_attn_cp_rank_and_size, group_rank_and_size

MIN = dist.ReduceOp.MIN
MAX = dist.ReduceOp.MAX


def prefetch_group_rank_sets(layout: RankLayout, fixes: frozenset[str]) -> tuple[list[tuple], list[tuple]]:
    """The rank sets of the storage path's gloo groups, in creation order: (prefetch worker's, scheduler's).
    Built from attention-CP, attention-TP and (worker only) PP groups; size-1 sets skipped, duplicates made once.
    The prefetch thread may agree across stages (it is off the pipeline); the scheduler relays instead."""
    attention = ("attn_cp", "attn_tp") if "prefetch_groups" in fixes else ("attn_tp",)
    pipeline = ("pp",) if "prefetch_groups" in fixes else ()
    rank_lists = layout.group_rank_lists()
    return tuple(
        list(dict.fromkeys(tuple(r) for kind in kinds for r in rank_lists[kind] if len(r) > 1))
        for kinds in (attention + pipeline, attention)
    )


class CacheSync:
    def __init__(self, groups: Groups, parallel: ParallelConfig, storage: bool = False):
        """The agreement of `parallel.sync` with its `fixes`, over `groups`; `storage`: with an L3 tier's groups."""
        self.mode, self.groups, self.fixes = parallel.sync, groups, parallel.fixes
        self.pp_rank, self.pp_size = group_rank_and_size(groups.pp_cache_group)
        self.relay_stages = self.pp_size if "multi_hop_relay" in self.fixes else min(self.pp_size, 2)
        self.work_list: list[dist.Work] = []  # outstanding relay sends, drained at every step's check
        self.prefetch_sync_groups: list = []  # used by the prefetch worker only
        self.prefetch_progress_groups: list = []  # used by the scheduler only
        self.prefetch_completion_groups: list = []  # used by the read thread only
        if storage:
            self._create_prefetch_sync_groups()

    # -- primitives (SGLang's names) ---------------------------------------------------------------

    def _attn_groups(self) -> list:
        """The attention-CP then attention-TP group, size-1 groups skipped. Without the CP fix, attention-TP
        alone: the legacy cache group, which excludes CP peers. (SGLang falls back to its TP group when
        neither group exists; here both always do.) A `--sync-impl attn_groups=...` replaces it (notebook 06)."""
        candidates = (self.groups.attn_cp_group, self.groups.attn_tp_group)
        if "cp_groups" not in self.fixes:
            candidates = (self.groups.attn_tp_group,)
        return [g for g in candidates if group_rank_and_size(g)[1] > 1]

    def _all_reduce_attn_groups(self, data: torch.Tensor, op) -> None:
        for group in self._attn_groups():
            dist.all_reduce(data, op=op, group=group)

    def _barrier_attn_groups(self) -> None:
        for group in self._attn_groups():
            dist.barrier(group=group)

    def _pp_sync(self, data: torch.Tensor) -> None:
        """One-way relay: receive from the previous stage (blocking), send a clone to the next (async). Stages
        beyond `relay_stages` (without `multi_hop_relay`) are not reached and keep `data` as it is."""
        if self.pp_size <= 1 or self.pp_rank >= self.relay_stages:
            return
        group = self.groups.pp_cache_group
        if self.pp_rank > 0:
            dist.recv(data, group_src=self.pp_rank - 1, group=group, tag=2)
        if self.pp_rank + 1 < self.relay_stages:
            self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank + 1, group=group, tag=2))

    def _all_reduce(self, data: torch.Tensor, op) -> None:
        """Agreement on PP rank 0 over its attention groups, then relayed down the pipeline."""
        if self.pp_rank == 0:
            self._all_reduce_attn_groups(data, op)
        self._pp_sync(data)

    def drain_async_work(self) -> None:
        """Start of a step's check: wait for the previous step's relay sends (bounded memory), or without that
        fix reap the completed ones by polling, as the seed did."""
        if "bounded_drain" not in self.fixes:
            self._reap_completed_async_work()
            return
        for work in self.work_list:
            work.wait()
        self.work_list = []

    def finish(self) -> None:
        """End of the run: every relay send delivered, and attention peers leave together (SGLang uses the
        same barrier when a request is aborted; the lab's workload aborts nothing)."""
        for work in self.work_list:
            work.wait()
        self.work_list = []
        self._barrier_attn_groups()

    def leave_flush_together(self) -> None:
        """After a flush that finished every backup: CP peers, who may share one copy of each page (one writer per
        CP group), leave it together, so that no peer looks for a page before its writer has stored it. The lab's
        flush between rounds is its own (SGLang flushes an idle server); this is not an agreement of SGLang's."""
        if group_rank_and_size(self.groups.attn_cp_group)[1] > 1:
            dist.barrier(group=self.groups.attn_cp_group)

    def _create_prefetch_sync_groups(self) -> None:
        """The storage path's own gloo groups (`prefetch_group_rank_sets`; without the CP fix: attention-TP
        alone), one set per thread that agrees (SGLang's PP + L3 fix): the prefetch worker's hit counts, the
        scheduler's prefetch progress, and (with `prefetch_completion`) the read thread's pages arrived, on the
        worker's rank sets. Collective: every rank creates every group, in the same order."""
        worker, scheduler = prefetch_group_rank_sets(self.groups.layout, self.fixes)
        sets = [(self.prefetch_sync_groups, worker), (self.prefetch_progress_groups, scheduler)]
        if "prefetch_completion" in self.fixes:
            sets.append((self.prefetch_completion_groups, worker))
        for groups, rank_sets in sets:
            for ranks in rank_sets:
                group = dist.new_group(list(ranks), backend="gloo", timeout=self.groups.timeout)
                if self.groups.layout.rank in ranks:
                    groups.append(group)

    def destroy_storage_groups(self) -> None:
        """Once the storage threads have stopped."""
        for group in self.prefetch_sync_groups + self.prefetch_progress_groups + self.prefetch_completion_groups:
            dist.destroy_process_group(group)
        self.prefetch_sync_groups, self.prefetch_progress_groups, self.prefetch_completion_groups = [], [], []

    @staticmethod
    def _all_reduce_prefetch_groups(data: torch.Tensor, op, groups: list) -> None:
        for group in groups:
            dist.all_reduce(data, op=op, group=group)

    def agree_storage(self, values: list[int], op=MIN) -> list[int]:
        """Storage hit pages (MIN) on the prefetch worker's groups, across stages too (a background thread is
        not held by the pipeline)."""
        if self.mode == "off":
            return values
        data = torch.tensor(values, dtype=torch.int64)
        self._all_reduce_prefetch_groups(data, op, self.prefetch_sync_groups)
        return data.tolist()

    def agree_prefetch_completion(self, values: list[int]) -> list[int]:
        """Pages a prefetch has read so far (MIN), on the read thread's groups (`prefetch_completion`); without
        the fix this rank's own count."""
        if "prefetch_completion" not in self.fixes:
            return values
        data = torch.tensor(values, dtype=torch.int64)
        self._all_reduce_prefetch_groups(data, MIN, self.prefetch_completion_groups)
        return data.tolist()

    def agree_prefetch_progress(self, values: list[int], op=MIN) -> list[int]:
        """Prefetch "not ready" (MAX) or pages arrived (MIN), in the scheduler loop: like the ack counts, PP rank
        0 agrees with its attention peers and relays the result; later stages wait for their own pages."""
        if self.mode == "off":
            return values
        data = torch.tensor(values, dtype=torch.int64)
        if "pp_relay" in self.fixes and self.pp_rank > 0:
            self._pp_sync(data)
        else:
            self._all_reduce_prefetch_groups(data, op, self.prefetch_progress_groups)
            if "pp_relay" in self.fixes:
                self._pp_sync(data)
        return data.tolist()

    def _reap_completed_async_work(self) -> None:
        done = 0
        while done < len(self.work_list) and self.work_list[done].is_completed():
            done += 1
        self.work_list = self.work_list[done:]

    # -- agreement points --------------------------------------------------------------------------

    def polls_locally(self) -> bool:
        """Whether this rank's own event polls feed the agreement (with the PP fix: PP rank 0 only)."""
        return "pp_relay" not in self.fixes or self.pp_rank == 0 or self.pp_rank >= self.relay_stages

    def agree_ack_counts(self, local: dict[str, int], in_flight: dict[str, int]) -> dict[str, int]:
        """How many leading acks of each queue ('write', 'load', 'backup') every rank consumes this step, in one
        collective (SGLang batched its write and load counts: +37% input throughput, #33473). `in_flight`: what
        each queue holds on this rank, finished or not."""
        names = [q for q in local if self.mode != "off" and (q != "load" or "agree_loads" in self.fixes)]
        agreed = dict(local)
        if "always_agree" not in self.fixes and not any(in_flight[q] for q in names):
            return agreed  # nothing in flight here: this rank skips the collective its peers may be waiting in
        if names:
            data = torch.tensor([local[q] for q in names], dtype=torch.int64)
            if "pp_relay" in self.fixes:
                self._all_reduce(data, MIN)
            else:
                self._all_reduce_attn_groups(data, MIN)
            agreed.update(zip(names, data.tolist(), strict=True))
        return agreed

    def agree_allocation(self, allocated: bool) -> bool:
        """Whether every rank allocated the slots of one copy (MIN of success), without `alloc_agreement` this
        rank's own outcome. PP rank 0 agrees with its attention peers and relays the verdict down the pipeline."""
        if "alloc_agreement" not in self.fixes or (self.pp_size == 1 and not self._attn_groups()):
            return allocated
        data = torch.tensor([int(allocated)], dtype=torch.int64)
        if "pp_relay" in self.fixes:
            self._all_reduce(data, MIN)
        else:
            self._all_reduce_attn_groups(data, MIN)
        return bool(data.item())

    def agree_host_capacity(self, tokens: int) -> int:
        """Host pool size in tokens, at start. Sized in bytes, stages with fewer layers fit more tokens and would
        evict from the host later than the others: agree on the smallest (MIN over the world; symmetric, and
        safe here, before the scheduler loop)."""
        if "host_capacity_min" not in self.fixes or dist.get_world_size() == 1:
            return tokens
        agreed = torch.tensor([tokens])
        dist.all_reduce(agreed, op=MIN)
        return int(agreed.item())

    def storage_key_cp_rank(self) -> int | None:
        """The CP rank to put in this rank's storage keys: none with the fix (CP peers hold identical KV and share
        keys); without it, its own, so that each peer finds only the pages it wrote."""
        return None if "storage_keys" in self.fixes else get_attn_cp_rank_and_size(self.groups)[0]

    @staticmethod
    def check_consensus(step: int, values: dict[str, int]) -> None:
        """Diagnostic (`--consensus-check K`): all-reduce MIN of [x, -x] over the world; [min, -max] equals
        [x, -x] on every rank iff all ranks hold the same x. Raises ConsensusError naming the first quantity
        that differs. Safe between iterations: no rank needs anything from a later iteration of another stage."""
        data = torch.tensor([*values.values(), *(-v for v in values.values())], dtype=torch.int64)
        dist.all_reduce(data, op=MIN)
        k = len(values)
        for i, quantity in enumerate(values):
            low, high = int(data[i]), -int(data[k + i])
            if low != high:
                raise ConsensusError(f"ranks disagree on {quantity} at step {step}: min {low}, max {high}")
