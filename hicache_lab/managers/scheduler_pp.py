"""The per-stage event loop, shaped like SGLang's PP event loop. Every rank runs it; with one stage it is a
plain serving loop.

Iteration i of stage s:

1. requests: stage 0 takes new arrivals from the `Feeder`; every stage hands them to the next one;
2. `scheduler.schedule(i)`: agreed ack counts, then this stage's *own* batch from its *own* tree;
3. forward: stage 0 embeds tokens; later stages receive hidden states (shape first, then data) and view them
   with their own token count — if the stages' caches diverged, this is where SGLang crashed with
   `shape '[N, -1, D]' is invalid for input of size M`; the last stage samples and sends the tokens to
   stage 0;
4. once every micro-batch slot (`pp + --pp-async-batch-depth`, SGLang's `pp_loop_size`) is in flight, take back
   the oldest one's sampled tokens and let the scheduler append them and put its requests into the tree (with
   one stage and no depth: the batch just run, as SGLang's `run_batch` then `process_batch_result`). The
   tokens go round a ring, as in SGLang: the last stage sends them to stage 0, which hands them to stage 1, ...

The scheduler keeps one running batch per slot (`Scheduler.running_mbs`): slot i % slots builds iteration i's
micro-batch, so a request decodes every `slots` iterations, in the slot that ran its prefill.

Every send of this loop is asynchronous and its handle kept until the next round starts, so no stage waits for a
later one here: stages run up to a slot cycle apart, not in lockstep — which is why their polls of copy events
see different things. (The cache's relay sends are drained every step: `CacheSync.drain_async_work`.)

Each stage keeps a modelled clock (`latency_model.ModelledClock`), advanced by each step's modelled time; stage 0
passes it to the `Feeder`, which stamps arrivals with it (a trace replayed at its timestamps arrives by it), and a
request's first token is stamped with it after the step that sampled the token.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..distributed.cache_sync import CacheSync
from ..distributed.parallel_state import Groups, group_rank_and_size, isend, recv
from ..mem_cache.memory_pool import DeviceKVPool, kv_bytes_per_token
from ..model import TinyModel
from .latency_model import LatencyModel, ModelledClock
from .schedule_batch import Batch, Req
from .scheduler import Scheduler
from .step_trace import StepRecord, TraceWriter, consensus_values
from .workload import Feeder

HEADER = 3  # new_round, stop, number of requests
FIELDS = 7  # per request before its prompt


def encode_requests(reqs: list[Req], new_round: bool, stop: bool) -> torch.Tensor:
    flat = [int(new_round), int(stop), len(reqs)]
    for r in reqs:
        flat += [r.rid, r.client, r.round, r.max_new_tokens, int(r.ignore_eos), r.upper_bound_cached, len(r.prompt)]
        flat += r.prompt
    return torch.tensor(flat, dtype=torch.int64)


def decode_requests(data: torch.Tensor) -> tuple[list[Req], bool, bool]:
    flat = data.tolist()
    reqs, pos = [], HEADER
    for _ in range(flat[2]):
        rid, client, round_, max_new, ignore_eos, bound, length = flat[pos : pos + FIELDS]
        prompt = flat[pos + FIELDS : pos + FIELDS + length]
        reqs.append(Req(rid, client, round_, prompt, max_new, bool(ignore_eos), time.perf_counter()))
        reqs[-1].upper_bound_cached = bound
        pos += FIELDS + length
    return reqs, bool(flat[0]), bool(flat[1])


class StageLoop:
    def __init__(
        self,
        groups: Groups,
        sync: CacheSync,
        scheduler: Scheduler,
        model: TinyModel,
        pool: DeviceKVPool,
        feeder: Feeder | None,
        trace: TraceWriter | None = None,
        consensus_every: int = 0,
    ):
        self.groups, self.sync, self.scheduler, self.model, self.pool = groups, sync, scheduler, model, pool
        self.feeder, self.trace, self.consensus_every = feeder, trace, consensus_every
        self.on_iteration: list[Callable[[int], None]] = []  # as each iteration begins (a binder adds some)
        self.pp_rank, self.pp_size = group_rank_and_size(groups.pp_control)
        self.last = self.pp_size - 1
        self.loop_size = len(scheduler.running_mbs)  # micro-batch slots: pp + async depth (pp_loop_size)
        self.sends: list[tuple[int, dist.Work, torch.Tensor]] = []  # (iteration, handle, the tensor it reads)
        self.iteration = 0
        self.records: list[StepRecord] = []
        self.reqs: list[Req] = []  # every request this stage saw, in arrival order
        self._held: list[dist.Work] = []  # the relay send handles held at the last step's record
        kv_bytes = kv_bytes_per_token(len(model.layers), model.num_local_heads, model.cfg.head_dim, model.dtype)
        self.clock = ModelledClock(LatencyModel.of_stage(model.cfg, len(model.layers), model.tp_size, kv_bytes))
        self._answered: list[Req] = []  # requests whose results were processed since the last step's record

    # -- point to point ----------------------------------------------------------------------------

    def send_async(self, tensor: torch.Tensor, dst: int, group) -> None:
        """Send `tensor` to `dst` without waiting; the send is kept until `drain_sends` waits for it."""
        self.sends.append((self.iteration, *isend(tensor, dst, group)))

    def _send_sized(self, tensor: torch.Tensor, dst: int) -> None:
        self.send_async(torch.tensor([tensor.numel()], dtype=torch.int64), dst, self.groups.pp_control)
        if tensor.numel():
            self.send_async(tensor, dst, self.groups.pp_control)

    def _recv_sized(self, src: int) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, group_src=src, group=self.groups.pp_control)
        data = torch.zeros(int(size.item()), dtype=torch.int64)
        if data.numel():
            dist.recv(data, group_src=src, group=self.groups.pp_control)
        return data

    def drain_sends(self, before: int | None = None) -> None:
        """Wait for the sends of iterations before `before` (all if None), so the list stays bounded.

        At iteration i only sends of iterations <= i - loop_size are waited for: stage 0 takes back the sampled
        tokens of iteration j only at the end of iteration j + loop_size - 1 (loop_size: pp plus the async
        depth), so waiting for newer ones would make the last stage wait on stage 0 — a cycle as soon as
        anything else (a consensus check, a storage query) makes stage 0 wait on it.
        """
        keep = []
        for iteration, work, tensor in self.sends:
            if before is None or iteration < before:
                work.wait()
            else:
                keep.append((iteration, work, tensor))
        self.sends = keep

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        in_flight: deque[Batch] = deque()
        while True:
            iteration = self.iteration
            for hook in self.on_iteration:
                hook(iteration)
            reqs, new_round, stop = self._exchange_requests()
            if stop:
                break
            if new_round:
                self.drain_sends(before=iteration - self.loop_size + 1)
                self.scheduler.new_round(flush=iteration > 0)
            self.reqs += reqs
            self.scheduler.add(reqs)
            start = time.perf_counter()
            batch = self.scheduler.schedule(iteration)
            try:
                self._forward(batch)
                in_flight.append(batch)
                if len(in_flight) == self.loop_size:  # the next slot's tokens are back: process them
                    self._finish(in_flight.popleft())
            finally:  # a step that crashes is traced too: its batch is usually the evidence
                record = self._record(iteration, batch, start)
            if self.consensus_every and iteration % self.consensus_every == 0:
                self.sync.check_consensus(iteration, consensus_values(record))
            self.iteration += 1
        while in_flight:
            self._finish(in_flight.popleft())
        self._stamp_first_tokens()
        self.drain_sends()
        self.sync.finish()

    def _exchange_requests(self) -> tuple[list[Req], bool, bool]:
        if self.pp_rank == 0:
            stop = self.feeder.done()
            reqs, new_round = ([], False) if stop else self.feeder.arrivals(self.clock)
            message = encode_requests(reqs, new_round, stop)
        else:
            message = self._recv_sized(self.pp_rank - 1)
            reqs, new_round, stop = decode_requests(message)
            for req in reqs:
                req.modelled_arrival_ms = self.clock.now_ms
        if self.pp_rank < self.last:
            self._send_sized(message, self.pp_rank + 1)
        return reqs, new_round, stop

    def _forward(self, batch: Batch) -> None:
        n, hidden_size = batch.num_tokens, self.model.cfg.hidden_size
        if self.pp_rank == 0:
            hidden = (
                self.model.embed(batch.forward.tokens) if n else torch.zeros(0, hidden_size, dtype=self.model.dtype)
            )
        else:
            hidden = self.recv_hidden()
            # Like SGLang, a later stage reads the hidden states with its *own* token count.
            if n or hidden.numel():
                hidden = hidden.view(n, -1, self.model.cfg.head_dim).view(n, -1)
        self.model.check_peers_agree(n)
        if n:
            hidden = self.model.forward_layers(hidden, batch.forward, self.pool)
        if self.pp_rank < self.last:
            self.send_hidden(hidden)
            return
        if n:
            last_rows = torch.tensor(batch.forward.extend_lens).cumsum(0) - 1
            batch.logits = self.model.logits(hidden[last_rows.to(hidden.device)]).cpu()
            batch.tokens = batch.logits.argmax(-1).tolist()
        if self.pp_size > 1:  # the output ring starts: last stage -> stage 0 -> stage 1 -> ...
            self._send_sized(torch.tensor(batch.tokens, dtype=torch.int64), 0)

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """A hook point (mem_cache/base.py): what travels to the next stage with its activations, a stage before the
        last, once per micro-batch: here a [rows, cols] header on `pp_control`, then the activations."""
        self.send_async(torch.tensor(hidden.shape, dtype=torch.int64), self.pp_rank + 1, self.groups.pp_control)
        if hidden.numel():
            self.send_async(hidden.contiguous(), self.pp_rank + 1, self.groups.pp_compute)

    def recv_hidden(self) -> torch.Tensor:
        """A hook point: what a stage after the first receives with its activations (`send_hidden`'s pair), before
        its forward; returns the activations."""
        shape = torch.zeros(2, dtype=torch.int64)
        dist.recv(shape, group_src=self.pp_rank - 1, group=self.groups.pp_control)
        hidden = torch.zeros(*shape.tolist(), device=self.model.device, dtype=self.model.dtype)
        if hidden.numel():
            recv(hidden, self.pp_rank - 1, self.groups.pp_compute)
        return hidden

    def _finish(self, batch: Batch) -> None:
        """Process a micro-batch's sampled tokens; a stage before the last takes them from the one before it in
        the ring (stage 0: from the last) and hands them on (SGLang's `event_loop_pp` output ring)."""
        if self.pp_rank == self.last:
            tokens, logits = batch.tokens, batch.logits
        else:
            ring = self._recv_sized(self.pp_rank - 1 if self.pp_rank > 0 else self.last)
            if self.pp_rank + 1 < self.last:
                self._send_sized(ring, self.pp_rank + 1)
            tokens, logits = ring.tolist(), None
        finished = self.scheduler.process_result(batch, tokens, logits)
        self._answered += batch.reqs
        if self.feeder is not None:
            self.feeder.answered(finished)

    # -- observation -------------------------------------------------------------------------------

    def _new_relay_sends(self) -> list[dist.Work]:
        """The relay send handles this step added, whoever issued them (the lab's `_pp_sync`, a user's
        `--sync-impl`, SGLang's own): those held now that were not at the last record (kept referenced, so
        their ids are not reused)."""
        before = {id(work) for work in self._held}
        return [work for work in self.sync.work_list if id(work) not in before]

    def _stamp_first_tokens(self) -> None:
        """Stamp the modelled clock on the first tokens sampled by the results processed since the last record."""
        for req in self._answered:
            if req.first_token_at and req.modelled_first_token_ms is None:
                req.modelled_first_token_ms = self.clock.now_ms
        self._answered = []

    def _record(self, iteration: int, batch: Batch, start: float) -> StepRecord:
        prefill = batch.reqs if batch.kind == "prefill" else []
        extend = batch.forward.extend_lens if prefill else []
        observed = self.scheduler.cache.observe()
        lens = batch.forward.extend_lens if batch.forward else []
        modelled = self.clock.step(batch.reqs, lens, observed.get("host_load_tokens", 0))
        self._stamp_first_tokens()
        record = StepRecord(
            step=iteration,
            kind=batch.kind,
            ms=(time.perf_counter() - start) * 1e3,
            requests=[r.rid for r in batch.reqs],
            extend_tokens=batch.num_tokens,
            prefix_tokens=batch.prefix_tokens,
            acks_write=batch.acks[0],
            acks_load=batch.acks[1],
            relay_sends=len(self.sync.work_list),
            relay_sent=len(self._new_relay_sends()),
            prefix_lens=[r.kv_len - n for r, n in zip(prefill, extend, strict=True)],
            extend_lens=list(extend),
            modelled_ms=modelled,
            **observed,
        )
        self._held = list(self.sync.work_list)
        self.records.append(record)
        if self.trace is not None:
            self.trace.write(record)
        return record
