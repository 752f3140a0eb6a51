"""How much a prefill batch may take: SGLang's `PrefillAdder` and `NewTokenRatioTracker`
(`managers/schedule_policy.py`, `scheduler_components/new_token_ratio_tracker.py`, 0.5.23), for one dense pool.

The budget counts device slots that are free or evictable, less what the batch reserved so far and what the
running requests are expected to still decode: their remaining tokens in full for a request that ignores EOS
(bench_multiturn's, and all of the lab's workloads'), else times `new_token_ratio`, an estimate that starts at
0.7, decays each decode step to 0.098, and is raised again after a retraction. A request is
admitted if its extend, its remaining output and a page fit; the batch also stops at `max_prefill_tokens`
and, with chunked prefill, at `chunked_prefill_size` tokens: the request that crosses it is cut at a page
boundary and becomes the one chunked request, continued first in the next batches.
"""

from __future__ import annotations

from enum import Enum, auto

from ..mem_cache.base import BasePrefixCache
from ..mem_cache.utils import page_ceil, page_floor
from .schedule_batch import Req

CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS


class AddReqResult(Enum):
    CONTINUE = auto()  # room for more
    NO_TOKEN = auto()  # device slots ran out
    OTHER = auto()  # a token budget of the batch ran out


class NewTokenRatio:
    """The share of a running request's remaining output that admission reserves (SGLang's defaults:
    SGLANG_INIT_NEW_TOKEN_RATIO 0.7, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14, decay over 600 steps)."""

    def __init__(self, init: float = 0.7, min_factor: float = 0.14, decay_steps: int = 600):
        self.init, self.min = init, init * min_factor
        self.decay = (self.init - self.min) / decay_steps
        self.current = init

    def decay_step(self) -> None:
        self.current = max(self.current - self.decay, self.min)

    def reset(self) -> None:
        self.current = self.init

    def after_retract(self, kept: list[Req]) -> None:
        """What the kept requests' progress says the ratio should be (`estimate_new_token_ratio_after_retract`)."""
        decoded = sum(len(r.output) for r in kept)
        budget = sum(r.max_new_tokens for r in kept)
        self.current = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / (budget + 1))


def remaining_output(req: Req) -> int:
    return min(max(req.max_new_tokens - len(req.output), 0), CLIP_MAX_NEW_TOKENS)


class PrefillAdder:
    """Builds one prefill batch; `can_run` is the batch, in admission order."""

    def __init__(
        self,
        cache: BasePrefixCache,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
    ):
        self.cache, self.page_size = cache, cache.cfg.page_size
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        # a running request's remaining output, in full where it ignores EOS (SGLang 0.5.23's
        # _get_running_request_total_token_offset: "fixed-length requests cannot benefit from the early-EOS
        # estimate"), else times the estimate
        self.total_offset = sum(remaining_output(r) * (1.0 if r.ignore_eos else new_token_ratio) for r in running)
        self.current_offset = 0
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    def rem_total_tokens(self) -> float:
        return self.cache.device_room() - self.total_offset

    def budget_state(self) -> AddReqResult:
        room = self.cache.device_room()
        if room - self.total_offset <= 0 or room - self.current_offset <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _reserve(self, extend: int, max_new: int) -> None:
        extend = page_ceil(extend, self.page_size)
        self.total_offset += extend + self.page_size + max_new
        self.current_offset += extend + self.page_size
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend

    def add_chunked_req(self, req: Req) -> Req | None:
        """The next chunk of the chunked request: as much as the chunk budget and the pool allow. Returns the
        request if it is still not done after this chunk."""
        rem = min(self.rem_chunk_tokens, int(self.rem_total_tokens()))
        rem = rem if rem > 0 else self.rem_chunk_tokens  # it must progress to free its slots one day
        left = len(req.fill_ids) - req.kv_len
        truncated = left > rem
        req.extend_end = req.kv_len + min(left, rem)
        self.can_run.append(req)
        self._reserve(req.extend_end - req.kv_len, 0 if truncated else remaining_output(req))
        return req if truncated else None

    def add_one_req(self, req: Req, match) -> AddReqResult:
        """Admit `req` (whose prefix `match` holds) if it fits: lock its prefix, load back what only the host
        holds, set where its prefill ends. Nothing is held if it does not fit."""
        cache, ps = self.cache, self.page_size
        max_new = remaining_output(req)
        device_len = len(match.device_indices)
        total = len(req.fill_ids) - device_len + max_new + ps
        cache.inc_lock_ref(match.last_device_node)  # SGLang's `_lock_node`: its prefix is not evictable room
        result = self._select(req, total, device_len + match.host_hit_length)
        if result is not None:
            cache.dec_lock_ref(match.last_device_node)
            return result
        prefix, last = cache.lock_match(match)  # takes the lock over (moved where a load back ends)
        if len(prefix) < device_len + match.host_hit_length:  # the load back was not worth it: recompute
            result = self._select(req, total, len(prefix))
            if result is not None:
                cache.dec_lock_ref(last)
                return result
        req.slots, req.last_node = prefix, last
        req.prefix_len = req.kv_len = req.checkpointed = len(prefix)
        if not req.retractions:
            req.cached_device = device_len
            req.cached_storage = min(req.prefetched, len(prefix) - device_len)
            req.cached_host = len(prefix) - device_len - req.cached_storage
        self.can_run.append(req)
        chunked = req.extend_end < len(req.fill_ids)
        if chunked:
            self.new_chunked_req = req
        self._reserve(req.extend_end - req.kv_len, 0 if chunked else max_new)
        return self.budget_state()

    def _select(self, req: Req, total: int, prefix_len: int) -> AddReqResult | None:
        """SGLang's `_select_prefill_admission`: None (and `req.extend_end` set) if a prefill from `prefix_len`
        fits, else why not."""
        ps = self.page_size
        input_tokens = page_ceil(len(req.fill_ids) - prefix_len, ps)
        if not total < self.rem_total_tokens():
            return AddReqResult.NO_TOKEN
        if self.rem_chunk_tokens is None and self.can_run and input_tokens >= self.rem_input_tokens:
            return AddReqResult.OTHER  # without chunking the first request may exceed the input budget
        if self.rem_chunk_tokens is not None and input_tokens > self.rem_chunk_tokens:
            end = page_floor(prefix_len + page_floor(self.rem_chunk_tokens, ps), ps)
            if end <= prefix_len:
                return AddReqResult.OTHER
            req.extend_end = end
            return None
        req.extend_end = len(req.fill_ids)
        return None
