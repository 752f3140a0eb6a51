"""HiCacheController: issues device<->host copies and keeps their acknowledgement queues.

Writes start as soon as they are asked for (write-through backs up a node the moment it is inserted); loads
are queued during batch building and started together, layer by layer, by `start_loading()` right before
the forward pass. Each started copy leaves a `HiCacheAck` in `ack_write_queue` / `ack_load_queue`; the
cache (hiradix_cache.py) consumes them in FIFO order once the ranks have agreed how many are done.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from ..errors import CopyChecksumError
from .base import CopyEngine, CopyEvent
from .copy_engine import CopyJob
from .memory_pool import DeviceKVPool, PageAllocator
from .memory_pool_host import HostKVPool


class HiCacheAck(NamedTuple):
    finish_event: CopyEvent
    node_ids: list[int]
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    checksum: str | None = None  # with --copy-checksum: sha256 of the source, taken when the copy was issued


@dataclass
class CopyCheck:
    """With --check-outputs: every consumed copy is compared byte for byte with its source."""

    enabled: bool = False
    checked: int = 0
    mismatched: list[str] = field(default_factory=list)


class HiCacheController:
    def __init__(
        self,
        device_pool: DeviceKVPool,
        device_alloc: PageAllocator,
        host_pool: HostKVPool,
        host_alloc: PageAllocator,
        engine: CopyEngine,
        check_copies: bool = False,
        copy_checksum: bool = False,
    ):
        self.device_pool, self.device_alloc = device_pool, device_alloc
        self.host_pool, self.host_alloc = host_pool, host_alloc
        self.engine = engine
        self.ack_write_queue: list[HiCacheAck] = []
        self.ack_load_queue: list[HiCacheAck] = []
        self.load_queue: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.copy_check = CopyCheck(enabled=check_copies)
        self.copy_checksum = copy_checksum

    def _job(self, to_host: bool, host_idx: torch.Tensor, device_idx: torch.Tensor) -> CopyJob:
        """The copy between the pools, layer by layer; until it is done its destination holds poison."""
        into, slots = (self.host_pool, host_idx) if to_host else (self.device_pool, device_idx)
        layers = self.host_pool.copy_layers(to_host, self.device_pool, host_idx, device_idx)
        return CopyJob(layers, partial(into.poison, slots))

    def write_job(self, host_idx: torch.Tensor, device_idx: torch.Tensor) -> CopyJob:
        """The copy a host write runs (where `--fault` tears or misplaces one, entrypoints/hooks.py)."""
        return self._job(True, host_idx, device_idx)

    def write(self, device_indices: torch.Tensor, node_id: int, queue_ack: bool = True):
        """Back `device_indices` up to freshly allocated host slots; None when the host pool is full.

        Returns the host slots, and with `queue_ack=False` (write-back eviction) also the event to wait on.
        """
        host_indices = self.host_alloc.alloc(len(device_indices))
        if host_indices is None:
            return None
        job = self.write_job(host_indices, device_indices)
        checksum = self._checksum(self.device_pool, device_indices) if self.copy_checksum else None
        ack = HiCacheAck(self.engine.submit("write", job), [node_id], host_indices, device_indices, checksum)
        if queue_ack:
            self.ack_write_queue.append(ack)
            return host_indices
        return host_indices, ack

    def load(self, host_indices: torch.Tensor, node_id: int) -> torch.Tensor | None:
        """Reserve device slots for a load started by the next `start_loading()`; None when full."""
        device_indices = self.device_alloc.alloc(len(host_indices))
        if device_indices is not None:
            self.load_queue.append((host_indices, device_indices, node_id))
        return device_indices

    def start_loading(self):
        """Start every queued load as one layer-by-layer copy; returns its event (None if none queued)."""
        if not self.load_queue:
            return None
        host_idx = torch.cat([h for h, _, _ in self.load_queue])
        device_idx = torch.cat([d for _, d, _ in self.load_queue])
        node_ids = [n for _, _, n in self.load_queue]
        self.load_queue = []
        job = self._job(False, host_idx, device_idx)
        checksum = self._checksum(self.host_pool, host_idx) if self.copy_checksum else None
        ack = HiCacheAck(self.engine.submit("load", job), node_ids, host_idx, device_idx, checksum)
        self.ack_load_queue.append(ack)
        return ack.finish_event

    @staticmethod
    def finished_acks(queue: list[HiCacheAck]) -> int:
        """Finished acks at the head of a FIFO queue (this rank's own poll); the first unfinished one stops it."""
        count = 0
        while count < len(queue) and queue[count].finish_event.query():
            count += 1
        return count

    def pop_acks(self, queue: list[HiCacheAck], what: str, count: int) -> list[HiCacheAck]:
        """Take `count` acks off the head of `queue`, waiting for this rank's own copy where it is not done
        yet, each checked against its source (`verify`). More than the queue holds fails as SGLang did: "pop
        from empty list"."""
        acks = []
        for _ in range(count):
            acks.append(queue.pop(0))
            acks[-1].finish_event.synchronize()
            self.verify(acks[-1], what)
        return acks

    @staticmethod
    def _checksum(pool, indices: torch.Tensor) -> str:
        """sha256 of the K and V rows at `indices`, in order, every layer: a copy to the wrong slots, or a layer
        left out, changes it."""
        digest = hashlib.sha256()
        for layer in range(pool.num_layers):
            for buffer in pool.buffers(layer):
                digest.update(buffer[indices.to(buffer.device)].cpu().numpy().tobytes())
        return digest.hexdigest()

    def verify(self, ack: HiCacheAck, what: str) -> None:
        """A finished copy's destination against its source: the checksum taken at issue (--copy-checksum,
        raises at once) and, with --check-outputs, a byte-for-byte comparison of every layer (recorded)."""
        if ack.checksum is not None:
            into, slots = (self.host_pool, ack.host_indices)
            if what == "load":
                into, slots = self.device_pool, ack.device_indices
            if self._checksum(into, slots) != ack.checksum:
                raise CopyChecksumError(
                    f"host {what} of nodes {ack.node_ids} ({len(slots)} tokens) does not match its source's "
                    "checksum: the copy was torn or went to the wrong slots"
                )
        check = self.copy_check
        if not check.enabled:
            return
        for layer in range(self.device_pool.num_layers):
            device_kv = self.device_pool.buffers(layer)
            host_kv = self.host_pool.buffers(layer)
            for dev, host in zip(device_kv, host_kv, strict=True):
                got = host[ack.host_indices].to(dev.device)
                if not torch.equal(got, dev[ack.device_indices.to(dev.device)]):
                    check.mismatched.append(f"{what} of nodes {ack.node_ids}, layer {layer}")
        check.checked += 1
