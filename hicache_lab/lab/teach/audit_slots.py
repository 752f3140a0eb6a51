"""The rules of each `--sync-impl` slot, checked as an audited call returns (`Audit.wrap`, sync_audit.py calls
them): what the call left behind against what it was given. Each broken rule is a finding of the call
(audit_call.py); `audit` is the rank's `Audit`."""

from __future__ import annotations

import torch

from .audit_call import AuditedWork, Call, group_ranks, same_storage


def pp_sync_rules(audit, call: Call, sync, data, earlier: list) -> None:
    """pp_sync: its send handles kept (`earlier`: those in `sync.work_list` before the call), its receives waited
    for and made into `data`, a receive on every later stage."""
    stage = audit.layout.pp_rank
    kept = {id(w) for w in sync.work_list}
    dropped = [w for w in earlier if id(w) not in kept and isinstance(w, AuditedWork) and not w.waited]
    if dropped:
        call.find(
            "lost_send_handle",
            f"stage {stage}'s pp_sync removed {len(dropped)} handle(s) of earlier sends from self.work_list",
        )
    for work in call.works:
        if work.op["op"] == "isend" and id(work) not in kept and not work.waited:
            call.find("lost_send_handle", f"stage {stage} dropped the handle its isend returned")
        elif work.op["op"] == "isend" and work.waited:
            call.find("blocking_send", f"stage {stage} waited for its own isend before returning")
        elif work.op["op"] == "irecv" and not work.waited:
            call.find("recv_not_waited", f"stage {stage} returned without waiting for its irecv")
    for op, tensor in call.received:
        if op.get("peer_stage", -1) > stage:
            continue  # a receive from a later stage is no relay's (`backwards`), whatever it receives into
        if not same_storage(tensor, data) and not torch.equal(tensor.to(data.device), data):
            call.find(
                "recv_elsewhere",
                f"stage {stage} received {tensor.tolist()} into another tensor, and `data` still holds {data.tolist()}",
            )
    forwarded_rule(stage, call, data)
    crossed = any(len(op["stages"]) > 1 for op in call.ops)
    if 0 < stage < sync.relay_stages and not call.receives and not crossed:
        call.find("no_receive", f"stage {stage} made no receive in pp_sync", data=data.tolist())


def forwarded_rule(stage: int, call: Call, data) -> None:
    """A stage that received into `data` forwards what it received: each send to a later stage is made once the
    receive has completed (no irecv still unwaited), and carries the values `data` ends the call holding."""
    into_data = [op for op, tensor in call.received if same_storage(tensor, data)]
    if not into_data:
        return
    source = into_data[0].get("peer_stage")
    for op, tensor, pending in call.sent:
        if op.get("peer_stage") is None or op["peer_stage"] <= stage:
            continue
        same = tensor.shape == data.shape and torch.equal(tensor.to(data.device), data)
        if same and (not pending or not data.any()):
            continue  # forwarded what it received, or zeros that stage 0 sent too: nothing to show yet
        unwaited = " (its irecv not yet waited for)" if pending else ""
        same_values = " (the same values, this time)" if same else ""
        what = (
            f"stage {stage} sent {tensor.tolist()} to stage {op['peer_stage']} before its own receive from stage "
            f"{source} had completed{unwaited}, and ended the call holding {data.tolist()}{same_values}"
        )
        call.find("forwarded_before_receive", what)


def attn_groups_rules(audit, call: Call, value) -> list:
    """attn_groups: process groups within one stage, covering every attention peer. Returns the groups `value`
    holds, as the list the caller gets (an iterator is read once, here)."""
    try:
        groups = list(value)
        rank_sets = [tuple(group_ranks(group)) for group in groups]
    except (TypeError, ValueError, RuntimeError):
        call.find("not_groups", f"attn_groups returned {value!r}")
        return value
    for ranks in rank_sets:
        if len({audit.stage(r) for r in ranks}) > 1:
            call.find(
                "group_spans_stages",
                f"attn_groups on rank {audit.layout.rank} returned the {audit.group_name(list(ranks))}, with ranks "
                f"of stages {sorted({audit.stage(r) for r in ranks})}",
            )
    covered = {r for ranks in rank_sets for r in ranks}
    for ranks in audit.attention.values():
        if not set(ranks) <= covered:
            call.find(
                "missing_group",
                f"attn_groups on rank {audit.layout.rank} left out its {audit.names[tuple(ranks)]} (ranks {ranks})",
            )
    return groups


def writing_check_before(cache) -> dict:
    """What `writing_check(count)` starts from: the ack queue, the writes in flight and their locks; from here on
    each `publish_write` is counted (the audit puts the method back after the call)."""
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


def writing_check_rules(audit, call: Call, cache, count: int, before: dict) -> None:
    """writing_check: exactly `count` acks consumed, the leading ones and oldest first, their copies finished on
    this rank, each node out of flight with its lock released once and published, no other node touched."""
    stage, queue = audit.layout.pp_rank, before["queue"]
    call.facts = {"count": count, "queued": len(queue), "finished": sum(before["finished"])}
    acks = _ack_rules(stage, call, cache, count, before)
    _node_rules(stage, call, cache, [i for ack in acks for i in ack.node_ids], before)


def _ack_rules(stage: int, call: Call, cache, count: int, before: dict) -> list:
    """The acks the call consumed: `count` of them, the first of the queue, oldest first, each copy finished.
    Returns them."""
    queue = before["queue"]
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
    return acks


def _locks_to_release(consumed: list[int], ongoing: dict) -> dict[int, int]:
    """Per consumed node, how many locks the call must release on it: a release walks up to the root, so an
    ancestor loses one lock per consumed descendant."""
    expected = dict.fromkeys(consumed, 0)
    for i in consumed:
        node = ongoing.get(i)
        while node is not None:
            if node.id in expected:
                expected[node.id] += 1
            node = node.parent
    return expected


def _node_rules(stage: int, call: Call, cache, consumed: list[int], before: dict) -> None:
    """Each node whose ack the call consumed: out of flight, its lock released once, published; and no other
    node taken out of flight."""
    expected = _locks_to_release(consumed, before["ongoing"])
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
            call.find("node_not_published", f"stage {stage} consumed the ack of node {i} but never published the node")
    others = [i for i in before["ongoing"] if i not in expected and i not in cache.ongoing_write_through]
    if others:
        call.find(
            "wrong_node_taken",
            f"stage {stage} took nodes {others[:3]} out of ongoing_write_through, whose acks it did not consume",
        )
