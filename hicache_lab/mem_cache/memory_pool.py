"""The device KV pool (L1) and the page allocator every pool uses.

The device pool keeps K and V of every layer in one tensor, `[2, layers, tokens, heads, head_dim]`, of the model's
dtype (`--dtype`; the host pool takes the same). Slots are handed out a page at a time; every slot tensor the
cache handles is a whole number of pages. Running out is a `PoolExhaustedError` (raised by the cache, which may
evict first), a double free an assertion.
"""

from __future__ import annotations

from collections import deque

import torch

POISON = float("nan")  # what a slot holds while a copy into it is still in flight (virtual latency)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `--dtype` name (config.DTYPES, which ModelConfig checks: "float32", "bfloat16")."""
    return getattr(torch, name)


def kv_bytes_per_token(num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of K and V one token holds in every layer of a pool."""
    return 2 * num_layers * num_heads * head_dim * dtype.itemsize


class PageAllocator:
    def __init__(self, size: int, page_size: int, name: str):
        self.size, self.page_size, self.name = size, page_size, name
        self._free = deque(range(size // page_size))
        self._is_free = [True] * (size // page_size)

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for `num_tokens` rounded up to whole pages, or None when there is no room."""
        pages = -(-num_tokens // self.page_size)
        if pages > len(self._free):
            return None
        taken = [self._free.popleft() for _ in range(pages)]
        for p in taken:
            self._is_free[p] = False
        page_ids = torch.tensor(taken, dtype=torch.int64)
        return (page_ids[:, None] * self.page_size + torch.arange(self.page_size)).flatten()

    def free(self, slots: torch.Tensor) -> None:
        assert len(slots) % self.page_size == 0, f"{self.name}: free takes whole pages"
        for p in (slots[:: self.page_size] // self.page_size).tolist():
            assert not self._is_free[p], f"{self.name}: page {p} freed twice"
            self._is_free[p] = True
            self._free.append(p)


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
