"""Multi-turn conversations shaped like SGLang's bench_multiturn, and the loop that feeds them to a rank.

Client c opens with `request_length` random tokens; in round r > 0 its prompt is its whole history (every
earlier prompt and answer) plus a fresh sub-question of `sub_question_input_length` tokens, and the model
answers with `output_length` tokens. With the round barrier (the default, as `--enable-round-barrier`), round
r+1 starts only when every client's round-r answer is done, which makes per-round hit rates comparable.

`MooncakeWorkload` replays a Mooncake trace instead (`mooncake_trace.py`): requests in timestamp order, split into
`num_rounds` windows of equal count that play the part of rounds (with the barrier; without it, the whole trace
arrives at once). With `use_trace_timestamps` each request arrives at its own time on stage 0's modelled clock
(`latency_model.ModelledClock`), its time from the trace's first times `mooncake_slowdown_factor` (as SGLang's
bench_serving); the windows then only group requests for the table. `InfiniteCache` measures the upper bound: the
prefix an unbounded cache would have matched.
`Feeder` is the one place requests come from (pipeline stage 0 hands them down to the other stages).
"""

from __future__ import annotations

import time

import numpy as np

from ..config import WorkloadConfig
from ..mem_cache.utils import match_key, page_hashes, whole_pages
from ..mooncake_trace import read_mooncake_trace
from .latency_model import ModelledClock
from .schedule_batch import Req


class MultiTurnWorkload:
    def __init__(self, cfg: WorkloadConfig, vocab_size: int):
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        self.openings = [rng.integers(0, vocab_size, cfg.request_length).tolist() for _ in range(cfg.num_clients)]
        self.questions = [
            [rng.integers(0, vocab_size, cfg.sub_question_input_length).tolist() for _ in range(cfg.num_rounds)]
            for _ in range(cfg.num_clients)
        ]
        self.history: list[list[int]] = [[] for _ in range(cfg.num_clients)]
        self._next_rid = 0

    def request(self, client: int, round_: int) -> Req:
        prompt = self.openings[client] if round_ == 0 else self.history[client] + self.questions[client][round_]
        req = Req(
            self._next_rid,
            client,
            round_,
            list(prompt),
            self.cfg.output_length,
            ignore_eos=self.cfg.ignore_eos,
            arrival=time.perf_counter(),
        )
        self._next_rid += 1
        return req

    def round_requests(self, round_: int) -> list[Req]:
        return [self.request(c, round_) for c in range(self.cfg.num_clients)]

    def next_turn(self, req: Req) -> Req | None:
        """Without the round barrier: the client's next turn, due as soon as `req` is answered."""
        return self.request(req.client, req.round + 1) if req.round + 1 < self.cfg.num_rounds else None

    def answered(self, req: Req) -> None:
        self.history[req.client] = req.prompt + req.output


class MooncakeWorkload:
    def __init__(self, cfg: WorkloadConfig, vocab_size: int):
        self.cfg = cfg
        trace = read_mooncake_trace(cfg.trace_file, cfg.trace_block_tokens, cfg.output_length, vocab_size, cfg.seed)
        windows = cfg.trace_windows()  # WorkloadConfig checked there are enough requests
        self.windows = [w.tolist() for w in np.array_split(np.arange(len(trace)), windows)]
        self.trace = trace

    def round_requests(self, round_: int) -> list[Req]:
        if round_ >= len(self.windows):
            return []
        now = time.perf_counter()
        return [
            Req(
                i,
                i,
                round_,
                list(self.trace[i].prompt),
                self.trace[i].output_length,
                ignore_eos=self.cfg.ignore_eos,
                arrival=now,
            )
            for i in self.windows[round_]
        ]

    def timed_requests(self) -> list[Req]:
        """Every request, in arrival order, each arriving at its trace time (from the first) x the slowdown."""
        start, slowdown = self.trace[0].timestamp, self.cfg.mooncake_slowdown_factor
        reqs = [req for round_ in range(len(self.windows)) for req in self.round_requests(round_)]
        for req in reqs:
            req.modelled_arrival_ms = (self.trace[req.rid].timestamp - start) * slowdown
        return reqs

    def next_turn(self, req: Req) -> None:
        return None  # a trace's requests are independent; shared prefixes come from shared hash ids

    def answered(self, req: Req) -> None:
        pass


def make_workload(cfg: WorkloadConfig, vocab_size: int) -> MultiTurnWorkload | MooncakeWorkload:
    return MooncakeWorkload(cfg, vocab_size) if cfg.trace_file else MultiTurnWorkload(cfg, vocab_size)


class InfiniteCache:
    """The set of every page-hash chain ever cached: matching against it gives the upper-bound hit. It holds what
    a store held before the run (`prior`), every answered request's prompt and answer, and, as each request
    arrives, its prompt: a request arriving in the same window as another (a trace replayed without the round
    barrier) may find that one's prompt, inserted at its prefill."""

    def __init__(self, page_size: int, prior: set[str] | frozenset[str] = frozenset()):
        self.page_size = page_size
        self.seen: set[str] = set(prior)

    def match(self, req: Req) -> int:
        matched = 0
        for h in page_hashes(match_key(req.prompt, self.page_size), self.page_size):
            if h not in self.seen:
                break
            matched += self.page_size
        return matched

    def add(self, req: Req, tokens: list[int] | None = None) -> None:
        tokens = (req.prompt + req.output)[: req.kv_len] if tokens is None else tokens  # those with K/V
        self.seen.update(page_hashes(whole_pages(tokens, self.page_size), self.page_size))


class Feeder:
    """Stage 0's source of requests: hands out arrivals, learns of answers, knows when the workload is done.

    With the round barrier, round r+1 arrives once every round-r request is answered; without it, a client's
    next turn arrives as soon as its previous one is answered. A trace replayed at its timestamps has no barrier:
    a request arrives once the modelled clock reaches its time, and when nothing runs the clock moves on to it.
    """

    def __init__(self, workload: MultiTurnWorkload | MooncakeWorkload, page_size: int, prior=frozenset()):
        self.workload, self.cfg = workload, workload.cfg
        self.timed = workload.cfg.use_trace_timestamps
        self.barrier = workload.cfg.round_barrier and not self.timed
        self.bound = InfiniteCache(page_size, prior)
        self.arrived: list[Req] = []
        self.queued = workload.timed_requests() if self.timed else workload.round_requests(0)
        self.next_round = 1
        self.outstanding = 0

    def arrivals(self, clock: ModelledClock) -> tuple[list[Req], bool]:
        """Requests arriving now (at `clock`), and whether they open a new round (the pipeline is then empty)."""
        new_round = bool(self.queued) and self.outstanding == 0 and (self.barrier or not self.arrived)
        if self.timed:
            if self.outstanding == 0 and self.queued:  # nothing runs: the clock moves on to the next arrival
                clock.wait_until(self.queued[0].modelled_arrival_ms)
            due = next((i for i, r in enumerate(self.queued) if r.modelled_arrival_ms > clock.now_ms), len(self.queued))
            arriving, self.queued = self.queued[:due], self.queued[due:]
            new_round = new_round and bool(arriving)
        elif not self.barrier or new_round:
            arriving, self.queued = self.queued, []
        else:
            arriving = []
        for req in arriving:
            if self.timed:
                req.arrival = time.perf_counter()  # the wall clock's arrival: when it is let in
            else:
                req.modelled_arrival_ms = clock.now_ms
            req.upper_bound_cached = self.bound.match(req)
            self.bound.add(req, req.prompt)
        self.arrived += arriving
        self.outstanding += len(arriving)
        return arriving, new_round

    def answered(self, reqs: list[Req]) -> None:
        for req in reqs:
            self.workload.answered(req)
            self.bound.add(req)
            self.outstanding -= 1
            following = None if self.barrier else self.workload.next_turn(req)
            if following is not None:
                self.queued.append(following)
        if self.barrier and self.outstanding == 0 and self.next_round < self.cfg.num_rounds:
            self.queued = self.workload.round_requests(self.next_round)
            self.next_round += 1

    def done(self) -> bool:
        return self.outstanding == 0 and not self.queued
