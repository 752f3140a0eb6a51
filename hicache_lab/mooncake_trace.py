"""Mooncake request traces: a workload from outside the lab.

**Mooncake traces** (the FAST'25 release's JSONL: one request per line) look like

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

`hash_ids[i]` names the i-th 512-token block of the prompt; requests whose `hash_ids` start alike share that
prefix. The lab scales a trace down: each id becomes `--trace-block-tokens` tokens, drawn from a generator
seeded by the id (equal ids, equal tokens), input and output lengths scale by the same factor, and outputs are
capped at `--output-length`. Requests are replayed in timestamp order (`managers/workload.MooncakeWorkload`).
Every line is checked field by field (`parse_line`) and every request's length against the pools before a
token is drawn, so a bad trace fails at start, naming its line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .jsonl import is_integer, is_number, read_jsonl

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    timestamp: float
    prompt: tuple[int, ...]
    output_length: int


@dataclass(frozen=True)
class TraceLine:
    """One line of a trace as written, every field checked (`parse_line`): what it asks for, known before any
    token is drawn."""

    number: int  # in the file, from 1
    timestamp: float
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int

    def prompt_length(self, block_tokens: int) -> int:
        """Prompt tokens at `block_tokens` per hash id (input scaled like the ids, at least 1)."""
        return max(1, -(-self.input_length * block_tokens // MOONCAKE_BLOCK_TOKENS))

    def scaled_output(self, block_tokens: int, max_output: int) -> int:
        return max(1, min(max_output, -(-self.output_length * block_tokens // MOONCAKE_BLOCK_TOKENS)))


def parse_line(number: int, row: dict, path: str) -> TraceLine:
    """Line `number` of a trace, field by field; a ConfigError naming the file, the line and the field."""
    where = f"--trace-file {path}:{number}"
    ids, length = row.get("hash_ids"), row.get("input_length")
    if not (isinstance(ids, list) and ids):
        raise ConfigError(f"{where}: needs a non-empty 'hash_ids' list of non-negative integers (Mooncake format)")
    if (bad := next((i for i, v in enumerate(ids) if not (is_integer(v) and v >= 0)), None)) is not None:
        raise ConfigError(f"{where}: 'hash_ids'[{bad}] is {ids[bad]!r}, not a non-negative integer (Mooncake format)")
    if not (is_integer(length) and 0 < length <= len(ids) * MOONCAKE_BLOCK_TOKENS):
        raise ConfigError(
            f"{where}: 'input_length' must be an integer in 1..{len(ids) * MOONCAKE_BLOCK_TOKENS} "
            f"({len(ids)} hash ids of {MOONCAKE_BLOCK_TOKENS} tokens), got {length!r}"
        )
    output, timestamp = row.get("output_length", 1), row.get("timestamp", 0)
    if not (is_integer(output) and output >= 1):
        raise ConfigError(f"{where}: 'output_length' must be an integer of at least 1 (tokens), got {output!r}")
    if not (is_number(timestamp) and timestamp >= 0):
        raise ConfigError(f"{where}: 'timestamp' must be a number >= 0 (ms from the trace's start), got {timestamp!r}")
    return TraceLine(number, float(timestamp), tuple(ids), length, output)


def read_trace_lines(path: str) -> tuple[TraceLine, ...]:
    """Every line of the trace, checked; read once per version of the file (a notebook may rewrite it)."""
    file = Path(path)
    return _read_trace_lines(path, file.stat().st_mtime_ns if file.is_file() else None)


@functools.lru_cache(maxsize=8)
def _read_trace_lines(path: str, version: int | None) -> tuple[TraceLine, ...]:
    return tuple(parse_line(number, row, path) for number, row in read_jsonl(path, "--trace-file"))


def read_mooncake_trace(
    path: str, block_tokens: int, max_output: int, vocab_size: int, seed: int
) -> tuple[TraceRequest, ...]:
    """The trace's requests, scaled to `block_tokens` per hash id, in timestamp order (ties keep file order).
    Only the ids a prompt reaches are drawn: its length was checked against the pools before (`trace_lengths`)."""
    requests = []
    for line in read_trace_lines(path):
        length = line.prompt_length(block_tokens)
        ids = line.hash_ids[: -(-length // block_tokens)]
        tokens = np.concatenate([np.random.default_rng([seed, i]).integers(0, vocab_size, block_tokens) for i in ids])
        prompt = tuple(tokens[:length].tolist())
        requests.append(
            (line.number, TraceRequest(line.timestamp, prompt, line.scaled_output(block_tokens, max_output)))
        )
    return tuple(r for _, r in sorted(requests, key=lambda nr: (nr[1].timestamp, nr[0])))


def trace_lengths(path: str, block_tokens: int, max_output: int) -> tuple[tuple[int, int], ...]:
    """(line number, tokens of KV the request holds: prompt plus output) for every request, in file order,
    without drawing a token: for checking a configuration before any rank runs."""
    return tuple(
        (line.number, line.prompt_length(block_tokens) + line.scaled_output(block_tokens, max_output))
        for line in read_trace_lines(path)
    )
