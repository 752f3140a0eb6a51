"""How the audit sees what a `--sync-impl` function does: every torch.distributed call it could make is routed
through the audited call running on its thread (`Call.observe`, audit_call.py). A call made on any other thread
(the lab's own) goes straight to torch."""

from __future__ import annotations

import contextlib
import inspect
import threading

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

SIGNATURES: dict[str, inspect.Signature] = {}  # torch function name -> its signature (to read a call's arguments)
_active = threading.local()  # .call: the audited call running on this thread, if any


@contextlib.contextmanager
def routed_to(call):
    """While it lasts, this thread's torch.distributed calls go to `call.observe`."""
    _active.call = call
    try:
        yield call
    finally:
        _active.call = None


def patch_torch_distributed() -> None:
    """Route every torch.distributed call through the audit (once per process; a call made outside an audited
    function goes straight to torch). Done before a `--sync-impl` module is imported, so that a name it imports
    from torch.distributed is the routed one too."""
    for name in P2P + COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "_audited", False):
            continue
        SIGNATURES[name] = inspect.signature(original)

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
