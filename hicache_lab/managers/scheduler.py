"""One rank's scheduling: which requests run next, with which cached prefix. `schedule()` reads, in order:

    advance copies -> check_hicache_events (agreed ack counts) -> build a prefill batch (match_prefix,
    lock_match: load back what only the host holds, allocate/evict) -> start_loading

and `process_result()` appends sampled tokens and inserts finished requests; the host writes those inserts ask
for start together when it ends (`flush_pending_backups`, as SGLang's `process_batch_result`).

A prefill batch runs when a waiting request can be admitted (at most `max_running_requests` in flight, and
only if its whole sequence fits in free plus evictable device slots); otherwise the running requests decode
one token. A request reserves the device slots for its prompt and all its output tokens at admission.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from ..errors import PoolExhaustedError
from ..mem_cache.base import BasePrefixCache
from ..model import ForwardBatch
from .schedule_batch import Batch, Req


class Scheduler:
    """One rank's cache and batch logic; `scheduler_pp.StageLoop` runs the model and moves data between stages.
    It reaches the cache only through the operations of its contract, `mem_cache/base.BasePrefixCache`."""

    def __init__(self, cache: BasePrefixCache, max_running: int):
        self.cache = cache
        self.max_running = max_running
        self.page_size = cache.cfg.page_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admitted and not finished; `in_flight` ones are in a micro-batch

    def add(self, reqs: list[Req]) -> None:
        for req in reqs:
            self.cache.prefetch_from_storage(req.rid, req.prompt)
            self.waiting.append(req)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def schedule(self, iteration: int) -> Batch:
        """Advance copies, consume agreed acks, then build a prefill batch if one fits, else a decode batch."""
        self.cache.advance(iteration)
        acks = self.cache.check_hicache_events()
        batch = self._admit_batch()
        if not batch and not self.running and self.waiting:
            self._end_prefetches_behind_the_head()
            batch = self._admit_batch()
        if batch:
            self.running.extend(batch)
            result = Batch("prefill", batch, self._prefill(batch), acks)
        elif ready := [r for r in self.running if not r.in_flight]:
            result = Batch("decode", ready, self._decode(ready), acks)
        else:
            result = Batch("idle", [], None, acks)
            if self.waiting and not self.running and not self.cache.copies_in_flight():
                raise PoolExhaustedError(
                    f"request {self.waiting[0].rid} ({len(self.waiting[0].prompt)} prompt tokens) can never fit "
                    "the device pool: raise --max-total-tokens"
                )
        for req in result.reqs:
            req.in_flight = True
        return result

    def process_result(self, batch: Batch, tokens: list[int], logits: torch.Tensor | None) -> list[Req]:
        """Append each request's sampled token; finished requests go into the tree. Returns them."""
        if len(tokens) != len(batch.reqs):
            raise RuntimeError(f"a result of {len(tokens)} tokens for a micro-batch of {len(batch.reqs)} requests")
        now = time.perf_counter()
        for i, (req, token) in enumerate(zip(batch.reqs, tokens, strict=True)):
            req.output.append(token)
            req.in_flight = False
            if logits is not None:
                req.logits.append(logits[i])
            if batch.kind == "prefill":
                req.first_token_at = now
        finished = [r for r in batch.reqs if r.finished]
        for req in finished:
            self._cache_finished_req(req)
        self.cache.flush_pending_backups()  # SGLang: "before the next scheduler step"
        self.running = [r for r in self.running if not r.finished]
        return finished

    def _admit_batch(self) -> list[Req]:
        batch = []
        while self.waiting and len(self.running) + len(batch) < self.max_running and self._admit(self.waiting[0]):
            batch.append(self.waiting.popleft())
        return batch

    def _end_prefetches_behind_the_head(self) -> None:
        """Nothing runs and the head of the queue does not fit: the device nodes it needs may be locked as the
        anchors of prefetches of requests behind it, which end only at their own admission — a livelock found
        by the soak. End every prefetch that may end now (agreed, in queue order, alike on every rank)."""
        for req in list(self.waiting)[1:]:
            self._prefetch_ended(req)

    def _prefetch_ended(self, req: Req) -> bool:
        """Whether the request's storage prefetch (if any) has ended; what it inserted counts as storage hits."""
        inserted = self.cache.check_prefetch_progress(req.rid)
        if inserted is None:
            return False  # still running (wait_complete / timeout policies)
        req.prefetched += inserted
        return True

    def _admit(self, req: Req) -> bool:
        """Match, lock, check room, load back, reserve slots; False (and nothing held) if it does not fit."""
        ps, cache = self.page_size, self.cache
        if not self._prefetch_ended(req):
            return False
        match = cache.match_prefix(tuple(req.prompt[: (len(req.prompt) - 1) // ps * ps]))
        device_len = len(match.device_indices)
        need = self._pages(len(req.prompt) - device_len + req.max_new_tokens)
        cache.inc_lock_ref(match.last_device_node)
        if cache.device_room() < need:
            cache.dec_lock_ref(match.last_device_node)
            return False
        prefix, last = cache.lock_match(match)
        req.prefix_indices, req.last_node = prefix, last
        req.cached_device = device_len
        req.cached_storage = min(req.prefetched, len(prefix) - device_len)
        req.cached_host = len(prefix) - device_len - req.cached_storage
        req.own_slots = self.cache.alloc_device(self._pages(len(req.prompt) - len(prefix) + req.max_new_tokens))
        return True

    def _prefill(self, batch: list[Req]) -> ForwardBatch:
        load_event = self.cache.start_loading()
        extend = [len(r.prompt) - len(r.prefix_indices) for r in batch]
        forward = ForwardBatch(
            tokens=torch.tensor([t for r in batch for t in r.prompt[len(r.prefix_indices) :]]),
            positions=torch.cat([torch.arange(len(r.prefix_indices), len(r.prompt)) for r in batch]),
            out_slots=torch.cat([r.own_slots[:n] for r, n in zip(batch, extend, strict=True)]),
            seq_slots=[r.seq_slots(len(r.prompt)) for r in batch],
            extend_lens=extend,
            load_event=load_event,
        )
        for req in batch:
            req.kv_len = len(req.prompt)
        return forward

    def _decode(self, reqs: list[Req]) -> ForwardBatch:
        forward = ForwardBatch(
            tokens=torch.tensor([r.output[-1] for r in reqs]),
            positions=torch.tensor([r.kv_len for r in reqs]),
            out_slots=torch.stack([r.seq_slots(r.kv_len + 1)[-1] for r in reqs]),
            seq_slots=[r.seq_slots(r.kv_len + 1) for r in reqs],
            extend_lens=[1] * len(reqs),
        )
        for req in reqs:
            req.kv_len += 1
        return forward

    def _cache_finished_req(self, req: Req) -> None:
        """Insert the finished sequence's whole pages; free duplicates and the unused tail; unlock."""
        aligned = req.kv_len // self.page_size * self.page_size
        slots = req.seq_slots(len(req.prefix_indices) + len(req.own_slots))
        tokens = tuple((req.prompt + req.output)[:aligned])
        self.cache.cache_finished_req(tokens, slots, len(req.prefix_indices), req.last_node)

    def new_round(self, flush: bool) -> None:
        """A round begins, nothing running: check the cache's invariants; with --flush-cache-between-rounds
        drop the cache, so that later hits must come from storage."""
        self.cache.check_integrity(self.held_by_requests())
        if flush and self.cache.cfg.flush_between_rounds:
            self.cache.flush()

    def held_by_requests(self) -> int:
        """Device slots reserved by running requests and not yet in the tree."""
        return sum(len(r.own_slots) for r in self.running)
