"""Deliberate changes to the lab's agreement, each a binder (entrypoints/binders.py) that bends one rank's
`CacheSync`: `compare` (lab/sglang/compare.py) must catch each against sglang 0.5.23's own cache, or it checks
nothing. For the tests and `compare --mutant NAME`; never in a plain run.

* `max_for_min`       - the write-ack count is agreed with MAX where SGLang takes MIN: a rank consumes acks of
                        copies that finished on a peer but not on it (it waits for its own);
* `relay_skips_stage` - the relayed count reaches stage 1 only; later stages keep their own polls (SGLang
                        #22878's relay, right for two stages, wrong for three or more).
"""

from __future__ import annotations

import torch

from ...distributed.cache_sync import MAX
from ...entrypoints.binders import Binder
from ...errors import ConfigError

MUTANTS = ("max_for_min", "relay_skips_stage")
ACTS = {  # mutant -> (whether it can change anything in a world, what the world needs)
    "max_for_min": (
        lambda cfg: cfg.parallel.tp * cfg.parallel.cp > 1,
        "a write-ack count agreed over more than one rank: --tp or --cp above 1",
    ),
    "relay_skips_stage": (lambda cfg: cfg.parallel.pp >= 3, "a relay past stage 1: --pp 3 or more"),
}


def _max_on_writes(sync, agree):
    def agree_ack_counts(local: dict[str, int], in_flight: dict[str, int]) -> dict[str, int]:
        agreed = agree(local, in_flight)
        data = torch.tensor([local["write"]], dtype=torch.int64)
        sync._all_reduce(data, MAX)  # every rank, every step: the collective itself is as sound as the MIN
        return {**agreed, "write": int(data.item())}

    return agree_ack_counts


class Mutant(Binder):
    def __init__(self, name: str):
        assert name in MUTANTS, name
        self.name = name

    def check(self, cfg) -> None:
        """A mutant that cannot act in this world would make `compare` say "equal" of a change it never saw."""
        acts, needs = ACTS[self.name]
        if not cfg.cache.enable_hierarchical_cache or not acts(cfg):
            raise ConfigError(
                f"--mutant {self.name} changes nothing in this world: it needs --enable-hierarchical-cache and {needs}"
            )

    def bind(self, cfg, parts, out_dir):
        sync = parts.sync
        if self.name == "max_for_min":
            sync.agree_ack_counts = _max_on_writes(sync, sync.agree_ack_counts)
        else:
            sync.relay_stages = min(sync.relay_stages, 2)
        return None
