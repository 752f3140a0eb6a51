"""Exercise 1's answer: the one-way relay, stage by stage (what SGLang's PP fix does in `_pp_sync`)."""

import torch.distributed as dist


def pp_sync(self, data):
    if self.pp_size <= 1:
        return
    group = self.groups.pp_cache_group
    if self.pp_rank > 0:  # every stage but the first waits for the previous stage's values
        dist.recv(data, group_src=self.pp_rank - 1, group=group, tag=2)
    if self.pp_rank + 1 < self.pp_size:  # every stage but the last passes them on, without waiting
        self.work_list.append(dist.isend(data.clone(), group_dst=self.pp_rank + 1, group=group, tag=2))
