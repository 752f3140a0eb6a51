"""Wrong answers to exercise 3 (`attn_groups`); see pp_sync.py beside this file."""


def attention_tp_only(self):
    """The legacy cache group: attention-TP alone, CP peers left out."""
    return [self.groups.attn_tp_group]


def with_the_pipeline(self):
    """Every group this rank belongs to, the pipeline group too."""
    return [self.groups.attn_cp_group, self.groups.attn_tp_group, self.groups.pp_cache_group]


def the_ranks_not_the_groups(self):
    """Rank lists where groups go."""
    return [[0, 1]]
