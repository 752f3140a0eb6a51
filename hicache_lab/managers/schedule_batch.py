"""What the scheduler hands around: a request (`Req`) and one micro-batch of the pipeline (`Batch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..mem_cache.tree_node import TreeNode
from ..model import ForwardBatch


@dataclass(eq=False)
class Req:
    """A request and its KV. `slots` is its row of device slots (SGLang's `req_to_token` row), whole pages: the
    first `prefix_len` belong to the tree (locked through `last_node`), the rest to the request."""

    rid: int
    client: int
    round: int
    prompt: list[int]
    max_new_tokens: int
    ignore_eos: bool = True  # it answers exactly max_new_tokens (bench_multiturn sends ignore_eos, as the lab's do)
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per output token, kept for the oracle
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    prefix_len: int = 0  # leading tokens of `slots` the tree holds (SGLang's cache_protected_len)
    inserted_len: int = 0  # leading tokens this request already inserted (their hits were counted then)
    checkpointed: int = 0  # kv_len at its last insert: a chunk computed since is put into the tree
    last_node: TreeNode | None = None  # locked while the request holds slots
    kv_len: int = 0  # tokens whose K/V are in the pool
    extend_end: int = 0  # where the prefill being run ends (a chunk ends before the sequence does)
    middle_chunks: int = 0  # chunks in flight whose result samples nothing (SGLang's inflight_middle_chunks)
    cached_device: int = 0  # hits at its first admission (a retracted request's later ones are not counted)
    cached_host: int = 0
    cached_storage: int = 0  # loaded from host after a prefetch brought it from storage
    prefetched: int = 0  # tokens its storage prefetch inserted into the tree (host-only nodes)
    upper_bound_cached: int = 0  # what an infinite cache would have matched
    chunks: int = 0  # prefill forward passes it took beyond the first (chunked prefill)
    retractions: int = 0  # times decode memory ran out and it went back to the queue
    first_token_at: float = 0.0
    modelled_arrival_ms: float = 0.0  # on its stage's modelled clock (latency_model.ModelledClock)
    modelled_first_token_ms: float | None = None

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    @property
    def fill_ids(self) -> list[int]:
        """What its next prefill computes from: the prompt and what it answered so far (after a retraction)."""
        return self.prompt + self.output

    def seq_slots(self, length: int) -> torch.Tensor:
        """Slots of the first `length` tokens of the sequence."""
        return self.slots[:length]


@dataclass
class Batch:
    """One micro-batch: what every stage of the pipeline runs for one iteration."""

    kind: str  # "prefill", "decode" or "idle"
    reqs: list[Req]
    forward: ForwardBatch | None
    acks: tuple[int, int]  # (write, load) acks consumed before building it
    tokens: list[int] = field(default_factory=list)  # sampled by the last stage, one per request
    logits: torch.Tensor | None = None  # last stage only: kept for the oracle

    @property
    def num_tokens(self) -> int:
        return sum(self.forward.extend_lens) if self.forward else 0

    @property
    def prefix_tokens(self) -> int:
        """Tokens a prefill did not compute (cached, or earlier chunks of the request); 0 for a decode."""
        if self.kind != "prefill":
            return 0
        return sum(r.kv_len - n for r, n in zip(self.reqs, self.forward.extend_lens, strict=True))
