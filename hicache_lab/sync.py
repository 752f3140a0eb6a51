"""Every cross-rank agreement the cache makes, readable top to bottom.

A rank-local observation (how many of my host writes have finished?) becomes an agreed value before the tree
changes, so that every rank takes identical cache decisions. The modes:

* `off`    - no agreement: each rank trusts its own polls.
* `legacy` - SGLang before both fixes: write acks agreed (MIN) over the attention-TP group only; load acks
             not agreed; no relay down the pipeline.
* `fixed`  - both fixes: only PP rank 0 polls; it agrees with its attention-CP and attention-TP peers; the
             count is relayed down the pipeline (`_pp_sync`); every rank consumes exactly that many acks,
             waiting on its own copies where they are not done yet.

Rules every path obeys: each rank enters every collective of a step in the same order (a rank-local early
return before a collective deadlocks), and no symmetric collective spans PP stages in the scheduler loop
(stages are not in lockstep, so it deadlocks): only the one-way relay crosses stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .parallel import Groups, group_rank_and_size

MIN = dist.ReduceOp.MIN


class CacheSync:
    def __init__(self, mode: str, groups: Groups):
        self.mode = mode
        self.groups = groups
        self.pp_rank, self.pp_size = group_rank_and_size(groups.pp_cache_group)
        self.work_list: list[dist.Work] = []  # outstanding relay sends, drained once a round

    def get_attn_cp_rank_and_size(self) -> tuple[int, int]:
        return group_rank_and_size(self.groups.attn_cp_group)

    # -- primitives (SGLang's names) ---------------------------------------------------------------

    def _attn_groups(self) -> list:
        """The attention-CP then attention-TP group, size-1 groups skipped; the TP group if both are."""
        chosen = [g for g in (self.groups.attn_cp_group, self.groups.attn_tp_group) if group_rank_and_size(g)[1] > 1]
        if chosen or group_rank_and_size(self.groups.tp_group)[1] == 1:
            return chosen
        return [self.groups.tp_group]

    def _all_reduce_attn_groups(self, data: torch.Tensor, op) -> None:
        for group in self._attn_groups():
            dist.all_reduce(data, op=op, group=group)

    def _barrier_attn_groups(self) -> None:
        for group in self._attn_groups():
            dist.barrier(group=group)

    def _pp_sync(self, data: torch.Tensor) -> None:
        """One-way relay: receive from the previous stage (blocking), send a clone to the next (async)."""
        if self.pp_size <= 1:
            return
        group = self.groups.pp_cache_group
        if self.pp_rank > 0:
            dist.recv(data, group_src=self.pp_rank - 1, group=group, tag=2)
        if self.pp_rank + 1 < self.pp_size:
            self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank + 1, group=group, tag=2))

    def _all_reduce(self, data: torch.Tensor, op) -> None:
        """Agreement on PP rank 0 over its attention groups, then relayed down the pipeline."""
        if self.pp_rank == 0:
            self._all_reduce_attn_groups(data, op)
        self._pp_sync(data)

    def drain_async_work(self) -> None:
        """Wait for the previous round's relay sends (bounded memory, unlike polling behind a lagging stage)."""
        for work in self.work_list:
            work.wait()
        self.work_list = []

    # -- agreement points --------------------------------------------------------------------------

    def polls_locally(self) -> bool:
        """Whether this rank's own event polls feed the agreement (fixed: PP rank 0 only)."""
        return self.mode != "fixed" or self.pp_rank == 0

    def agree_ack_count(self, local: int, queue: str) -> int:
        """How many leading acks of `queue` ('write' or 'load') every rank consumes this step."""
        if self.mode == "off" or (self.mode == "legacy" and queue == "load"):
            return local
        count = torch.tensor([local], dtype=torch.int64)
        if self.mode == "legacy":
            if group_rank_and_size(self.groups.attn_tp_group)[1] > 1:
                dist.all_reduce(count, op=MIN, group=self.groups.attn_tp_group)
        else:
            self._all_reduce(count, MIN)
        return int(count.item())
