"""A protocol as a plug-in: stage 0's agreed ack counts travel with the activations, not in a relay of their own.

Under the PP fix, PP rank 0 agrees each step how many write, load (and storage) acks every rank consumes, then
`CacheSync._pp_sync` relays the counts down the pipeline: one more message per stage boundary per step. Every stage
before the last already sends its successor a [rows, cols] header with the activations (`StageLoop.send_hidden`);
here the counts ride in that header instead. A later stage receives the header at its own agreement (its
`agree_ack_counts`), takes the counts from it, and keeps the shape for the activations that follow
(`recv_hidden`); it passes the counts on in its own header. The trade: a stage now waits for its predecessor's
forward, not only its scheduling, before it schedules.

    python -m hicache_lab run --pp 2 --enable-hierarchical-cache --plugin examples/relay_in_header.py:PLUGIN
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hicache_lab.distributed.parallel_state import recv
from hicache_lab.entrypoints.binders import Binder
from hicache_lab.errors import require


class RelayInHeader(Binder):
    differences = ("relay_sent",)  # what it changes against the lab's protocol: no relay sends

    def check(self, cfg) -> None:
        require(
            cfg.cache.enable_hierarchical_cache,
            "relay_in_header carries the host tier's acks: add --enable-hierarchical-cache",
        )
        require(
            "always_agree" in cfg.parallel.fixes and "pp_relay" in cfg.parallel.fixes,
            "relay_in_header replaces the PP relay of --sync fixed: drop --sync or --disable-fix",
        )

    def bind(self, cfg, parts, out_dir) -> None:
        loop, sync = parts.loop, parts.sync
        if loop.pp_size == 1:
            return None
        state = {"counts": None, "shape": None}
        agree, relay = sync.agree_ack_counts, sync._pp_sync

        def carried(data: torch.Tensor) -> None:  # the relay, during the step's agreement only
            if loop.pp_rank > 0:
                header = torch.zeros(2 + len(data), dtype=torch.int64)
                dist.recv(header, group_src=loop.pp_rank - 1, group=loop.groups.pp_control)
                state["shape"], data[:] = header[:2].tolist(), header[2:]
            state["counts"] = data.clone()

        def agree_ack_counts(local, in_flight):
            sync._pp_sync = carried
            try:
                return agree(local, in_flight)
            finally:
                sync._pp_sync = relay

        def send_hidden(hidden: torch.Tensor) -> None:
            header = torch.cat([torch.tensor(hidden.shape, dtype=torch.int64), state["counts"]])
            loop.send_async(header, loop.pp_rank + 1, loop.groups.pp_control)
            if hidden.numel():
                loop.send_async(hidden.contiguous(), loop.pp_rank + 1, loop.groups.pp_compute)

        def recv_hidden() -> torch.Tensor:
            model = loop.model
            hidden = torch.zeros(*state["shape"], device=model.device, dtype=model.dtype)
            if hidden.numel():
                recv(hidden, loop.pp_rank - 1, loop.groups.pp_compute)
            return hidden

        sync.agree_ack_counts = agree_ack_counts
        loop.send_hidden, loop.recv_hidden = send_hidden, recv_hidden
        return None


PLUGIN = RelayInHeader()
