"""A plug-in that breaks agreement on purpose, to show the checks catch it: the last stage still takes part in the
step's agreement, then consumes the acks its own copies finished instead of the count PP rank 0 agreed on (the bug
the PP fix removed, brought back by one binding).

    python -m hicache_lab run --pp 2 --enable-hierarchical-cache --plugin examples/breaks_agreement.py:PLUGIN
"""

from __future__ import annotations

from hicache_lab.entrypoints.binders import Binder


class TrustsItsOwnCopies(Binder):
    def bind(self, cfg, parts, out_dir) -> None:
        sync, cache = parts.sync, parts.cache
        if sync.pp_size > 1 and sync.pp_rank == sync.pp_size - 1:
            agree = sync.agree_ack_counts

            def own_counts(local, in_flight):
                agreed = agree(local, in_flight)  # its peers still meet it in the collective and the relay
                write, load = cache.ready  # what this rank's own copies finished (HiRadixCache.ready)
                return {**agreed, "write": write, "load": load}

            sync.agree_ack_counts = own_counts
        return None


PLUGIN = TrustsItsOwnCopies()
