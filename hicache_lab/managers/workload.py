"""Multi-turn conversations shaped like SGLang's bench_multiturn, and the loop that feeds them to a rank.

Client c opens with `request_length` random tokens; in round r > 0 its prompt is its whole history (every
earlier prompt and answer) plus a fresh sub-question of `sub_question_input_length` tokens, and the model
answers with `output_length` tokens (each length constant, or drawn per client or turn from its distribution:
`--request-length-dist` and its kin). With the round barrier (the default, as `--enable-round-barrier`), round
r+1 starts only when every client's round-r answer is done, which makes per-round hit rates comparable.

`MooncakeWorkload` replays a Mooncake trace instead (`mooncake_trace.py`): requests in timestamp order, split into
`num_rounds` windows of equal count that play the part of rounds (with the barrier; without it, the whole trace
arrives at once). With `use_trace_timestamps` each request arrives at its own time on stage 0's modelled clock
(`latency_model.ModelledClock`), its time from the trace's first times `mooncake_slowdown_factor` (as SGLang's
bench_serving); the windows then only group requests for the table. `ConversationWorkload` plays conversations
from a file, a client per record and a round per human turn; `ReplayWorkload` replays a run's requests.jsonl
(`workload_files.py`). `InfiniteCache` measures the upper bound: the prefix an unbounded cache would have matched.
`Feeder` is the one place requests come from (pipeline stage 0 hands them down to the other stages).
"""

from __future__ import annotations

import time

import numpy as np

from ..config import WorkloadConfig
from ..mem_cache.utils import match_key, page_hashes, whole_pages
from ..mooncake_trace import read_mooncake_trace
from ..workload_files import RecordedRequest, read_conversations, read_recorded_requests, text_tokens
from .latency_model import ModelledClock
from .schedule_batch import Req


class MultiTurnWorkload:
    def __init__(self, cfg: WorkloadConfig, vocab_size: int):
        self.cfg = cfg
        self.openings, self.questions, self.answers = self.turns(vocab_size)
        self.history: list[list[int]] = [[] for _ in self.openings]
        self._next_rid = 0

    def turns(self, vocab_size: int) -> tuple[list[list[int]], list[list[list[int]]], list[list[int]]]:
        """Each client's opening, its sub-question of each round (round 0's unused) and its answer length in each
        round: tokens drawn from --seed, their lengths from each length's distribution (another stream of it)."""
        cfg, rng, lengths = self.cfg, np.random.default_rng(self.cfg.seed), np.random.default_rng([self.cfg.seed, 1])
        opening, question, answer = cfg.lengths()
        shape = (cfg.num_clients, cfg.num_rounds)
        openings = [rng.integers(0, vocab_size, n).tolist() for n in opening.draw(lengths, shape[:1])]
        questions = [[rng.integers(0, vocab_size, n).tolist() for n in row] for row in question.draw(lengths, shape)]
        return openings, questions, answer.draw(lengths, shape).tolist()

    def request(self, client: int, round_: int) -> Req:
        prompt = self.openings[client] if round_ == 0 else self.history[client] + self.questions[client][round_]
        req = Req(
            self._next_rid,
            client,
            round_,
            list(prompt),
            self.answers[client][round_],
            ignore_eos=self.cfg.ignore_eos,
            arrival=time.perf_counter(),
        )
        self._next_rid += 1
        return req

    def round_requests(self, round_: int) -> list[Req]:
        return [self.request(c, round_) for c, answers in enumerate(self.answers) if round_ < len(answers)]

    def next_turn(self, req: Req) -> Req | None:
        """Without the round barrier: the client's next turn, due as soon as `req` is answered."""
        return self.request(req.client, req.round + 1) if req.round + 1 < len(self.answers[req.client]) else None

    def answered(self, req: Req) -> None:
        self.history[req.client] = req.prompt + req.output


class ConversationWorkload(MultiTurnWorkload):
    """Conversations from a file (`workload_files.py`): client c plays record c, a round per human turn (at most
    --num-rounds), its text as tokens; a client whose record has fewer turns ends early."""

    def turns(self, vocab_size: int) -> tuple[list[list[int]], list[list[list[int]]], list[list[int]]]:
        cfg, played = self.cfg, read_conversations(self.cfg.conversation_file)[: self.cfg.num_clients]
        openings = [text_tokens(c.system + c.turns[0][0], vocab_size) for c in played]
        questions = [[text_tokens(human, vocab_size) for human, _ in c.turns] for c in played]
        return openings, questions, [[n for _, n in c.sizes(cfg.num_rounds, cfg.output_length)] for c in played]


class ReplayWorkload:
    """A run's requests.jsonl (`workload_files.py`), each prompt as recorded: with the round barrier, round by
    round in the file's order; without it, each client's first request at once and each next one as the one
    before it is answered. The same flags and seed give the run that wrote it again."""

    def __init__(self, cfg: WorkloadConfig, vocab_size: int):
        self.cfg = cfg
        self.recorded = read_recorded_requests(cfg.requests_file)
        self.following: dict[int, RecordedRequest] = {}  # rid -> its client's next request
        last: dict[int, RecordedRequest] = {}
        for r in self.recorded:
            if r.client in last:
                self.following[last[r.client].rid] = r
            last[r.client] = r
        later = {r.rid for r in self.following.values()}
        self.firsts = [r for r in self.recorded if r.rid not in later]

    def _req(self, r: RecordedRequest) -> Req:
        return Req(r.rid, r.client, r.round, list(r.prompt), r.max_new_tokens, self.cfg.ignore_eos, time.perf_counter())

    def round_requests(self, round_: int) -> list[Req]:
        if not self.cfg.round_barrier:
            return [self._req(r) for r in self.firsts] if round_ == 0 else []
        return [self._req(r) for r in self.recorded if r.round == round_]

    def next_turn(self, req: Req) -> Req | None:
        return self._req(self.following[req.rid]) if req.rid in self.following else None

    def answered(self, req: Req) -> None:
        pass


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


Workload = MultiTurnWorkload | ReplayWorkload | MooncakeWorkload


def make_workload(cfg: WorkloadConfig, vocab_size: int) -> Workload:
    if cfg.trace_file:
        return MooncakeWorkload(cfg, vocab_size)
    if cfg.conversation_file:
        return ConversationWorkload(cfg, vocab_size)
    return ReplayWorkload(cfg, vocab_size) if cfg.requests_file else MultiTurnWorkload(cfg, vocab_size)


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

    def __init__(self, workload: Workload, page_size: int, prior=frozenset()):
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
