"""Wrong answers to exercise 1 (`pp_sync`), each one a mistake students make. `python -m hicache_lab exercise
--pp-sync teaching/mistakes/pp_sync.py:NAME` shows what the check says of each (tests/lab/test_exercise.py pins
the cause it names). One variant passes, with a note: `star`, notebook 06's design question's, which is not
the glossary's chain."""

import torch
import torch.distributed as dist

from hicache_lab.lab.teach.questions import star  # noqa: F401 (a variant that passes with a note: no chain)


def two_stages_only(self, data):
    """Right for two stages, wrong for three: stage 2 never hears from stage 1."""
    group = self.groups.pp_cache_group
    if self.pp_rank == 0 and self.pp_size > 1:
        self.work_list.append(dist.isend(data.clone(), group_dst=1, group=group, tag=2))
    elif self.pp_rank == 1:
        dist.recv(data, group_src=0, group=group, tag=2)


def all_reduce_max(self, data):
    """A symmetric collective across the stages: stage 0's counts are the MAX of its values and the zeros."""
    if self.pp_size > 1:
        dist.all_reduce(data, op=dist.ReduceOp.MAX, group=self.groups.pp_cache_group)


def broadcast_from_stage_0(self, data):
    """Another symmetric collective: every stage enters the broadcast at every step."""
    if self.pp_size > 1:
        dist.broadcast(data, group_src=0, group=self.groups.pp_cache_group)


def blocking_send(self, data):
    """The relay with a send that waits for the next stage to receive."""
    group = self.groups.pp_cache_group
    if self.pp_rank > 0:
        dist.recv(data, group_src=self.pp_rank - 1, group=group, tag=2)
    if self.pp_rank + 1 < self.pp_size:
        dist.send(data, group_dst=self.pp_rank + 1, group=group, tag=2)


def sends_data_itself(self, data):
    """The relay, sending the caller's tensor instead of a copy."""
    group = self.groups.pp_cache_group
    if self.pp_rank > 0:
        dist.recv(data, group_src=self.pp_rank - 1, group=group, tag=2)
    if self.pp_rank + 1 < self.pp_size:
        self.work_list.append(dist.isend(data, group_dst=self.pp_rank + 1, group=group, tag=2))


def drops_the_handle(self, data):
    """The relay, without keeping the send's handle."""
    group = self.groups.pp_cache_group
    if self.pp_rank > 0:
        dist.recv(data, group_src=self.pp_rank - 1, group=group, tag=2)
    if self.pp_rank + 1 < self.pp_size:
        dist.isend(data.clone(), group_dst=self.pp_rank + 1, group=group, tag=2)


def global_ranks(self, data):
    """Stage numbers passed as global ranks (src= / dst=): right while --tp is 1."""
    group = self.groups.pp_cache_group
    if self.pp_rank > 0:
        dist.recv(data, src=self.pp_rank - 1, group=group, tag=2)
    if self.pp_rank + 1 < self.pp_size:
        self.work_list.append(dist.isend(data.clone(), dst=self.pp_rank + 1, group=group, tag=2))


def world_group(self, data):
    """Stage numbers on the world group: right while --tp is 1."""
    if self.pp_rank > 0:
        dist.recv(data, group_src=self.pp_rank - 1, tag=2)
    if self.pp_rank + 1 < self.pp_size:
        self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank + 1, tag=2))


def irecv_without_wait(self, data):
    """A non-blocking receive, returned before the message is in."""
    group = self.groups.pp_cache_group
    if self.pp_rank > 0:
        self.work_list.append(dist.irecv(data, group_src=self.pp_rank - 1, group=group, tag=2))
    if self.pp_rank + 1 < self.pp_size:
        self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank + 1, group=group, tag=2))


def receives_into_a_new_tensor(self, data):
    """Receives into a tensor of its own, then rebinds the name."""
    group = self.groups.pp_cache_group
    if self.pp_rank > 0:
        received = torch.empty_like(data)
        dist.recv(received, group_src=self.pp_rank - 1, group=group, tag=2)
        data = received
    if self.pp_rank + 1 < self.pp_size:
        self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank + 1, group=group, tag=2))


def upstream(self, data):
    """The relay the wrong way round: each stage receives from the next and sends to the previous."""
    group = self.groups.pp_cache_group
    if self.pp_rank + 1 < self.pp_size:
        dist.recv(data, group_src=self.pp_rank + 1, group=group, tag=2)
    if self.pp_rank > 0:
        self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank - 1, group=group, tag=2))


def middle_stage_keeps_it(self, data):
    """Every later stage receives, but only stage 0 sends: stage 2 waits for stage 1."""
    group = self.groups.pp_cache_group
    if self.pp_rank > 0:
        dist.recv(data, group_src=self.pp_rank - 1, group=group, tag=2)
    if self.pp_rank == 0 and self.pp_size > 1:
        self.work_list.append(dist.isend(data.clone(), group_dst=1, group=group, tag=2))


def forwards_before_receiving(self, data):
    """An "overlapped" relay: receive with irecv, forward a copy at once, wait for the receive after: right for two
    stages, but stage 1 forwards the zeros it was given."""
    group = self.groups.pp_cache_group
    receive = dist.irecv(data, group_src=self.pp_rank - 1, group=group, tag=2) if self.pp_rank > 0 else None
    if self.pp_rank + 1 < self.pp_size:
        self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank + 1, group=group, tag=2))
    if receive is not None:
        receive.wait()


def handshake(self, data):
    """The relay, then a confirmation back, "so that stage 0 knows every stage has the counts": the last stage
    sends one to stage 0, which waits for it."""
    group, last = self.groups.pp_cache_group, self.pp_size - 1
    if self.pp_rank > 0:
        dist.recv(data, group_src=self.pp_rank - 1, group=group, tag=2)
    if self.pp_rank < last:
        self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank + 1, group=group, tag=2))
    if self.pp_rank == last and last > 0:
        self.work_list.append(dist.isend(torch.ones(1, dtype=torch.int64), group_dst=0, group=group, tag=3))
    elif self.pp_rank == 0 and last > 0:
        dist.recv(torch.empty(1, dtype=torch.int64), group_src=last, group=group, tag=3)


def calls_the_labs_own(self, data):
    """The lab's own relay called from the student's function: it passes every world and is not an answer."""
    from hicache_lab.distributed.cache_sync import CacheSync

    CacheSync._pp_sync(self, data)
