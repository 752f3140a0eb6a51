"""Every kind of mistake the audit of a `--sync-impl` function names (sync_audit.py): teaching prose, as data.

A verdict comes in two levels. First the kind, what the rank did, and why that is wrong: what the mistake does
to the pipeline (`Mistake.why`). The fix (`Mistake.fix`) only on request: `check(..., hint=True)`, or
`python -m hicache_lab exercise --hint`. The exercise's verdicts (exercise.py) and the tables of
`python -m hicache_lab exercise --table` (docs/notebooks.md; with `--hint`, teaching/README.md) say it in
these words."""

from __future__ import annotations

from typing import NamedTuple


class Mistake(NamedTuple):
    fatal: bool  # wrong in every world, so the run stops at once
    why: str  # what it does, in the run and to the pipeline
    fix: str  # what to change: the hint


MISTAKES = {
    "symmetric_across_stages": Mistake(
        False,
        "a symmetric collective over ranks of different stages returns on no stage before every stage has entered "
        "it: the stages are forced into lockstep, and a stage can no longer run ahead of a slower one",
        "only a one-way relay may cross stages: receive from the stage before, send to the stage after",
    ),
    "blocking_send": Mistake(
        False,
        "a send that waits (dist.send, or an isend waited for at once) holds this stage until the next one "
        "receives: the stages are forced into lockstep",
        "send with dist.isend, keep its handle in self.work_list and return: the lab waits for it at the next step",
    ),
    "send_aliases_data": Mistake(
        True,
        "an isend reads its tensor after the call returns, while the caller is free to change or free `data` (on a "
        "GPU its memory goes back to the caching allocator for the next tensor): the next stage may receive "
        "other values",
        "send a tensor nobody else holds: data.clone()",
    ),
    "lost_send_handle": Mistake(
        True,
        "nothing waits for a send whose handle is dropped: a stage may run ahead of the next without bound, and "
        "nothing keeps the sent tensor alive until it is sent",
        "append the isend's handle to self.work_list: the lab waits for the previous step's sends at the start of "
        "every check",
    ),
    "recv_not_waited": Mistake(
        True,
        "an irecv returns before the message arrives: the caller reads `data` too early",
        "use dist.recv, or wait for the handle before returning",
    ),
    "recv_elsewhere": Mistake(
        True,
        "the caller reads the agreed values from `data` itself: a tensor received elsewhere, or the name rebound, "
        "changes nothing the caller sees",
        "receive into `data` (or copy into it with data.copy_(...))",
    ),
    "forwarded_before_receive": Mistake(
        True,
        "a stage passes on the values it holds when it sends: a copy taken before this stage's own receive has "
        "completed carries the zeros it was given, not stage 0's counts, and every stage after it consumes "
        "different acks from stage 0",
        "a stage forwards stage 0's values: send on only what has arrived, once its own receive has completed",
    ),
    "uses_the_lab_own": Mistake(
        True,
        "the lab's own method does the exercise's work: calling it passes every world and teaches nothing (the "
        "check reads your function's source for the lab's methods of this slot)",
        "write the slot's work yourself, from what the exercise says the function must achieve",
    ),
    "no_receive": Mistake(
        False,
        "every stage after the first must end the call holding PP rank 0's values: a stage that receives nothing "
        "keeps the zeros it was given and consumes different acks from stage 0",
        "every stage after the first receives from the stage before it; every stage but the last sends to the next",
    ),
    "backwards": Mistake(
        False,
        "the counts flow one way, from stage 0 down the pipeline: a stage that waits for a later stage cannot "
        "return before that stage has reached the same call, so it can no longer run ahead of it (the stages move "
        "in lockstep), and where the later stage waits for it in turn, neither returns",
        "nothing flows back up the pipeline: a stage receives only from the stage before it, and sends only to "
        "the stage after it",
    ),
    "wrong_rank_space": Mistake(
        True,
        "a peer named in the wrong rank space: src= / dst= are global ranks, group_src= / group_dst= ranks within "
        "the group; with one rank per stage (--tp 1) the two coincide, with --tp 2 they do not",
        "in the pipeline group the group ranks are stage numbers: name the peer stage with group_src= / group_dst=",
    ),
    "wrong_ack_count": Mistake(
        True,
        "every rank must consume exactly the agreed `count` acks: fewer leaves this rank's nodes locked longer than "
        "the others', more unlocks nodes the others keep; either way the trees, then the batches, differ",
        "consume exactly the agreed `count` acks, even where this rank's own copy of one has not finished yet: "
        "such an ack is consumed once that copy has finished here",
    ),
    "acks_out_of_order": Mistake(
        True,
        "acks are consumed from the head of the queue, oldest first (it is FIFO, like the copy stream it records): "
        "the agreed count counts the *leading* finished acks, so an ack taken from further back may belong to a "
        "copy that has not finished on PP rank 0, and nodes published out of order reach the storage tier and the "
        "tree's bookkeeping in another order than on the ranks that kept it",
        "take the acks from the head of self.controller.ack_write_queue: queue.pop(0), `count` times",
    ),
    "copy_not_waited": Mistake(
        False,
        "the agreed count says the copy has finished on PP rank 0, not here: a node unlocked before this rank's own "
        "copy has finished leaves the host with a copy still being written",
        "wait for this rank's own copy before unlocking its nodes: ack.finish_event.synchronize()",
    ),
    "lock_leaked": Mistake(
        True,
        "a write-through holds a lock on its node (and the node's ancestors) until its ack is consumed: a node "
        "taken out of ongoing_write_through still locked stays locked for good, can never be evicted, and the "
        "device pool fills with locked nodes",
        "release the write's lock on each node of a consumed ack: self.dec_lock_ref(node)",
    ),
    "lock_released_twice": Mistake(
        True,
        "each consumed write releases the one lock its write-through took: releasing more unlocks a node a running "
        "request or another copy still holds",
        "call self.dec_lock_ref(node) once per node of a consumed ack",
    ),
    "node_left_in_flight": Mistake(
        True,
        "a consumed ack's nodes must leave ongoing_write_through: the lab would count them as still in flight",
        "self.ongoing_write_through.pop(node_id) for each of the ack's node_ids",
    ),
    "node_not_published": Mistake(
        True,
        "a consumed node that is not published is never settled (the halves split off it while its write was in "
        "flight keep their old state) nor handed to the storage tier: L3 never sees it",
        "hand each node of a consumed ack to self.publish_write(node)",
    ),
    "wrong_node_taken": Mistake(
        True,
        "only the nodes of the consumed acks may leave ongoing_write_through: the others' writes are still running",
        "take out of ongoing_write_through only the node_ids of the acks you popped",
    ),
    "group_spans_stages": Mistake(
        False,
        "only PP rank 0 agrees over the attention groups (later stages receive its result by the relay): a group "
        "with ranks of other stages is entered by stage 0 alone, which waits there for peers that never come, a "
        "deadlock",
        "return groups within this stage only: the attention groups of self.groups, never the pipeline's",
    ),
    "missing_group": Mistake(
        False,
        "PP rank 0 must agree with every rank that holds the same requests' KV: a peer left out polls its own "
        "copies and takes different decisions",
        "return the attention-CP group (CP peers split the sequence) as well as the attention-TP group (TP peers "
        "split the heads): self.groups.attn_cp_group, self.groups.attn_tp_group",
    ),
    "not_groups": Mistake(
        True,
        "attn_groups must return a list of process groups",
        "return a list of groups of self.groups (e.g. self.groups.attn_tp_group), not ranks",
    ),
}


def mistake_text(kind: str, what: str) -> str:
    """What the rank did, and why it is wrong (the first level of a verdict)."""
    return f"{what}: {MISTAKES[kind].why}"
