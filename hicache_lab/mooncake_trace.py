"""Mooncake request traces: a workload from outside the lab.

**Mooncake traces** (the FAST'25 release's JSONL: one request per line) look like

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

`hash_ids[i]` names the i-th 512-token block of the prompt; requests whose `hash_ids` start alike share that
prefix. The lab scales a trace down: each id becomes `--trace-block-tokens` tokens, drawn from a generator
seeded by the id (equal ids, equal tokens), input and output lengths scale by the same factor, and outputs are
capped at `--output-length`. Requests are replayed in timestamp order (`managers/workload.MooncakeWorkload`).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConfigError

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    timestamp: float
    prompt: tuple[int, ...]
    output_length: int


def read_jsonl(path: str, flag: str) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a ConfigError naming `flag` and the line otherwise."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag} {path}: no such file")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} {path}:{number}: not JSON ({e.msg}); the file needs one object per line") from e
        if not isinstance(row, dict):
            raise ConfigError(f"{flag} {path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    if not rows:
        raise ConfigError(f"{flag} {path}: the file holds no lines")
    return rows


def read_mooncake_trace(
    path: str, block_tokens: int, max_output: int, vocab_size: int, seed: int
) -> tuple[TraceRequest, ...]:
    """The trace's requests, scaled to `block_tokens` per hash id, in timestamp order (ties keep file order).
    Read once per version of the file (a notebook may rewrite it between runs)."""
    file = Path(path)
    version = file.stat().st_mtime_ns if file.is_file() else None
    return _read_mooncake_trace(path, version, block_tokens, max_output, vocab_size, seed)


@functools.lru_cache(maxsize=8)
def _read_mooncake_trace(
    path: str, version: int | None, block_tokens: int, max_output: int, vocab_size: int, seed: int
) -> tuple[TraceRequest, ...]:
    requests = []
    for number, row in read_jsonl(path, "--trace-file"):
        where = f"--trace-file {path}:{number}"
        ids, length = row.get("hash_ids"), row.get("input_length")
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
            raise ConfigError(f"{where}: needs a non-empty 'hash_ids' list of non-negative integers (Mooncake format)")
        if not (isinstance(length, int) and 0 < length <= len(ids) * MOONCAKE_BLOCK_TOKENS):
            raise ConfigError(
                f"{where}: 'input_length' must be an integer in 1..{len(ids) * MOONCAKE_BLOCK_TOKENS} "
                f"({len(ids)} hash ids of {MOONCAKE_BLOCK_TOKENS} tokens), got {length!r}"
            )
        scale = block_tokens / MOONCAKE_BLOCK_TOKENS
        tokens = np.concatenate([np.random.default_rng([seed, i]).integers(0, vocab_size, block_tokens) for i in ids])
        prompt = tuple(tokens[: max(1, math.ceil(length * scale))].tolist())
        output = max(1, min(max_output, math.ceil(int(row.get("output_length", 1)) * scale)))
        requests.append((number, TraceRequest(float(row.get("timestamp", 0)), prompt, output)))
    return tuple(r for _, r in sorted(requests, key=lambda nr: (nr[1].timestamp, nr[0])))


def trace_lengths(path: str, block_tokens: int, max_output: int) -> tuple[int, ...]:
    """Tokens of KV each request holds (prompt plus output), for checking a configuration before any rank runs."""
    return tuple(len(r.prompt) + r.output_length for r in read_mooncake_trace(path, block_tokens, max_output, 2, 0))
