"""One call of an audited `--sync-impl` function on one rank (`Call`): each torch.distributed operation it makes,
as the routing of audit_patch.py hands it over, with the rules an operation breaks on sight (a peer that is no
rank of the group or of this shard, a receive from a later stage or a send to an earlier one, a send of the
caller's own `data`, a blocking send or a symmetric collective across stages). The rules of a slot, checked as
the call returns, are in audit_slots.py.

A finding is a broken rule: its kind (a key of `MISTAKES`) and one sentence of what this rank did.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .audit_patch import P2P, RECEIVES, SIGNATURES
from .mistakes import MISTAKES, mistake_text


class AuditFinding(RuntimeError):
    """A finding that is wrong in every world: the run stops with it."""


class AuditedWork:
    """A handle of isend/irecv, as the function got it: it forwards everything and remembers a wait."""

    def __init__(self, work, op: dict):
        self._work, self.op, self.waited = work, op, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def group_ranks(group) -> list[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def same_storage(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    )


class Call:
    """One call of an audited function on this rank (`audit`, the rank's `Audit`): the distributed operations it
    made, and its findings."""

    def __init__(self, audit, data: torch.Tensor | None):
        self.audit, self.data = audit, data
        self.ops: list[dict] = []
        self.works: list[AuditedWork] = []
        self.received: list[tuple[dict, torch.Tensor]] = []  # (receive, the tensor it received into)
        self.sent: list[tuple[dict, torch.Tensor, bool]] = []  # (send, its tensor, made while an irecv was unwaited)
        self.receives = 0  # receives of any kind, object lists included
        self.findings: list[dict] = []
        self.facts: dict = {}  # what the slot's rules looked at, for the log line
        self._inside = False  # in an operation: what torch calls inside it is not yours (gloo's send is an isend)

    def find(self, kind: str, what: str, **facts) -> None:
        if not any(f["kind"] == kind for f in self.findings):
            self.findings.append({"kind": kind, "what": what, **facts})

    def observe(self, name: str, original, args, kwargs):
        """One torch.distributed operation of the function (`original` called with `args`, `kwargs`), checked on
        sight, then run, timed and kept; a wrong rank space stops the run before torch waits on a wrong peer."""
        if self._inside:
            return original(*args, **kwargs)
        stage = self.audit.stage
        try:
            params = SIGNATURES[name].bind(*args, **kwargs).arguments
        except TypeError:
            params = {}
        ranks = group_ranks(params.get("group"))
        op = {"op": name, "group": self.audit.group_name(ranks), "stages": sorted({stage(r) for r in ranks})}
        tensor = params.get("tensor")
        if name in P2P:
            self._check_p2p(name, op, params, ranks)
        elif len(op["stages"]) > 1:
            self.find(
                "symmetric_across_stages",
                f"stage {self.audit.layout.pp_rank} called dist.{name} over the {op['group']} (stages {op['stages']})",
                op=name,
                group=op["group"],
            )
        for fatal in (f for f in self.findings if MISTAKES[f["kind"]][0] and f["kind"] == "wrong_rank_space"):
            raise AuditFinding(mistake_text(fatal["kind"], fatal["what"]))
        result = self._run(original, args, kwargs, op)
        if name in RECEIVES:
            self.receives += 1
            if isinstance(tensor, torch.Tensor):
                self.received.append((op, tensor))
        if name in ("isend", "irecv") and result is not None:
            result = AuditedWork(result, op)
            self.works.append(result)
        return result

    def _run(self, original, args, kwargs, op: dict):
        """The operation itself, timed into `op`; what torch calls inside it is not the function's."""
        start, self._inside = time.perf_counter(), True
        try:
            return original(*args, **kwargs)
        finally:
            self._inside = False
            op["ms"] = round(1e3 * (time.perf_counter() - start), 3)
            self.ops.append(op)

    def _check_p2p(self, name: str, op: dict, params: dict, ranks: list[int]) -> None:
        """A send or receive: its peer, in the group's rank space (`group_src`/`group_dst`) or the global one
        (`src`/`dst`), noted in `op` and checked; a send of the caller's `data`, a blocking send across stages."""
        pp_rank, receive = self.audit.layout.pp_rank, name in RECEIVES
        in_group, global_ = ("group_src", "src") if receive else ("group_dst", "dst")
        peer, value, space = None, None, None
        if params.get(in_group) is not None:
            value, space = params[in_group], in_group
            peer = ranks[value] if 0 <= value < len(ranks) else None
        elif params.get(global_) is not None:
            value, space = params[global_], global_
            peer = value if value in ranks else None
        op.update(peer=peer, peer_stage=None if peer is None else self.audit.stage(peer), value=value)
        verb = f"dist.{name}(..., {space}={value}, group={op['group']})" if value is not None else f"dist.{name}"
        self._check_peer(verb, receive, value, space == in_group, peer, ranks)
        if name in ("send", "isend") and isinstance(params.get("tensor"), torch.Tensor):
            pending = any(w.op["op"] == "irecv" and not w.waited for w in self.works)
            self.sent.append((op, params["tensor"], pending))
        if name == "isend" and same_storage(params.get("tensor"), self.data):
            self.find(
                "send_aliases_data",
                f"stage {pp_rank} called dist.isend(data, ...): the tensor it sends is the caller's `data`",
            )
        if name == "send" and len(op["stages"]) > 1:
            self.find("blocking_send", f"stage {pp_rank} called the blocking dist.send")

    def _check_peer(self, verb: str, receive: bool, value, in_group: bool, peer: int | None, ranks: list[int]) -> None:
        """The peer `value` names (`peer`, a global rank, or None for no rank of the group): a rank of this
        group and shard, not this rank, and upstream for a receive, downstream for a send."""
        layout, stage = self.audit.layout, self.audit.stage
        if value is not None and peer is None:
            self.find(
                "wrong_rank_space",
                f"rank {layout.rank} (stage {layout.pp_rank}) called {verb}, but {value} names no rank of that "
                f"group (its global ranks: {ranks})",
            )
        elif in_group and 0 <= value < layout.pp and stage(peer) != value and peer != layout.rank:
            self.find(
                "wrong_rank_space",
                f"rank {layout.rank} (stage {layout.pp_rank}) called {verb}, meaning stage {value}, but there "
                f"{value} is global rank {peer}, on stage {stage(peer)}",
            )
        elif peer == layout.rank:
            self.find("wrong_rank_space", f"rank {layout.rank} called {verb}: that peer is itself")
        elif peer is not None and not self.audit.same_shard(peer):
            self.find(
                "wrong_rank_space",
                f"rank {layout.rank} (stage {layout.pp_rank}) called {verb}: global rank {peer} holds another "
                f"shard, not this rank's pipeline group ({self.audit.pipeline})",
            )
        elif peer is not None and (stage(peer) > layout.pp_rank if receive else stage(peer) < layout.pp_rank):
            self.find(
                "backwards",
                f"stage {layout.pp_rank} called {verb}: it {'waits for' if receive else 'sends to'} stage "
                f"{stage(peer)}, {'after' if receive else 'before'} it in the pipeline",
            )
