"""Copy completion replayed from a recorded run, for SGLang's cache (cache.py) in the conformance replay
(replay.py): on CPU SGLang's copies finish as they are issued, so each copy's finish event comes from here
instead, done at the step the recorded rank consumed its ack."""

from __future__ import annotations

from ...mem_cache.copy_engine import STREAMS


class AgreedCompletion:
    """Copy completion replayed from a recorded run: the `k`-th copy of a stream is done once the recorded rank
    had consumed more than `k` acks of it (`allow` is called with each recorded `check_hicache_events` answer
    before SGLang's runs). A wait on a copy not yet allowed completes it and those before it, as a CUDA stream
    would."""

    class Event:
        def __init__(self, owner: AgreedCompletion, stream: str, index: int):
            self.owner, self.stream, self.index = owner, stream, index

        def query(self) -> bool:
            return self.index < self.owner.allowed[self.stream]

        def synchronize(self) -> None:
            allowed = self.owner.allowed
            allowed[self.stream] = max(allowed[self.stream], self.index + 1)

        def wait_layer(self, layer: int) -> None:
            return None

    def __init__(self):
        self.submitted = dict.fromkeys(STREAMS, 0)
        self.allowed = dict.fromkeys(STREAMS, 0)
        self.consumed = dict.fromkeys(STREAMS, 0)

    def allow(self, write: int, load: int) -> None:
        """The recorded rank consumes `write` and `load` more acks now."""
        for stream, count in zip(STREAMS, (write, load), strict=True):
            self.consumed[stream] += count
            self.allowed[stream] = max(self.allowed[stream], self.consumed[stream])

    def finish_all(self) -> None:
        """The recorded rank flushed its cache: every copy issued so far finished and was consumed."""
        self.consumed = dict(self.submitted)
        self.allowed = dict(self.submitted)

    def submit(self, stream: str, job) -> Event:
        self.submitted[stream] += 1
        return self.Event(self, stream, self.submitted[stream] - 1)

    def advance(self, step: int) -> None:
        return None

    def close(self) -> None:
        return None
