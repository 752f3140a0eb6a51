"""KV pools and their page allocators.

The device pool (L1) keeps one K and one V tensor per layer, `[tokens, heads, head_dim]`. The host pool (L2)
keeps all layers in one tensor, pinned on CUDA, in SGLang's layouts: `layer_first` `[2, layers, tokens, ...]`
or `page_first` `[2, tokens, layers, ...]`. Slots are handed out a page at a time; every slot tensor the
cache handles is a whole number of pages. Running out is a `PoolExhaustedError`, a double free an assertion.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

import torch

POISON = float("nan")  # what a slot holds while a copy into it is still in flight (virtual latency)


def _nothing() -> None:
    pass


class PoolExhaustedError(RuntimeError):
    """A pool has no room left even after eviction."""


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


def _runs(dst_idx: torch.Tensor, src_idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split an index pair into (dst_start, src_start, length) runs that are contiguous on both sides."""
    dst_idx, src_idx = dst_idx.cpu(), src_idx.cpu()
    breaks = ((dst_idx.diff() != 1) | (src_idx.diff() != 1)).nonzero().flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    lengths = torch.cat([breaks, torch.tensor([len(dst_idx)])]) - starts
    return list(zip(dst_idx[starts].tolist(), src_idx[starts].tolist(), lengths.tolist(), strict=True))


def copy_rows(dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor) -> None:
    """dst[dst_idx] = src[src_idx]; across devices as contiguous runs, asynchronous on the current stream."""
    if dst.device == src.device:
        dst[dst_idx.to(dst.device)] = src[src_idx.to(src.device)]
        return
    for d, s, n in _runs(dst_idx, src_idx):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)


class DeviceKVPool:
    def __init__(self, size: int, num_layers: int, num_heads: int, head_dim: int, device: str, dtype=torch.float32):
        shape = (size, num_heads, head_dim)
        self.size, self.num_layers, self.device, self.dtype = size, num_layers, torch.device(device), dtype
        self.k = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(num_layers)]
        self.bytes_per_token = 2 * num_layers * num_heads * head_dim * dtype.itemsize

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def poison(self, slots: torch.Tensor) -> None:
        idx = slots.to(self.device)
        for layer in range(self.num_layers):
            self.k[layer][idx] = POISON
            self.v[layer][idx] = POISON


class HostKVPool:
    def __init__(self, size: int, device_pool: DeviceKVPool, layout: str):
        first = device_pool.k[0]
        n, h, d = device_pool.num_layers, first.shape[1], first.shape[2]
        shape = (2, n, size, h, d) if layout == "layer_first" else (2, size, n, h, d)
        pin = device_pool.device.type == "cuda"
        self.kv = torch.zeros(shape, dtype=device_pool.dtype, pin_memory=pin)
        self.size, self.layout, self.num_layers = size, layout, n
        self.bytes_per_token = device_pool.bytes_per_token

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout == "layer_first":
            return self.kv[0, layer], self.kv[1, layer]
        return self.kv[0, :, layer], self.kv[1, :, layer]

    def backup_from_device(self, device: DeviceKVPool, host_idx, device_idx, layer: int) -> None:
        for dst, src in zip(self.buffers(layer), device.buffers(layer), strict=True):
            copy_rows(dst, host_idx, src, device_idx)

    def load_to_device(self, device: DeviceKVPool, host_idx, device_idx, layer: int) -> None:
        for dst, src in zip(device.buffers(layer), self.buffers(layer), strict=True):
            copy_rows(dst, device_idx, src, host_idx)

    def copy_layers(self, to_host: bool, device: DeviceKVPool, host_idx, device_idx) -> list[Callable[[], None]]:
        """One callable per layer, moving that layer's K and V to the host (or back). With `page_first` between
        a GPU and pinned memory, all layers of a page are adjacent on the host: the first callable moves every
        layer, one copy per contiguous run of pages, and the others do nothing (this layout gives up
        layer-by-layer overlap for bandwidth)."""
        if self.layout == "page_first" and device.device.type == "cuda":
            whole = partial(self._pages_to_host if to_host else self._pages_to_device, device, host_idx, device_idx)
            return [whole] + [_nothing] * (self.num_layers - 1)
        one = self.backup_from_device if to_host else self.load_to_device
        return [partial(one, device, host_idx, device_idx, layer) for layer in range(self.num_layers)]

    def _pages_to_host(self, device: DeviceKVPool, host_idx, device_idx) -> None:
        idx = device_idx.to(device.device)
        runs = _runs(host_idx, torch.arange(len(host_idx)))
        for kind, layers in enumerate((device.k, device.v)):
            staged = torch.stack([layer[idx] for layer in layers], dim=1)  # [tokens, layers, heads, dim], in HBM
            for d, s, n in runs:
                self.kv[kind, d : d + n].copy_(staged[s : s + n], non_blocking=True)

    def _pages_to_device(self, device: DeviceKVPool, host_idx, device_idx) -> None:
        idx = device_idx.to(device.device)
        runs = _runs(torch.arange(len(host_idx)), host_idx)
        for kind, layers in enumerate((device.k, device.v)):
            staged = torch.empty((len(host_idx), *self.kv.shape[2:]), dtype=self.kv.dtype, device=device.device)
            for d, s, n in runs:
                staged[d : d + n].copy_(self.kv[kind, s : s + n], non_blocking=True)
            for layer_index, layer in enumerate(layers):
                layer[idx] = staged[:, layer_index]

    def page_shape(self, tokens: int) -> tuple[int, ...]:
        k = self.buffers(0)[0]
        return (2, self.num_layers, tokens, *k.shape[1:])

    def page_data(self, slots: torch.Tensor) -> torch.Tensor:
        """K and V of `slots` in every layer, [2, layers, tokens, heads, head_dim] (what storage keeps)."""
        return torch.stack(
            [torch.stack([kv[slots] for kv in self.buffers(layer)]) for layer in range(self.num_layers)], 1
        )

    def set_page_data(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        for layer in range(self.num_layers):
            for kind, buffer in enumerate(self.buffers(layer)):
                buffer[slots] = data[kind, layer]

    def poison(self, slots: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv[:, :, slots] = POISON
        else:
            self.kv[:, slots] = POISON
