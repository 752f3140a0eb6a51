"""The copy engine: asynchronous device<->host copies with completion events, under three latency models.

A copy is a `CopyJob`: one callable per layer (moving real bytes between real pools) plus a `poison`
callable that fills the destination with NaN. Submitting returns an event with SGLang's API:

* `query()` - has the copy finished? (never blocks; what `writing_check` / `loading_check` poll)
* `synchronize()` - block until it has.
* `wait_layer(i)` - make the forward pass wait for layer i only (layer-wise load overlap).

Engines, all FIFO per stream (`write` and `load`) like CUDA streams:

* `CudaCopyEngine` - real copies on two CUDA streams with CUDA events; optional injected GPU-side sleep.
* `ThreadCopyEngine` - real copies on one worker thread per stream (CPU); optional injected sleep.
* `VirtualCopyEngine` - deterministic: each copy's completion step is drawn from a seeded per-rank RNG; the
  destination holds poison until that step (or until someone synchronizes), so a read that skipped its
  wait gives NaN logits that the correctness oracle catches.

Injected delays and virtual completion steps have the same distribution on every rank, drawn per rank.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .base import CopyEngine

STREAMS = ("write", "load")


@dataclass
class CopyJob:
    layers: list[Callable[[], None]]
    poison: Callable[[], None]


class VirtualEvent:
    def __init__(self, engine: VirtualCopyEngine, stream: str, job: CopyJob, due: int):
        self.engine, self.stream, self.job, self.due = engine, stream, job, due
        self.done = False
        self.layers_moved: set[int] = set()

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.engine.complete_through(self)

    def wait_layer(self, layer: int) -> None:
        """The forward pass reads layer `layer` now: its bytes move now, but the event still finishes at its due
        step - like a CUDA event recorded after the last layer, which the CPU may poll before the GPU gets there."""
        if layer not in self.layers_moved:
            self.job.layers[layer]()
            self.layers_moved.add(layer)


class VirtualCopyEngine:
    def __init__(self, max_delay_steps: int, seed: int, rank: int):
        self.max_delay_steps = max_delay_steps
        self.rng = np.random.default_rng([seed, rank, 1])
        self.step = 0
        self.pending: dict[str, list[VirtualEvent]] = {s: [] for s in STREAMS}

    def submit(self, stream: str, job: CopyJob) -> VirtualEvent:
        job.poison()
        due = self.step + self._delay()
        pending = self.pending[stream]
        if pending:
            due = max(due, pending[-1].due)  # a stream completes in order
        event = VirtualEvent(self, stream, job, due)
        pending.append(event)
        return event

    def _delay(self) -> int:
        return int(self.rng.integers(0, self.max_delay_steps + 1))

    def advance(self, step: int) -> None:
        """Complete every copy due at or before `step` (called once at the start of each scheduler step)."""
        self.step = step
        for pending in self.pending.values():
            while pending and pending[0].due <= step:
                self._complete(pending.pop(0))

    def complete_through(self, event: VirtualEvent) -> None:
        pending = self.pending[event.stream]
        while not event.done:
            self._complete(pending.pop(0))

    @staticmethod
    def _complete(event: VirtualEvent) -> None:
        for layer, copy_layer in enumerate(event.job.layers):
            if layer not in event.layers_moved:
                copy_layer()
        event.done = True

    def close(self) -> None:
        for pending in self.pending.values():
            while pending:
                self._complete(pending.pop(0))


class ThreadEvent:
    def __init__(self, num_layers: int):
        self.layers = [threading.Event() for _ in range(num_layers)]
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        return self.finished.is_set()

    def synchronize(self) -> None:
        self.finished.wait()
        if self.error is not None:
            raise RuntimeError("a copy on the worker thread failed") from self.error

    def wait_layer(self, layer: int) -> None:
        self.layers[layer].wait()
        if self.error is not None:
            raise RuntimeError("a copy on the worker thread failed") from self.error


class ThreadCopyEngine:
    def __init__(self, injected_delay_ms: float, seed: int, rank: int):
        self.delay_ms = injected_delay_ms
        self.rng = np.random.default_rng([seed, rank, 2])
        self.queues = {s: queue.Queue() for s in STREAMS}
        self.threads = [
            threading.Thread(target=self._worker, args=(q,), name=f"hicache-{s}", daemon=True)
            for s, q in self.queues.items()
        ]
        for t in self.threads:
            t.start()

    def submit(self, stream: str, job: CopyJob) -> ThreadEvent:
        event = ThreadEvent(len(job.layers))
        delay = self.rng.exponential(self.delay_ms) / 1e3 if self.delay_ms > 0 else 0.0
        self.queues[stream].put((job, event, delay))
        return event

    @staticmethod
    def _worker(q: queue.Queue) -> None:
        while (item := q.get()) is not None:
            job, event, delay = item
            try:
                if delay:
                    threading.Event().wait(delay)
                for copy_layer, done in zip(job.layers, event.layers, strict=True):
                    copy_layer()
                    done.set()
            except BaseException as exc:  # surfaced to the scheduler by synchronize()
                event.error = exc
                for done in event.layers:
                    done.set()
            event.finished.set()

    def advance(self, step: int) -> None:
        pass

    def close(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for t in self.threads:
            t.join()


class CudaEvent:
    def __init__(self, num_layers: int, job: CopyJob):
        self.layers = [torch.cuda.Event() for _ in range(num_layers)]
        self.finished = torch.cuda.Event()
        self.job = job  # keeps the index tensors alive while the stream may still read them

    def query(self) -> bool:
        return self.finished.query()

    def synchronize(self) -> None:
        self.finished.synchronize()

    def wait_layer(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self.layers[layer])


class CudaCopyEngine:
    CYCLES_PER_MS = 1_500_000  # roughly a 1.5 GHz SM clock: injected delays are approximate on the GPU

    def __init__(self, injected_delay_ms: float, seed: int, rank: int):
        self.delay_ms = injected_delay_ms
        self.rng = np.random.default_rng([seed, rank, 2])
        self.streams = {s: torch.cuda.Stream() for s in STREAMS}

    def submit(self, stream: str, job: CopyJob) -> CudaEvent:
        event = CudaEvent(len(job.layers), job)
        side = self.streams[stream]
        side.wait_stream(torch.cuda.current_stream())  # the KV being backed up was written on the main stream
        with torch.cuda.stream(side):
            if self.delay_ms > 0:
                torch.cuda._sleep(int(self.rng.exponential(self.delay_ms) * self.CYCLES_PER_MS))
            for copy_layer, done in zip(job.layers, event.layers, strict=True):
                copy_layer()
                done.record()
            event.finished.record()
        return event

    def advance(self, step: int) -> None:
        pass

    def close(self) -> None:
        torch.cuda.synchronize()


def make_copy_engine(
    latency: str, device: str, max_delay_steps: int, delay_ms: float, *, seed: int, rank: int
) -> CopyEngine:
    """The engine of a latency model: `virtual` (deterministic steps), else real copies on CUDA or a thread."""
    if latency == "virtual":
        return VirtualCopyEngine(max_delay_steps, seed, rank)
    if device == "cuda":
        return CudaCopyEngine(delay_ms, seed, rank)
    return ThreadCopyEngine(delay_ms, seed, rank)
