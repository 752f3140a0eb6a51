"""Where the lab's radix tree spends its time on bench/radix_speed.py's key stream (`--profile`).

cProfile runs only inside the timed operations (match, insert, evict) of the lab's tree, so the replay's own
loop and its garbage collection stay out of the figures. The report gives, per page size, each operation's
share of the profiled time and the functions with the most time of their own.
"""

from __future__ import annotations

import cProfile
import io
import pstats

from bench.radix_impls import LabTree
from bench.radix_replay import OPERATIONS, KeyStream, replay


class Profiled:
    """An implementation whose operations run under `profiler` (bench/radix_impls.py's interface)."""

    def __init__(self, impl, profiler: cProfile.Profile):
        self.impl, self.profiler = impl, profiler
        self.name, self.prepare_key = impl.name, impl.prepare_key

    @property
    def size(self) -> int:
        return self.impl.size

    def _call(self, method, *args):
        self.profiler.enable()
        try:
            return method(*args)
        finally:
            self.profiler.disable()

    def match(self, key):
        return self._call(self.impl.match, key)

    def insert(self, key, value) -> None:
        self._call(self.impl.insert, key, value)

    def evict(self, num_tokens: int) -> int:
        return self._call(self.impl.evict, num_tokens)


def profile_lab(stream: KeyStream, capacity: int, repeats: int, top: int = 12) -> str:
    """The profile of `repeats` replays of the lab's tree at `stream`'s page size, as text."""
    profiler = cProfile.Profile()
    seconds = dict.fromkeys(OPERATIONS, 0.0)
    for _ in range(repeats):
        result = replay(Profiled(LabTree(stream.page_size), profiler), stream, capacity)
        for op in OPERATIONS:
            seconds[op] += result.seconds[op]
    total = sum(seconds.values())
    shares = ", ".join(f"{op} {seconds[op] * 1e3:.1f} ms ({seconds[op] / total:.0%})" for op in OPERATIONS)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(top)
    body = text.getvalue().split("\n", 1)[1].strip("\n")  # without the blank first line
    return f"## page size {stream.page_size}: {repeats} replays under cProfile; {shares}\n\n{body}\n"
