"""What the scheduler hands around: a request (`Req`) and one micro-batch of the pipeline (`Batch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..mem_cache.radix_tree import TreeNode
from ..model import ForwardBatch


@dataclass(eq=False)
class Req:
    rid: int
    client: int
    round: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per output token, kept for the oracle
    prefix_indices: torch.Tensor | None = None  # device slots of the cached prefix (loaded part included)
    own_slots: torch.Tensor | None = None  # slots reserved for the rest of the sequence, whole pages
    last_node: TreeNode | None = None  # locked while the request runs
    kv_len: int = 0  # tokens whose K/V are in the pool
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0  # loaded from host after a prefetch brought it from storage
    prefetched: int = 0  # tokens its storage prefetch inserted into the tree (host-only nodes)
    upper_bound_cached: int = 0  # what an infinite cache would have matched
    first_token_at: float = 0.0
    in_flight: bool = False  # in a micro-batch whose sampled tokens have not come back yet

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    def seq_slots(self, length: int) -> torch.Tensor:
        """Slots of the first `length` tokens of the sequence."""
        return torch.cat([self.prefix_indices, self.own_slots])[:length]


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
