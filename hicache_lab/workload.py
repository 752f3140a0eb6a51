"""Multi-turn conversations shaped like SGLang's bench_multiturn, and the loop that feeds them to a rank.

Client c opens with `request_length` random tokens; in round r > 0 its prompt is its whole history (every
earlier prompt and answer) plus a fresh sub-question of `sub_question_input_length` tokens, and the model
answers with `output_length` tokens. With the round barrier (the default, as `--enable-round-barrier`), round
r+1 starts only when every client's round-r answer is done, which makes per-round hit rates comparable.

`InfiniteCache` measures the upper bound: the prefix an unbounded cache would have matched.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .config import WorkloadConfig
from .radix import page_hashes
from .scheduler import Req, Scheduler


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
        req = Req(self._next_rid, client, round_, list(prompt), self.cfg.output_length, arrival=time.perf_counter())
        self._next_rid += 1
        return req

    def answered(self, req: Req) -> None:
        self.history[req.client] = req.prompt + req.output


class InfiniteCache:
    """The set of every page-hash chain ever cached: matching against it gives the upper-bound hit."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.seen: set[str] = set()

    def match(self, req: Req) -> int:
        usable = (len(req.prompt) - 1) // self.page_size * self.page_size
        matched = 0
        for h in page_hashes(tuple(req.prompt[:usable]), self.page_size):
            if h not in self.seen:
                break
            matched += self.page_size
        return matched

    def add(self, req: Req) -> None:
        aligned = req.kv_len // self.page_size * self.page_size
        self.seen.update(page_hashes(tuple((req.prompt + req.output)[:aligned]), self.page_size))


def run_workload(
    scheduler: Scheduler, workload: MultiTurnWorkload, on_round_start: Callable[[], None] = lambda: None
) -> list[Req]:
    """Feed every client's rounds to `scheduler` until all are answered; returns requests in arrival order."""
    cfg = workload.cfg
    bound = InfiniteCache(scheduler.page_size)
    arrived: list[Req] = []

    def submit(req: Req) -> None:
        req.upper_bound_cached = bound.match(req)
        arrived.append(req)
        scheduler.add(req)

    def drive(until_idle_then: Callable[[Req], None]) -> None:
        while not scheduler.idle():
            for req in scheduler.step():
                workload.answered(req)
                bound.add(req)
                until_idle_then(req)

    if cfg.round_barrier:
        for round_ in range(cfg.num_rounds):
            on_round_start()
            for client in range(cfg.num_clients):
                submit(workload.request(client, round_))
            drive(lambda req: None)
    else:
        on_round_start()
        for client in range(cfg.num_clients):
            submit(workload.request(client, 0))
        drive(lambda req: req.round + 1 < cfg.num_rounds and submit(workload.request(req.client, req.round + 1)))
    return arrived
