"""Where a rank's scheduler steps spend their time (bench/step_profile.py). A run times its steps when it is
given `TIMER` (`launch.run_world(cfg, out, binders=(TIMER,))`, entrypoints/binders.py); without it nothing is wrapped
and nothing costs.

`StepTimer.attach(loop)` shadows, on this rank's instances only (instance attributes, as every binder binds
its replacements), the methods the event loop reaches with timed wrappers, each in one category:

* `cache` - every operation of the cache's contract (mem_cache/base.py) and the per-layer waits of a load;
* `agreement` - CacheSync's agreements (distributed/cache_sync.py: collectives, relays, their drain);
* `model` - model.py's forward and the loop's forward glue (the batch's embedding, the sampling);
* `comm` - hidden states, requests and sampled tokens sent and received between stages (scheduler_pp.py),
  which includes waiting for the stage that sends them;
* `scheduler` - the scheduler's own work (its policy, request state) around the cache calls it makes;
* `bookkeeping` - the lab's observation: step records and the trace, with the tree digest of every step and
  the invariant check of every round (`observe`, `check_integrity`), and the requests' encoding;
* `unattributed` - the rest of `StageLoop.run`, the root: the loop's own code and part of the timers' cost.

A call's time goes to its category less the time of the timed calls inside it (exclusive time), so nested
calls (the agreement inside `check_hicache_events`, a load's copies inside the forward) count once, where
they ran, and the categories sum to the time of `StageLoop.run` exactly. Only calls inside `run` on the thread
that attached count: storage threads call some of the same methods. On CUDA a model or comm call ends with a
synchronisation of the current stream, so that its kernels count where they were launched; a layer's wait for
its load then counts in the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from hicache_lab.entrypoints.binders import Binder, RankParts
from hicache_lab.mem_cache.base import BaseHiCache

CATEGORIES = ("cache", "agreement", "model", "comm", "scheduler", "bookkeeping", "unattributed")
DIAGNOSTICS = ("observe", "check_integrity")  # the cache's observation for the lab: bookkeeping
OUTSIDE_THE_LOOP = ("copy_check", "summary", "close")  # called once the loop has ended
CACHE_OPERATIONS = tuple(
    name
    for name in dir(BaseHiCache)
    if not name.startswith("_") and callable(getattr(BaseHiCache, name)) and name not in DIAGNOSTICS + OUTSIDE_THE_LOOP
)
AGREEMENTS = (
    "drain_async_work",
    "agree_ack_counts",
    "agree_allocation",
    "agree_prefetch_progress",
    "agree_storage",
    "agree_prefetch_completion",
    "check_consensus",
    "finish",
)
SYNCED = ("model", "comm")  # categories whose calls end with a stream synchronisation on CUDA


class StepTimer:
    """Exclusive time and call count per (category, label), accumulated while the root call runs."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None):
        self.clock, self.sync = clock, sync
        self.thread = threading.get_ident()
        self.stack: list[list[float]] = []  # per open timed call: the time of the timed calls inside it so far
        self.cells: dict[tuple[str, str], list] = {}  # (category, label) -> [seconds, calls]
        self.total_s = 0.0
        self.steps: Callable[[], int] = lambda: 0
        self.trace_ms: Callable[[], list[float]] = list

    @classmethod
    def attach(cls, loop) -> StepTimer:
        """Time this rank's `StageLoop` (scheduler_pp.py) and everything it reaches; see the module's docstring."""
        on_cuda = torch.device(loop.model.device).type == "cuda"
        timer = cls(sync=(lambda: torch.cuda.current_stream().synchronize()) if on_cuda else None)
        cache, scheduler = loop.scheduler.cache, loop.scheduler
        timer.wrap_all(cache, "cache", tuple(n for n in CACHE_OPERATIONS if n != "start_loading"), "cache")
        timer.wrap(cache, "start_loading", "cache", "cache.start_loading", then=timer._time_load_waits)
        timer.wrap_all(cache, "cache", DIAGNOSTICS, "bookkeeping")
        timer.wrap_all(loop.sync, "sync", AGREEMENTS, "agreement")
        timer.wrap_all(loop.model, "model", ("embed", "forward_layers", "logits", "check_peers_agree"), "model")
        timer.wrap(loop, "_forward", "model", "loop._forward")
        timer.wrap_all(loop, "loop", ("_send_sized", "_recv_sized", "send_hidden", "recv_hidden"), "comm")
        timer.wrap(loop, "drain_sends", "comm", "loop.drain_sends")
        timer.wrap_all(scheduler, "scheduler", ("add", "schedule", "process_result", "new_round"), "scheduler")
        timer.wrap_all(loop, "loop", ("_exchange_requests", "_record"), "bookkeeping")
        if loop.feeder is not None:
            timer.wrap(loop.feeder, "answered", "bookkeeping", "feeder.answered")
        timer.wrap_root(loop, "run")
        timer.steps = lambda: loop.iteration
        timer.trace_ms = lambda: [r.ms for r in loop.records]
        return timer

    def wrap_all(self, owner, prefix: str, names: tuple[str, ...], category: str) -> None:
        """`wrap` each of `names` that `owner` has, labelled `prefix.name`."""
        for name in names:
            if hasattr(owner, name):
                self.wrap(owner, name, category, f"{prefix}.{name}")

    def wrap(self, owner, name: str, category: str, label: str, then: Callable | None = None) -> None:
        """Shadow `owner.name` with a timed call in `category`; `then(result)` runs on its result, untimed."""
        fn, cell = getattr(owner, name), self.cells.setdefault((category, label), [0.0, 0])
        stack, clock, sync = self.stack, self.clock, self.sync if category in SYNCED else None

        def timed(*args, **kwargs):
            if not stack or threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            inner = [0.0]
            stack.append(inner)
            start = clock()
            try:
                result = fn(*args, **kwargs)
            finally:
                if sync is not None:
                    sync()
                elapsed = clock() - start
                stack.pop()
                cell[0] += elapsed - inner[0]
                cell[1] += 1
                stack[-1][0] += elapsed
            return then(result) if then is not None else result

        setattr(owner, name, timed)

    def wrap_root(self, owner, name: str) -> None:
        """Shadow `owner.name`, the call inside which the others count; its own exclusive time is unattributed."""
        fn, cell = getattr(owner, name), self.cells.setdefault(("unattributed", "loop.run"), [0.0, 0])

        def root(*args, **kwargs):
            inner = [0.0]
            self.stack.append(inner)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - start
                self.stack.pop()
                self.total_s += elapsed
                cell[0] += elapsed - inner[0]
                cell[1] += 1

        setattr(owner, name, root)

    def _time_load_waits(self, event):
        """A load's event: its per-layer waits (where, under virtual latency, the bytes move) count as cache."""
        if event is not None:
            self.wrap(event, "wait_layer", "cache", "cache.load wait_layer")
        return event

    def report(self) -> dict:
        """Per category and per label: seconds and ms per step (steps: the loop's iterations); and the mean of
        the step records' `ms` (schedule to record, the trace's step time) for comparison."""
        steps, trace_ms = self.steps(), self.trace_ms()
        per_step = 1e3 / steps if steps else float("nan")
        seconds = dict.fromkeys(CATEGORIES, 0.0)
        labels = {}
        for (category, label), (s, calls) in sorted(self.cells.items(), key=lambda kv: -kv[1][0]):
            seconds[category] += s
            labels[label] = {"category": category, "s": s, "ms_per_step": s * per_step, "calls": calls}
        return {
            "steps": steps,
            "total_s": self.total_s,
            "ms_per_step": self.total_s * per_step,
            "categories_s": seconds,
            "categories_ms_per_step": {c: s * per_step for c, s in seconds.items()},
            "timed_calls": sum(calls for _, calls in self.cells.values()),
            "trace_step_ms_mean": sum(trace_ms) / len(trace_ms) if trace_ms else float("nan"),
            "labels": labels,
        }


class TimerBinder(Binder):
    """Every rank times its steps; its result records where they went (`"step_time"`). Given last, after the
    lab's binders: it times what they replaced."""

    def bind(self, cfg, parts: RankParts, out_dir):
        timer = StepTimer.attach(parts.loop)
        return lambda: {"step_time": timer.report()}


TIMER = TimerBinder()
