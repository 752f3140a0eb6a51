"""A batch's results into the requests and the tree (`SchedulerBatchResultProcessor`, a mixin of `Scheduler`; SGLang
0.5.23's `scheduler_components/batch_result_processor.py`).

`process_result()` appends each request's sampled token. A request's prompt goes into the tree after its
prefill (`cache_unfinished_req`, SGLang's `checkpoint_kv_cache`), as does a chunked request's chunk before the
next one (the scheduler calls `_cache_unfinished_req` then), and its whole sequence at the end
(`cache_finished_req`); the host writes those inserts ask for start together when the batch's results are
processed (`flush_pending_backups`, as SGLang's `process_batch_result`).
"""

from __future__ import annotations

import time

import torch

from ..mem_cache.base import BasePrefixCache
from ..mem_cache.utils import page_floor
from .schedule_batch import Batch, Req


class SchedulerBatchResultProcessor:
    """`Scheduler`'s result processing; the scheduler sets the attributes below."""

    cache: BasePrefixCache
    page_size: int
    running_mbs: list[list[Req]]
    batch_is_full: list[bool]

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
