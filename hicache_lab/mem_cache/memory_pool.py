"""The device KV pool (L1) and the page allocator every pool uses.

The device pool keeps K and V of every layer in one tensor, `[2, layers, tokens, heads, head_dim]`, of the model's
dtype (`--dtype`; the host pool takes the same). Slots are handed out a page at a time; every slot tensor the
cache handles is a whole number of pages. Running out is a `PoolExhaustedError` (raised by the cache, which may
evict first), a double free an assertion.
"""

from __future__ import annotations

import numpy as np
import torch

from .utils import page_ceil

POISON = float("nan")  # what a slot holds while a copy into it is still in flight (virtual latency)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `--dtype` name (config.DTYPES, which ModelConfig checks: "float32", "bfloat16")."""
    return getattr(torch, name)


def kv_bytes_per_token(num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V one token holds in every layer of a pool."""
    return 2 * num_layers * num_heads * head_dim * dtype.itemsize


class PageAllocator:
    """Free pages first in, first out: `alloc` takes the pages free the longest, `free` queues pages behind them in
    the order given, so the same frees give the same slots on every rank. Both are vector operations on a ring
    of page ids (numpy: a tenth of torch's per-call overhead at these sizes); no Python loop runs per page."""

    BYTES_PER_PAGE = 3 * 8 + 1  # its bookkeeping: `_ring`, `_order` and `_seen` (int64), `_is_free` (bool)

    def __init__(self, size: int, page_size: int, name: str):
        self.size, self.page_size, self.name = size, page_size, name
        pages = size // page_size
        self._ring = np.arange(pages, dtype=np.int64)  # free page ids from _head on, `_count` of them, wrapping
        self._head, self._count = 0, pages
        self._is_free = np.ones(pages, dtype=bool)
        self._offsets = np.arange(page_size, dtype=np.int64)  # a page's slots, from its first
        self._order = np.arange(pages, dtype=np.int64)  # 0, 1, 2...: positions in a freed list
        self._seen = np.empty(pages, dtype=np.int64)  # scratch: where in a freed list a page last came

    def available_size(self) -> int:
        return self._count * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` rounded up to whole pages, or None when there is no room."""
        pages = page_ceil(num_tokens, self.page_size) // self.page_size
        if pages > self._count:
            return None
        ring, head, end = self._ring, self._head, self._head + pages
        taken = ring[head:end] if end <= len(ring) else np.concatenate((ring[head:], ring[: end - len(ring)]))
        self._head, self._count = end % len(ring) if len(ring) else 0, self._count - pages
        self._is_free[taken] = False
        return torch.from_numpy((taken[:, None] * self.page_size + self._offsets).reshape(-1))

    def free(self, slots: torch.Tensor) -> None:
        assert len(slots) % self.page_size == 0, f"{self.name}: free takes whole pages"
        pages = slots.numpy()[:: self.page_size] // self.page_size
        n, order = len(pages), self._order[: len(pages)]
        if n == 0:
            return
        self._seen[pages] = order  # a page listed twice keeps its last position: its first one then differs
        if self._is_free[pages].any() or (self._seen[pages] != order).any():
            raise AssertionError(f"{self.name}: page {self._freed_twice(pages)} freed twice")
        self._is_free[pages] = True
        ring, tail = self._ring, (self._head + self._count) % len(self._ring)
        if tail + n <= len(ring):
            ring[tail : tail + n] = pages
        else:
            ring[tail:], ring[: tail + n - len(ring)] = pages[: len(ring) - tail], pages[len(ring) - tail :]
        self._count += n

    def _freed_twice(self, pages: np.ndarray) -> int:
        """The first of `pages` that is free, or would be by the time a loop freeing them in turn reached it."""
        _, first = np.unique(pages, return_index=True)
        repeated = np.ones(len(pages), dtype=bool)
        repeated[first] = False
        return int(pages[np.flatnonzero(self._is_free[pages] | repeated)[0]])


class DeviceKVPool:
    def __init__(self, size: int, num_layers: int, num_heads: int, head_dim: int, device: str, dtype=torch.float32):
        self.size, self.num_layers, self.device, self.dtype = size, num_layers, torch.device(device), dtype
        self.kv = torch.zeros((2, num_layers, size, num_heads, head_dim), device=self.device, dtype=dtype)
        self.k, self.v = list(self.kv[0]), list(self.kv[1])  # per-layer views
        self.bytes_per_token = kv_bytes_per_token(num_layers, num_heads, head_dim, dtype)

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def poison(self, slots: torch.Tensor) -> None:
        self.kv[:, :, slots.to(self.device)] = POISON
