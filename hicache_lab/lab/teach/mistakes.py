"""Every kind of mistake the audit of a `--sync-impl` function names (sync_audit.py), with why it is wrong:
teaching prose, as data. The exercise's verdicts (exercise.py) and the table in docs/notebooks.md
(`python -m hicache_lab exercise --table`) say it in these words."""

from __future__ import annotations

# kind -> (fatal: wrong in every world, so the run stops at once; why it is wrong)
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
