"""HiCacheController: issues device<->host copies and keeps their acknowledgement queues.

As in SGLang 0.5.23 (`managers/cache_controller.py`), both directions queue and start merged: the writes a
batch's inserts ask for start together, as one copy, by `start_writing()` once the batch's results are processed
(SGLang's `flush_pending_backups`); loads are queued during batch building and started together, layer by
layer, by `start_loading()` right before the forward pass. Each started copy leaves one `HiCacheAck` (naming
every node it carries) in `ack_write_queue` / `ack_load_queue`; the cache (hiradix_cache.py) consumes them in
FIFO order once the ranks have agreed how many are done.
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
        self.write_queue: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.load_queue: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.copy_check = CopyCheck(enabled=check_copies)
        self.copy_checksum = copy_checksum
        self.write_tokens_started = 0  # device -> host tokens of every write started so far
        self.load_tokens_started = 0  # host -> device tokens of every load started so far

    def _job(self, to_host: bool, host_idx: torch.Tensor, device_idx: torch.Tensor) -> CopyJob:
        """The copy between the pools, layer by layer; until it is done its destination holds poison."""
        into, slots = (self.host_pool, host_idx) if to_host else (self.device_pool, device_idx)
        layers = self.host_pool.copy_layers(to_host, self.device_pool, host_idx, device_idx)
        return CopyJob(layers, partial(into.poison, slots))

    def write_job(self, host_idx: torch.Tensor, device_idx: torch.Tensor) -> CopyJob:
        """The copy a host write runs (where `--fault` tears or misplaces one, lab/check/faults.py)."""
        return self._job(True, host_idx, device_idx)

    def write(self, host_indices: torch.Tensor, device_indices: torch.Tensor, node_id: int, queue_ack: bool = True):
        """Back `device_indices` up to `host_indices` (allocated by the cache, agreed across ranks).

        Queued for the next `start_writing()`; with `queue_ack=False` (write-back eviction) the copy starts at
        once, alone, and its ack (the event to wait on) comes back.
        """
        if queue_ack:
            self.write_queue.append((host_indices, device_indices, node_id))
            return None
        return self._submit("write", [(host_indices, device_indices, node_id)])

    def start_writing(self) -> None:
        """Start every queued write as one copy (SGLang's `start_writing`)."""
        if self.write_queue:
            self.ack_write_queue.append(self._submit("write", self.write_queue))
            self.write_tokens_started += sum(len(d) for _, d, _ in self.write_queue)
            self.write_queue = []

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor, node_id: int) -> None:
        """Queue a load into `device_indices` (allocated by the cache), started by the next `start_loading()`."""
        self.load_queue.append((host_indices, device_indices, node_id))

    def start_loading(self):
        """Start every queued load as one layer-by-layer copy; returns its event (None if none queued)."""
        if not self.load_queue:
            return None
        ack = self._submit("load", self.load_queue)
        self.load_tokens_started += sum(len(d) for _, d, _ in self.load_queue)
        self.load_queue = []
        self.ack_load_queue.append(ack)
        return ack.finish_event

    def _submit(self, stream: str, queued: list[tuple[torch.Tensor, torch.Tensor, int]]) -> HiCacheAck:
        """One copy of the queued (host slots, device slots, node) triples on `stream`, and its ack."""
        host_idx = torch.cat([h for h, _, _ in queued])
        device_idx = torch.cat([d for _, d, _ in queued])
        node_ids = [n for _, _, n in queued]
        to_host = stream == "write"
        job = self.write_job(host_idx, device_idx) if to_host else self._job(False, host_idx, device_idx)
        source = (self.device_pool, device_idx) if to_host else (self.host_pool, host_idx)
        checksum = self._checksum(*source) if self.copy_checksum else None
        return HiCacheAck(self.engine.submit(stream, job), node_ids, host_idx, device_idx, checksum)

    @staticmethod
    def finished_acks(queue: list[HiCacheAck]) -> int:
        """Finished acks at the head of a FIFO queue (this rank's own poll); the first unfinished one stops it."""
        count = 0
        while count < len(queue) and queue[count].finish_event.query():
            count += 1
        return count

    @staticmethod
    def _checksum(pool, indices: torch.Tensor) -> str:
        """sha256 of the K and V rows at `indices`, in order, every layer: a copy to the wrong slots, or a layer
        left out, changes it."""
        digest = hashlib.sha256()
        for layer in range(pool.num_layers):
            for buffer in pool.buffers(layer):
                digest.update(buffer[indices.to(buffer.device)].cpu().view(torch.uint8).numpy().tobytes())
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
