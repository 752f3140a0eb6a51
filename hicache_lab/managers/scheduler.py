"""One rank's scheduling, as SGLang's `Scheduler` (`get_next_batch_to_run`, 0.5.23). `schedule()` runs, in order:

    advance copies -> check_hicache_events (agreed ack counts) -> the chunked request's last chunk into the
    tree -> a prefill batch (schedule_policy.PrefillAdder: match_prefix, lock, load back what only the host
    holds) -> start_loading -> allocate the batch's extend slots (evicting the shortfall)
    or, when no prefill fits, a decode step: one slot per request (evicting then), retracting requests when
    even eviction cannot free them.

Requests still waiting for their storage prefetch are skipped, not waited for. `process_result()` (SGLang's
`batch_result_processor.py`) appends each request's sampled token. A request's prompt goes into the tree after
its prefill (`cache_unfinished_req`, SGLang's `checkpoint_kv_cache`), as does a chunked request's chunk before
the next one, and its whole sequence at the end (`cache_finished_req`); the host writes those inserts ask for
start together when the batch's results are processed (`flush_pending_backups`, as SGLang's
`process_batch_result`).
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from ..errors import PoolExhaustedError, StallError
from ..mem_cache.base import BasePrefixCache
from ..mem_cache.utils import match_key, page_ceil, page_floor, page_full
from ..model import ForwardBatch
from .schedule_batch import Batch, Req
from .schedule_policy import RETRACT_DECODE_STEPS, AddReqResult, NewTokenRatio, PrefillAdder

STALL_STEPS, STALL_S = 1000, 10.0  # idle steps (and seconds) without an ack consumed before a run is stalled
STORAGE_STALL_S = 60.0  # seconds a store may leave every waiting request unanswered before the run is stalled


class Scheduler:
    """One rank's cache and batch logic; `scheduler_pp.StageLoop` runs the model and moves data between stages.
    It reaches the cache only through the operations of its contract, `mem_cache/base.BasePrefixCache`."""

    def __init__(
        self,
        cache: BasePrefixCache,
        max_running: int,
        chunked_prefill_size: int | None = None,
        max_prefill_tokens: int = 16384,
        micro_batches: int = 1,
        pp_size: int = 1,
    ):
        self.cache = cache
        self.max_running = max_running  # rows of requests holding slots, all micro-batches together
        self.mb_limit = max(max_running // pp_size, 1)  # SGLang's pp_max_micro_batch_size
        self.chunked_prefill_size, self.max_prefill_tokens = chunked_prefill_size, max_prefill_tokens
        self.page_size = cache.cfg.page_size
        self.waiting: list[Req] = []
        self.stalled_since: float | None = None  # first of the idle steps in a row with requests waiting
        self.idle_steps = 0
        # Per micro-batch slot (SGLang's running_mbs): requests past their prefill, not finished; a request stays
        # in the slot whose batch ran its prefill, and decodes only when that slot comes round again.
        self.running_mbs: list[list[Req]] = [[] for _ in range(micro_batches)]
        self.mb = 0  # the slot being scheduled
        # Per slot, SGLang's sticky `batch_is_full`: set when admission ran out of rows or device room, cleared
        # only when a request leaves the slot (finished or retracted) or the slot is empty
        self.batch_is_full = [False] * micro_batches
        self.chunked_req: Req | None = None  # the one request whose prefill runs in chunks
        self.new_token_ratio = NewTokenRatio()
        self.stats: Counter[str] = Counter()  # chunks, retractions

    def add(self, reqs: list[Req]) -> None:
        for req in reqs:
            self.cache.prefetch_from_storage(req.rid, req.fill_ids)
            self.waiting.append(req)

    def schedule(self, iteration: int) -> Batch:
        """Advance copies, consume agreed acks, then build a prefill batch if one fits, else a decode batch."""
        self.mb = iteration % len(self.running_mbs)
        self.cache.advance(iteration)
        acks = self.cache.check_hicache_events()
        if self.chunked_req is not None and self.chunked_req.kv_len > self.chunked_req.checkpointed:
            self._cache_unfinished_req(self.chunked_req)  # SGLang's stash_chunked_request
        if batch := self._get_new_batch_prefill():
            result = Batch("prefill", batch, self._prefill(batch), acks)
        elif ready := self._update_running_batch(list(self.running_mbs[self.mb])):
            result = Batch("decode", ready, self._decode(ready), acks)
        else:
            result = Batch("idle", [], None, acks)
            if not self.running and not self.waiting and self.chunked_req is None:
                self.new_token_ratio.reset()  # SGLang's on_idle: only when fully idle
            self._check_progress(acks)
        if result.kind != "idle" or not self.waiting or self.running:
            self.stalled_since = None
        return result

    def _check_progress(self, acks: tuple[int, int]) -> None:
        """An idle step with requests waiting and none running: with no copy in flight nothing will ever free
        room; with host copies in flight (no storage operation) and no ack consumed for STALL_STEPS idle steps and
        STALL_S seconds in a row, nothing will either; nor with a storage operation in flight and no ack consumed
        for STORAGE_STALL_S. Each ends the run saying which."""
        if not self.waiting or self.running:
            return
        req, cache = self.waiting[0], self.cache
        if not cache.copies_in_flight():
            pool = cache.cfg.max_total_tokens
            locked = pool - cache.device_room()  # nothing runs and nothing is copied: no lock should be left
            held = (
                f"{locked} of its {pool} tokens are locked with no request or copy holding them (a lock taken and "
                "never released: dec_lock_ref)"
                if locked
                else "raise --max-total-tokens"
            )
            raise PoolExhaustedError(
                f"request {req.rid} ({len(req.fill_ids)} tokens) can never fit the device pool: {held}"
            )
        now = time.perf_counter()
        if sum(acks):  # progress
            self.stalled_since = None
            return
        if self.stalled_since is None:
            self.stalled_since, self.idle_steps = now, 0
        self.idle_steps += 1
        if cache.waits_on_storage():  # a slow store may still answer, for a while
            if now - self.stalled_since >= STORAGE_STALL_S:
                raise StallError(
                    f"no batch for {self.idle_steps} steps ({now - self.stalled_since:.0f} s) while request "
                    f"{req.rid} waits on storage that never answers (a file that blocks when read, such as a FIFO; "
                    "a hung mount or server): check --hicache-storage-dir or the storage backend"
                )
            return
        if self.idle_steps >= STALL_STEPS and now - self.stalled_since >= STALL_S:
            raise StallError(
                f"no batch for {self.idle_steps} steps ({now - self.stalled_since:.0f} s) while request {req.rid} "
                "waits: copies stay in flight and no ack was consumed, so the nodes they lock never become "
                "evictable; the agreed counts stay 0"
            )

    # -- prefill ---------------------------------------------------------------------------------------

    def _get_new_batch_prefill(self) -> list[Req]:
        """SGLang's `_get_new_batch_prefill_raw`: the chunked request's next chunk first, then waiting
        requests in order, skipping those whose prefetch is still running, until a budget runs out."""
        running, mb = self.running_mbs[self.mb], self.mb
        rows = self.max_running - len(self.running) - (self.chunked_req is not None)  # free request rows
        if not running:
            self.batch_is_full[mb] = False
        if self.chunked_req is None and (self.batch_is_full[mb] or not self.waiting):
            return []
        if self.chunked_req is None and min(self.mb_limit - len(running), rows) <= 0:
            self.batch_is_full[mb] = True
            return []
        adder = PrefillAdder(
            self.cache, running, self.new_token_ratio.current, self.max_prefill_tokens, self.chunked_prefill_size
        )
        if self.chunked_req is not None:
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        # SGLang's get_num_allocatable_reqs: the slot's budget, and the free rows plus the one the chunked
        # request (admitted above) already holds
        allocatable = min(self.mb_limit - len(running), rows + len(adder.can_run))
        for req in self.waiting:
            if adder.budget_state() is AddReqResult.OTHER:
                break
            if len(adder.can_run) >= allocatable:
                self.batch_is_full[mb] = True
            if self.batch_is_full[mb]:  # sticky: set now, or before (a chunked request still runs its chunk)
                break
            if not self._prefetch_ended(req):
                continue  # SGLang: "skip staging requests that are ongoing prefetch"
            match = self.cache.match_prefix(match_key(req.fill_ids, self.page_size))
            result = adder.add_one_req(req, match)
            if result is AddReqResult.NO_TOKEN:  # full while it has requests to serve
                self.batch_is_full[mb] = bool(adder.can_run or running)
            if result is not AddReqResult.CONTINUE:
                break
        admitted = set(map(id, adder.can_run))
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        for req in adder.can_run:
            if req is self.chunked_req:
                req.middle_chunks += 1
                self.stats["chunks"] += 1
            elif req not in running:
                running.append(req)
        return adder.can_run

    def _prefetch_ended(self, req: Req) -> bool:
        """Whether the request's storage prefetch (if any) has ended; what it inserted counts as storage hits."""
        inserted = self.cache.check_prefetch_progress(req.rid)
        if inserted is None:
            return False  # still running (wait_complete / timeout policies)
        req.prefetched += inserted
        return True

    def _prefill(self, batch: list[Req]) -> ForwardBatch:
        """Start the batch's loads, then allocate its extend slots (SGLang's `prepare_for_extend`)."""
        load_event = self.cache.start_loading()
        need = [page_ceil(r.extend_end, self.page_size) - len(r.slots) for r in batch]
        extend = [r.extend_end - r.kv_len for r in batch]
        demand = sum(extend) + len(batch) * self.page_size if self.page_size > 1 else sum(need)
        new = self.cache.alloc_device(sum(need), demand).split(need)
        for req, slots in zip(batch, new, strict=True):
            req.slots = torch.cat([req.slots, slots])
        forward = ForwardBatch(
            tokens=torch.tensor([t for r in batch for t in r.fill_ids[r.kv_len : r.extend_end]]),
            positions=torch.cat([torch.arange(r.kv_len, r.extend_end) for r in batch]),
            out_slots=torch.cat([r.slots[r.kv_len : r.extend_end] for r in batch]),
            seq_slots=[r.seq_slots(r.extend_end) for r in batch],
            extend_lens=extend,
            load_event=load_event,
        )
        for req in batch:
            req.kv_len = req.extend_end
        return forward

    # -- decode ----------------------------------------------------------------------------------------

    def _new_decode_tokens(self, reqs: list[Req]) -> int:
        """Slots the next decode step allocates: a page for each request whose last page is full."""
        return sum(self.page_size for r in reqs if page_full(r.kv_len, self.page_size))

    def _update_running_batch(self, ready: list[Req]) -> list[Req]:
        """SGLang's `update_running_batch`: when even eviction cannot free the step's slots, retract requests
        (fewest answered tokens first, then the longest prompt) until it can. SGLang keeps one and aborts it if
        even that one cannot decode (possible with several micro-batches, whose admission budgets count only their
        own requests); the lab, which aborts nothing, retracts it too."""
        if not ready:
            return ready
        if self.cache.evict_to_free(self._new_decode_tokens(ready)):
            self.new_token_ratio.decay_step()
            return ready
        keep = sorted(ready, key=lambda r: (len(r.output), -len(r.prompt)), reverse=True)
        while len(keep) > 1:
            self._retract(keep.pop(), len(keep))
            if self.cache.evict_to_free(self._new_decode_tokens(keep)):
                break
        if not self.cache.evict_to_free(self._new_decode_tokens(keep)):
            self._retract(keep.pop(), 0)
        self.new_token_ratio.after_retract(keep)
        return [r for r in ready if r in keep]

    def _retract(self, req: Req, remaining: int) -> None:
        """Free the request's own slots (what the tree holds stays cached) and queue it again: it will prefill
        its prompt and answer so far (SGLang's `release_req` with `release_kv_cache(checkpoint=False)`)."""
        self.cache.free_request(req.slots, req.prefix_len, req.last_node)
        self.cache.evict_to_free(remaining * RETRACT_DECODE_STEPS)
        self.running_mbs[self.mb].remove(req)
        self.batch_is_full[self.mb] = False
        req.slots, req.prefix_len, req.inserted_len, req.kv_len, req.last_node = req.slots[:0], 0, 0, 0, None
        req.checkpointed = 0
        req.retractions += 1
        self.stats["retractions"] += 1
        self.add([req])

    def _decode(self, reqs: list[Req]) -> ForwardBatch:
        need = self._new_decode_tokens(reqs)
        new = iter(self.cache.alloc_device(need, len(reqs) * self.page_size).split(self.page_size) if need else ())
        for req in reqs:
            if page_full(req.kv_len, self.page_size):
                req.slots = torch.cat([req.slots, next(new)])
        forward = ForwardBatch(
            tokens=torch.tensor([r.output[-1] for r in reqs]),
            positions=torch.tensor([r.kv_len for r in reqs]),
            out_slots=torch.stack([r.slots[r.kv_len] for r in reqs]),
            seq_slots=[r.seq_slots(r.kv_len + 1) for r in reqs],
            extend_lens=[1] * len(reqs),
        )
        for req in reqs:
            req.kv_len += 1
        return forward

    def new_round(self, flush: bool) -> None:
        """A round begins, nothing running: check the cache's invariants; with --flush-cache-between-rounds
        drop the cache, so that later hits must come from storage."""
        self.cache.check_integrity(self.held_by_requests())
        if flush and self.cache.cfg.flush_between_rounds:
            self.cache.flush()

    @property
    def running(self) -> list[Req]:
        """Every running request, all slots."""
        return [r for running in self.running_mbs for r in running]

    def held_by_requests(self) -> int:
        """Device slots held by requests and not (yet) the tree's."""
        holders = self.running + ([self.chunked_req] if self.chunked_req is not None else [])
        return sum(len(r.slots) - r.prefix_len for r in holders)

    # -- a batch's results (SGLang's `scheduler_components/batch_result_processor.py`) ---------------

    def process_result(self, batch: Batch, tokens: list[int], logits: torch.Tensor | None) -> list[Req]:
        """Append each request's sampled token (a chunk before the last samples none); a request goes into the
        tree after its prefill and when it finishes. Returns the finished ones."""
        if len(tokens) != len(batch.reqs):
            raise RuntimeError(f"a result of {len(tokens)} tokens for a micro-batch of {len(batch.reqs)} requests")
        now = time.perf_counter()
        answered = []
        for i, (req, token) in enumerate(zip(batch.reqs, tokens, strict=True)):
            if batch.kind == "prefill" and req.middle_chunks:
                req.middle_chunks -= 1  # its last row predicts a token of the prompt: nothing to answer
                continue
            req.output.append(token)
            if logits is not None:
                req.logits.append(logits[i])
            if batch.kind == "prefill" and not req.first_token_at:
                req.first_token_at = now
            answered.append(req)
        for req in answered:
            if req.finished:
                self._cache_finished_req(req)
            elif batch.kind == "prefill":
                self._cache_unfinished_req(req)  # SGLang's checkpoint after a prefill
        self.cache.flush_pending_backups()  # SGLang: "before the next scheduler step"
        for mb, running in enumerate(self.running_mbs):
            left = [r for r in running if not r.finished]
            if len(left) < len(running):
                running[:], self.batch_is_full[mb] = left, False  # a request left: admission may try again
        return [r for r in answered if r.finished]

    # -- into the tree ---------------------------------------------------------------------------------

    def _cache_unfinished_req(self, req: Req) -> None:
        """Insert the whole pages computed so far; the request's row takes the tree's slots, its lock moves."""
        aligned = page_floor(req.kv_len, self.page_size)
        tokens = tuple(req.fill_ids[:aligned])
        slots, req.last_node = self.cache.cache_unfinished_req(
            tokens, req.slots, req.prefix_len, req.last_node, req.inserted_len
        )
        req.slots = torch.cat([slots, req.slots[aligned:]])
        req.prefix_len, req.checkpointed = aligned, req.kv_len
        req.inserted_len = max(req.inserted_len, aligned)

    def _cache_finished_req(self, req: Req) -> None:
        """Insert the finished sequence's whole pages; free duplicates and the unused tail; unlock."""
        aligned = page_floor(req.kv_len, self.page_size)
        tokens = tuple(req.fill_ids[:aligned])
        self.cache.cache_finished_req(
            tokens, req.slots, req.prefix_len, req.last_node, req.inserted_len, len(req.prompt)
        )
