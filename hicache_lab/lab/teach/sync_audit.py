"""What a `--sync-impl` function does, call by call (hooks.py wraps every such function in an `Audit`).

The audit watches the torch.distributed calls your function makes from its own thread (the lab's own threads
pass straight through), then checks the rules of its slot. Each call is one line of `sync_audit_rank{R}.jsonl` in
the run's directory, flushed as it is written, so a run that crashes or hangs keeps what every rank did up to
there: `hicache_lab.lab.teach.exercise` reads these lines to say in words what went wrong.

A finding is a broken rule: its kind (a key of `MISTAKES`, which says why it is wrong) and one sentence of what
this rank did. A finding that is wrong in every world stops the run at once (`SyncImplError`, with the sentence
and the reason). The others are recorded and the run goes on, so that what they cost (a collective that forces
the stages into lockstep) or where they deadlock is measured, not asserted.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

P2P = ("send", "isend", "recv", "irecv", "send_object_list", "recv_object_list")
RECEIVES = ("recv", "irecv", "recv_object_list")
COLLECTIVES = (
    "all_reduce",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
)  # batch_isend_irecv is not here: its P2POps run through isend / irecv, which are

# kind -> (fatal, why it is wrong). The exercise's verdicts and the table in docs/notebooks.md come from here.
MISTAKES = {
    "symmetric_across_stages": (
        False,
        "a symmetric collective over ranks of different stages returns on no stage before every stage has entered "
        "it: the stages are forced into lockstep, and a stage can no longer run ahead of a slower one; only a "
        "one-way relay (receive from the stage before, send to the stage after) may cross stages",
    ),
    "blocking_send": (
        False,
        "a send that waits (dist.send, or an isend waited for at once) holds this stage until the next one "
        "receives: the stages are forced into lockstep; keep the isend's handle in self.work_list and return",
    ),
    "send_aliases_data": (
        True,
        "an isend reads its tensor after the call returns, while the caller is free to change or free `data` (on a "
        "GPU its memory goes back to the caching allocator for the next tensor): the next stage may receive "
        "other values; send data.clone()",
    ),
    "lost_send_handle": (
        True,
        "nothing waits for a send whose handle is dropped: the lab waits for the previous step's sends at the "
        "start of every check (self.work_list), which bounds how far a stage runs ahead and keeps the clone alive "
        "until it is sent",
    ),
    "recv_not_waited": (
        True,
        "an irecv returns before the message arrives: the caller reads `data` too early; use dist.recv, or wait "
        "for the handle before returning",
    ),
    "recv_elsewhere": (
        True,
        "the caller reads the agreed values from `data` itself: receive into `data` (or copy into it with "
        "data.copy_(...)); rebinding the name changes nothing the caller sees",
    ),
    "no_receive": (
        False,
        "every stage after the first must end the call holding PP rank 0's values: a stage that receives nothing "
        "keeps the zeros it was given and consumes different acks from stage 0",
    ),
    "backwards": (
        False,
        "the counts flow one way, from stage 0 down the pipeline: a stage that waits for a later stage waits for "
        "a message that stage only sends after it has itself received (or never)",
    ),
    "wrong_rank_space": (
        True,
        "group_src= / group_dst= are ranks within the group (in the pipeline group: stage numbers), src= / dst= "
        "are global ranks; with one rank per stage (--tp 1) the two coincide, with --tp 2 they do not",
    ),
    "wrong_ack_count": (
        True,
        "every rank must consume exactly the agreed `count` acks: fewer leaves this rank's nodes locked longer than "
        "the others', more unlocks nodes the others keep; either way the trees, then the batches, differ",
    ),
    "acks_out_of_order": (
        True,
        "acks are consumed from the head of the queue, oldest first (it is FIFO, like the copy stream it records): "
        "the agreed count counts the *leading* finished acks, so an ack taken from further back may belong to a "
        "copy that has not finished on PP rank 0, and nodes published out of order reach the storage tier and the "
        "tree's bookkeeping in another order than on the ranks that kept it",
    ),
    "copy_not_waited": (
        False,
        "the agreed count says the copy has finished on PP rank 0, not here: a rank must wait for its own copy "
        "(ack.finish_event.synchronize()) before it unlocks the node, or the host holds a copy still being written",
    ),
    "lock_leaked": (
        True,
        "a write-through holds a lock on its node (and the node's ancestors) until its ack is consumed: a node "
        "taken out of ongoing_write_through without self.dec_lock_ref(node) stays locked for good, can never be "
        "evicted, and the device pool fills with locked nodes",
    ),
    "lock_released_twice": (
        True,
        "each consumed write releases the one lock its write-through took: releasing more unlocks a node a running "
        "request or another copy still holds",
    ),
    "node_left_in_flight": (
        True,
        "a consumed ack's nodes must leave ongoing_write_through: the lab would count them as still in flight",
    ),
    "node_not_published": (
        True,
        "each consumed node goes to self.publish_write(node): it settles the halves split off the node while its "
        "write was in flight and hands the node to the storage tier for backup; without it L3 never sees the node",
    ),
    "wrong_node_taken": (
        True,
        "only the nodes of the consumed acks may leave ongoing_write_through: the others' writes are still running",
    ),
    "group_spans_stages": (
        False,
        "only PP rank 0 agrees over the attention groups (later stages receive its result by the relay): a group "
        "with ranks of other stages is entered by stage 0 alone, which waits there for peers that never come, a "
        "deadlock",
    ),
    "missing_group": (
        False,
        "PP rank 0 must agree with every rank that holds the same request's KV: its attention-TP peers (heads "
        "split) and its attention-CP peers (the sequence split); a peer left out polls its own copies and takes "
        "different decisions",
    ),
    "not_groups": (True, "attn_groups must return a list of process groups (those of self.groups)"),
}


def mistake_text(kind: str, what: str) -> str:
    return f"{what}: {MISTAKES[kind][1]}"


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


_active = threading.local()  # .call: the Call running on this thread, if any
_signatures: dict[str, inspect.Signature] = {}


def patch_torch_distributed() -> None:
    """Route every torch.distributed call through the audit (once per process; a call made outside an audited
    function goes straight to torch). Done before a `--sync-impl` module is imported, so that a name it imports
    from torch.distributed is the routed one too."""
    for name in P2P + COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "_audited", False):
            continue
        _signatures[name] = inspect.signature(original)

        def routed(*args, _name=name, _original=original, **kwargs):
            call = getattr(_active, "call", None)
            if call is None:
                return _original(*args, **kwargs)
            return call.observe(_name, _original, args, kwargs)

        routed._audited = True
        routed.__doc__, routed.__name__, routed.__qualname__ = original.__doc__, name, name
        routed.__code__ = routed.__code__.replace(co_name=name)  # a stack or a timeout names the torch function
        setattr(dist, name, routed)
        if getattr(c10d, name, None) is original:
            setattr(c10d, name, routed)  # P2POp and batch_isend_irecv compare their op with c10d's isend / irecv


def _group_ranks(group) -> list[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _same_storage(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    )


class Call:
    """One call of an audited function on this rank: the distributed operations it made, and its findings."""

    def __init__(self, audit: Audit, data: torch.Tensor | None):
        self.audit, self.data = audit, data
        self.ops: list[dict] = []
        self.works: list[AuditedWork] = []
        self.received: list[tuple[dict, torch.Tensor]] = []  # (receive, the tensor it received into)
        self.receives = 0  # receives of any kind, object lists included
        self.findings: list[dict] = []
        self.facts: dict = {}  # what the slot's rules looked at, for the log line

    def find(self, kind: str, what: str, **facts) -> None:
        if not any(f["kind"] == kind for f in self.findings):
            self.findings.append({"kind": kind, "what": what, **facts})

    def observe(self, name: str, original, args, kwargs):
        layout, stage = self.audit.layout, self.audit.stage
        try:
            params = _signatures[name].bind(*args, **kwargs).arguments
        except TypeError:
            params = {}
        ranks = _group_ranks(params.get("group"))
        op = {"op": name, "group": self.audit.group_name(ranks), "stages": sorted({stage(r) for r in ranks})}
        tensor = params.get("tensor")
        if name in P2P:
            receive = name in RECEIVES
            in_group, global_ = ("group_src", "src") if receive else ("group_dst", "dst")
            peer, value, space = None, None, None
            if params.get(in_group) is not None:
                value, space = params[in_group], in_group
                peer = ranks[value] if 0 <= value < len(ranks) else None
            elif params.get(global_) is not None:
                value, space = params[global_], global_
                peer = value if value in ranks else None
            op.update(peer=peer, peer_stage=None if peer is None else stage(peer), value=value)
            verb = f"dist.{name}(..., {space}={value}, group={op['group']})" if value is not None else f"dist.{name}"
            if value is not None and peer is None:
                self.find(
                    "wrong_rank_space",
                    f"rank {layout.rank} (stage {layout.pp_rank}) called {verb}, but {value} names no rank of that "
                    f"group (its global ranks: {ranks})",
                )
            elif space == in_group and 0 <= value < layout.pp and stage(peer) != value and peer != layout.rank:
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
            if name == "isend" and _same_storage(tensor, self.data):
                self.find(
                    "send_aliases_data",
                    f"stage {layout.pp_rank} called dist.isend(data, ...): the tensor it sends is the caller's `data`",
                )
            if name == "send" and len(op["stages"]) > 1:
                self.find("blocking_send", f"stage {layout.pp_rank} called the blocking dist.send")
        elif len(op["stages"]) > 1:
            self.find(
                "symmetric_across_stages",
                f"stage {layout.pp_rank} called dist.{name} over the {op['group']} (stages {op['stages']})",
                op=name,
                group=op["group"],
            )
        for fatal in (f for f in self.findings if MISTAKES[f["kind"]][0] and f["kind"] == "wrong_rank_space"):
            raise AuditFinding(mistake_text(fatal["kind"], fatal["what"]))  # before torch waits on a wrong peer
        start = time.perf_counter()
        try:
            result = original(*args, **kwargs)
        finally:
            op["ms"] = round(1e3 * (time.perf_counter() - start), 3)
            self.ops.append(op)
        if name in RECEIVES:
            self.receives += 1
            if isinstance(tensor, torch.Tensor):
                self.received.append((op, tensor))
        if name in ("isend", "irecv") and result is not None:
            result = AuditedWork(result, op)
            self.works.append(result)
        return result


class Audit:
    """One rank's audit of every `--sync-impl` function: `wrap(slot, fn, owner)` gives the function to call."""

    def __init__(self, out_dir: Path | None, groups):
        self.layout = groups.layout
        self.groups = groups
        lists = groups.layout.group_rank_lists()
        mine = {kind: next(r for r in rank_lists if self.layout.rank in r) for kind, rank_lists in lists.items()}
        self.pipeline = mine["pp"]
        names = {"attn_tp": "attention-TP group", "attn_cp": "attention-CP group", "pp": "pipeline group"}
        self.names = {tuple(ranks): names[kind] for kind, ranks in mine.items() if len(ranks) > 1}
        self.attention = {kind: mine[kind] for kind in ("attn_tp", "attn_cp") if len(mine[kind]) > 1}
        self.calls: dict[str, int] = {}
        self.file = None
        if out_dir is not None:
            path = Path(out_dir) / f"sync_audit_rank{self.layout.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("w")  # noqa: SIM115 - one line per call, closed with the process

    def stage(self, rank: int) -> int:
        return rank // (self.layout.tp * self.layout.cp)

    def same_shard(self, rank: int) -> bool:
        return rank in self.pipeline

    def group_name(self, ranks: list[int]) -> str:
        if tuple(ranks) in self.names:
            return self.names[tuple(ranks)]
        return "world group" if len(ranks) == dist.get_world_size() else f"group of ranks {ranks}"

    def wrap(self, slot: str, fn, owner):
        def audited(*args):
            n = self.calls[slot] = self.calls.get(slot, -1) + 1
            call = Call(self, args[0] if slot == "pp_sync" else None)
            before = self._before_writing_check(owner) if slot == "writing_check" else None
            kept = list(owner.work_list) if slot == "pp_sync" else []  # the handles of earlier calls
            _active.call = call
            start = time.perf_counter()
            try:
                value = fn(*args)
            except BaseException:
                self._log(slot, n, 1e3 * (time.perf_counter() - start), call)  # what it did before it raised
                raise
            finally:
                _active.call = None
                if before is not None:
                    del owner.publish_write  # the method again
            ms = 1e3 * (time.perf_counter() - start)
            if slot == "writing_check":
                self._after_writing_check(call, owner, args[0], before)
            elif slot == "pp_sync":
                self._after_pp_sync(call, owner, args[0], kept)
            else:
                value = self._after_attn_groups(call, value)
            self._log(slot, n, ms, call)
            for finding in call.findings:
                if MISTAKES[finding["kind"]][0]:
                    raise AuditFinding(mistake_text(finding["kind"], finding["what"]))
            return value

        return audited

    def _log(self, slot: str, n: int, ms: float, call: Call) -> None:
        if self.file is None or (slot == "attn_groups" and not call.findings):
            return  # attn_groups is asked many times a step: only what it got wrong is worth a line
        line = {"slot": slot, "call": n, "stage": self.layout.pp_rank, "ms": round(ms, 3), "end": time.time()}
        line |= {**call.facts, "ops": call.ops}
        self.file.write(json.dumps({**line, "findings": call.findings}) + "\n")
        self.file.flush()

    # -- the rules of each slot ---------------------------------------------------------------------

    def _after_pp_sync(self, call: Call, sync, data, earlier: list) -> None:
        stage = self.layout.pp_rank
        kept = {id(w) for w in sync.work_list}
        dropped = [w for w in earlier if id(w) not in kept and isinstance(w, AuditedWork) and not w.waited]
        if dropped:
            call.find(
                "lost_send_handle",
                f"stage {stage}'s pp_sync dropped {len(dropped)} handle(s) of earlier sends from self.work_list "
                "(append to it: do not replace it)",
            )
        for work in call.works:
            if work.op["op"] == "isend" and id(work) not in kept and not work.waited:
                call.find("lost_send_handle", f"stage {stage}'s isend handle was not kept in self.work_list")
            elif work.op["op"] == "isend" and work.waited:
                call.find("blocking_send", f"stage {stage} waited for its own isend before returning")
            elif work.op["op"] == "irecv" and not work.waited:
                call.find("recv_not_waited", f"stage {stage} returned without waiting for its irecv")
        for _, tensor in call.received:
            if not _same_storage(tensor, data) and not torch.equal(tensor.to(data.device), data):
                call.find(
                    "recv_elsewhere",
                    f"stage {stage} received {tensor.tolist()} into another tensor, and `data` still holds "
                    f"{data.tolist()}",
                )
        crossed = any(len(op["stages"]) > 1 for op in call.ops)
        if 0 < stage < sync.relay_stages and not call.receives and not crossed:
            call.find("no_receive", f"stage {stage} made no receive in pp_sync", data=data.tolist())

    def _after_attn_groups(self, call: Call, value) -> list:
        """The groups `value` holds, as the list the caller gets (an iterator is read once, here)."""
        try:
            groups = list(value)
            rank_sets = [tuple(_group_ranks(group)) for group in groups]
        except (TypeError, ValueError, RuntimeError):
            call.find("not_groups", f"attn_groups returned {value!r}")
            return value
        for ranks in rank_sets:
            if len({self.stage(r) for r in ranks}) > 1:
                call.find(
                    "group_spans_stages",
                    f"attn_groups on rank {self.layout.rank} returned the {self.group_name(list(ranks))}, with ranks "
                    f"of stages {sorted({self.stage(r) for r in ranks})}",
                )
        covered = {r for ranks in rank_sets for r in ranks}
        for ranks in self.attention.values():
            if not set(ranks) <= covered:
                call.find(
                    "missing_group",
                    f"attn_groups on rank {self.layout.rank} left out its {self.names[tuple(ranks)]} (ranks {ranks})",
                )
        return groups

    @staticmethod
    def _before_writing_check(cache) -> dict:
        queue = list(cache.controller.ack_write_queue)
        ongoing = dict(cache.ongoing_write_through)
        published: list[int] = []
        cache.publish_write = lambda node, _publish=cache.publish_write: (published.append(node.id), _publish(node))
        return {
            "queue": queue,
            "ongoing": ongoing,
            "locks": {i: node.lock_ref for i, node in ongoing.items()},
            "finished": [ack.finish_event.query() for ack in queue],
            "published": published,
        }

    def _after_writing_check(self, call: Call, cache, count: int, before: dict) -> None:
        stage, queue = self.layout.pp_rank, before["queue"]
        call.facts = {"count": count, "queued": len(queue), "finished": sum(before["finished"])}
        left = {id(ack) for ack in cache.controller.ack_write_queue}
        taken = [i for i, ack in enumerate(queue) if id(ack) not in left]
        if len(taken) != count:
            call.find(
                "wrong_ack_count",
                f"stage {stage} consumed {len(taken)} write acks where every rank agreed on {count} "
                f"({len(queue)} in its queue)",
            )
        position = {node_id: i for i, ack in enumerate(queue) for node_id in ack.node_ids}
        order = list(dict.fromkeys(position[i] for i in before["published"] if i in position))
        if taken != list(range(len(taken))):
            call.find(
                "acks_out_of_order",
                f"stage {stage} consumed the acks at positions {taken} of its queue, not the first {len(taken)}",
            )
        elif order != sorted(order):
            call.find(
                "acks_out_of_order",
                f"stage {stage} consumed the acks at positions {order} of its queue in that order, not oldest first",
            )
        acks = [queue[i] for i in taken]
        unfinished = [ack.node_ids for ack in acks if not ack.finish_event.query()]
        if unfinished:
            call.find(
                "copy_not_waited",
                f"stage {stage} consumed the acks of nodes {unfinished[:3]} while their host copies were still "
                "being written on this rank",
            )
        consumed = [i for ack in acks for i in ack.node_ids]
        expected = dict.fromkeys(consumed, 0)
        for i in consumed:  # a release walks up to the root: an ancestor loses one lock per consumed descendant
            node = before["ongoing"].get(i)
            while node is not None:
                if node.id in expected:
                    expected[node.id] += 1
                node = node.parent
        for i in consumed:
            node = before["ongoing"].get(i)
            if node is None:
                continue
            if i in cache.ongoing_write_through:
                call.find("node_left_in_flight", f"stage {stage} left node {i} in ongoing_write_through")
            released = before["locks"][i] - node.lock_ref
            if released < expected[i]:
                call.find(
                    "lock_leaked",
                    f"stage {stage} took node {i} ({len(node.key)} tokens) out of ongoing_write_through, but its "
                    f"write-through lock was not released (lock_ref {node.lock_ref}, expected "
                    f"{before['locks'][i] - expected[i]})",
                )
            elif released > expected[i]:
                call.find(
                    "lock_released_twice",
                    f"stage {stage} released node {i}'s lock {released} times (lock_ref {before['locks'][i]} -> "
                    f"{node.lock_ref})",
                )
            if i not in before["published"]:
                call.find("node_not_published", f"stage {stage} did not call self.publish_write on node {i}")
        others = [i for i in before["ongoing"] if i not in expected and i not in cache.ongoing_write_through]
        if others:
            call.find(
                "wrong_node_taken",
                f"stage {stage} took nodes {others[:3]} out of ongoing_write_through, whose acks it did not consume",
            )
