"""The host KV pool (L2): K and V of every layer in one tensor of the device pool's dtype, pinned on CUDA, in
SGLang's layouts: `layer_first` `[2, layers, tokens, ...]` or `page_first` `[2, tokens, layers, ...]`. `pcie.py`
says how copies between it and the device pool cross PCIe.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ..config import DMA_CHUNK_MIB
from . import pcie
from .memory_pool import POISON, DeviceKVPool
from .staging_ring import CudaStreams, StagingRing


def _nothing() -> None:
    pass


class _SlotIndices:
    """A copy's slot indices, moved to the pools' device on first use: inside the copy (on its stream), so that on a
    GPU they live as long as the kernels reading them."""

    def __init__(self, host_idx: torch.Tensor, device_idx: torch.Tensor, device: torch.device):
        self._cpu, self._moved, self._device = (host_idx, device_idx), None, device

    def moved(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._moved is None:
            if self._device.type == "cuda":  # from pageable memory the copy would wait for the stream to drain
                self._moved = tuple(idx.pin_memory().to(self._device, non_blocking=True) for idx in self._cpu)
            else:
                self._moved = self._cpu
        return self._moved


class HostKVPool:
    def __init__(self, size: int, device_pool: DeviceKVPool, layout: str, dma_chunk_bytes: int = DMA_CHUNK_MIB << 20):
        first = device_pool.k[0]
        n, h, d = device_pool.num_layers, first.shape[1], first.shape[2]
        shape = (2, n, size, h, d) if layout == "layer_first" else (2, size, n, h, d)
        on_gpu = device_pool.device.type == "cuda"
        self.dtype = device_pool.dtype
        self.kv = torch.zeros(shape, dtype=self.dtype, pin_memory=on_gpu)
        self.size, self.layout, self.num_layers = size, layout, n
        self.bytes_per_token = device_pool.bytes_per_token
        # what copy kernels address: on a GPU, the same pinned bytes through their device address (UVA)
        self._kv_for_kernels = pcie.device_alias(self.kv) if on_gpu else self.kv
        # where a backup by DMA stages, with its gathers on a helper stream (loads go by kernel: `copy_layers`)
        self._ring = None
        if on_gpu:
            helper = CudaStreams(torch.cuda.Stream(device_pool.device))
            self._ring = StagingRing(dma_chunk_bytes, self.bytes_per_token, device_pool.size, helper)
            self._compile_copy_kernels(device_pool)

    def move_to(self, device: torch.device) -> None:
        """Hold the pool's bytes in `device`'s memory instead (a bound on copies that never cross PCIe): copies
        between the pools then stay inside that device."""
        self.kv = self._kv_for_kernels = self.kv.to(device)

    def _compile_copy_kernels(self, device_pool: DeviceKVPool) -> None:
        """Launch each copy kernel `copy_layers` may launch (a backup of every layer, a load of one) before
        anything is cached: it compiles now, not in the middle of the first load, whose TTFT it would stall.
        Triton compiles a variant for counts that are multiples of 16 and one for others: both, each a round trip
        of the first slots, which leaves the device pool as it was."""
        for n in (16, 15):
            if n <= min(self.size, device_pool.size):
                slots = torch.arange(n, device=device_pool.device)
                self.copy_layer(True, device_pool, slots, slots, 0, self.num_layers)
                self.copy_layer(False, device_pool, slots, slots, 0)
        torch.cuda.synchronize(device_pool.device)

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(self._layer(self.kv, layer))

    def _layer(self, kv: torch.Tensor, layer: int) -> torch.Tensor:
        """K and V of one layer, [2, tokens, heads, head_dim], a view of `kv` in this pool's layout."""
        return kv[:, layer] if self.layout == "layer_first" else kv[:, :, layer]

    def _layers(self, lo: int, hi: int) -> torch.Tensor:
        """K and V of layers [lo, hi), [2, layers, tokens, heads, head_dim], a view of what copy kernels address."""
        kv = self._kv_for_kernels
        return kv[:, lo:hi] if self.layout == "layer_first" else kv[:, :, lo:hi].transpose(1, 2)

    def copy_layer(
        self, to_host: bool, device: DeviceKVPool, host_idx, device_idx, layer: int, end: int | None = None
    ) -> None:
        """K and V of layers [layer, end) (default: `layer` alone) between the pools by one kernel; on a GPU it
        reads or writes host memory directly (`pcie.copy_rows`). Indices must be on the pools' device."""
        end = layer + 1 if end is None else end
        pcie.copy_rows(to_host, self._layers(layer, end), device.kv[:, layer:end], host_idx, device_idx)

    def copy_layers(self, to_host: bool, device: DeviceKVPool, host_idx, device_idx) -> list[Callable[[], None]]:
        """One callable per layer, moving that layer's K and V to the host (or back), to run on a copy stream.
        On a GPU a backup moves every layer in the first callable (nothing waits for its layers one by one),
        by DMA where `pcie.dma_runs` says so, else by one kernel; the others do nothing. A load moves a layer per
        callable, by kernel in both layouts, so that layer i's attention waits for layer i alone (SGLang's kernel
        backend loads `page_first` so too)."""
        on_gpu = device.device.type == "cuda"
        cut = pcie.dma_runs(self.layout, self.bytes_per_token, host_idx, device_idx) if on_gpu and to_host else None
        if cut is not None:

            def whole() -> None:  # the runs were cut on the CPU, once: no index goes to the device
                self._ring.to_host(self.kv, device.kv, cut)

            return [whole] + [_nothing] * (self.num_layers - 1)

        slots = _SlotIndices(host_idx, device_idx, device.device)
        if on_gpu and to_host:

            def every_layer() -> None:
                self.copy_layer(to_host, device, *slots.moved(), 0, self.num_layers)

            return [every_layer] + [_nothing] * (self.num_layers - 1)

        def one(layer: int) -> None:
            self.copy_layer(to_host, device, *slots.moved(), layer)

        return [partial(one, layer) for layer in range(self.num_layers)]

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
