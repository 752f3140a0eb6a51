"""Workloads as data beside Mooncake traces (docs/workloads.md): length distributions for the synthetic
conversations (`parse_length_dist`: vLLM's multi-turn benchmark's five, each draw clipped to 1..MAX), conversation
files (`read_conversations`: ShareGPT's JSON, a text's tokens its UTF-8 bytes modulo the vocabulary, so equal
texts share a prefix) and a run's requests.jsonl replayed (`read_recorded_requests`). Every field is checked,
and every length is known before a token is drawn, so a bad file fails at start, naming its record and field."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import require
from .jsonl import is_integer, read_json, read_jsonl

DISTRIBUTIONS = {  # kind: (its first number, whether that fits beside MAX, what it must be)
    "uniform": ("MIN", lambda a, most: a == int(a) and 1 <= a <= most, "an integer in 1..MAX"),
    "lognormal": ("AVERAGE", lambda a, most: 1 <= a <= most, "in 1..MAX"),
    "zipf": ("ALPHA", lambda a, most: a > 1, "> 1"),
    "poisson": ("MEAN", lambda a, most: 0 <= a <= most, "in 0..MAX"),
}
TURN = '{"from": "human"|"gpt", "value": TEXT}'  # a turn of a conversation file
LOGNORMAL_MEDIAN_RATIO = 0.85  # median / average, vLLM's default: a right-skewed spread


@dataclass(frozen=True)
class LengthDist:
    """A length distribution: `kind`, its first number `a` (see `DISTRIBUTIONS`) and the most it draws."""

    kind: str
    a: float
    most: int

    def draw(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        if self.kind == "constant":
            return np.full(shape, self.most)
        if self.kind == "uniform":
            return rng.integers(int(self.a), self.most + 1, shape)
        if self.kind == "lognormal":
            sigma = math.sqrt(2 * math.log(1 / LOGNORMAL_MEDIAN_RATIO))
            drawn = np.rint(rng.lognormal(math.log(self.a * LOGNORMAL_MEDIAN_RATIO), sigma, shape))
        else:
            drawn = rng.zipf(self.a, shape) if self.kind == "zipf" else rng.poisson(self.a, shape)
        return np.clip(drawn, 1, self.most).astype(np.int64)


def parse_length_dist(spec: str, flag: str, constant: int) -> LengthDist:
    """`spec` as a `LengthDist` (`constant`: the length flag's value); a ConfigError saying what to write."""
    kind, *values = spec.split(":")
    if kind == "constant" and not values:
        return LengthDist("constant", constant, constant)
    try:
        a, most = float(values[0]), int(values[1])
    except (IndexError, ValueError):
        a, most = math.nan, 0
    grammar = ", ".join(f"{k}:{first}:MAX" for k, (first, _, _) in DISTRIBUTIONS.items())
    require(
        kind in DISTRIBUTIONS and len(values) == 2 and most >= 1 and math.isfinite(a),
        f"{flag} {spec!r}: write constant or {grammar} (MAX an integer >= 1), e.g. uniform:64:256",
    )
    first, fits, what = DISTRIBUTIONS[kind]
    require(fits(a, most), f"{flag} {spec!r}: {first} must be {what} ({kind}:{first}:MAX)")
    return LengthDist(kind, a, most)


def text_tokens(text: str, vocab_size: int) -> list[int]:
    """A text's tokens: its UTF-8 bytes modulo the vocabulary (equal texts, equal tokens)."""
    return [b % vocab_size for b in text.encode()]


@dataclass(frozen=True)
class Conversation:
    """A record of a conversation file: its system prompt and its (human, gpt) turns (gpt None after a last
    human turn, whose answer then runs to `--output-length`)."""

    system: str
    turns: tuple[tuple[str, str | None], ...]

    def sizes(self, rounds: int, max_output: int) -> list[tuple[int, int]]:
        """(tokens of KV: prompt and answer, answer tokens) of each of its first `rounds` turns."""
        sizes, held = [], len(self.system.encode())
        for human, gpt in self.turns[:rounds]:
            answer = max_output if gpt is None else max(1, min(max_output, len(gpt.encode())))
            held += len(human.encode()) + answer
            sizes.append((held, answer))
        return sizes


def parse_conversation(index: int, record: object, path: str) -> Conversation:
    """Record `index` of a conversation file; a ConfigError naming the file, the record and the field."""
    record = record if isinstance(record, dict) else {}
    where = f"--conversation-file {path} [{index}]" + (f" (id {record['id']!r})" if "id" in record else "")
    turns, system = record.get("conversations"), record.get("system", "")
    require(
        isinstance(turns, list) and bool(turns) and isinstance(system, str),
        f"{where}: needs a non-empty 'conversations' list of {TURN} turns (and 'system' a string)",
    )
    texts, due = [], "human"
    for j, turn in enumerate(turns):
        value, speaker = (turn.get("value"), turn.get("from")) if isinstance(turn, dict) else (None, None)
        require(isinstance(value, str), f"{where}, turn {j}: needs a 'value' string, as in {TURN}")
        if j == 0 and speaker == "system" and not system:
            system = value
            continue
        why = "an empty human turn" if speaker == due else f"'from' is {speaker!r} where {due!r} is due"
        require(
            speaker == due and (due == "gpt" or bool(value)),
            f"{where}, turn {j}: {why} (turns alternate human, gpt, ...; a first may be 'system')",
        )
        texts.append(value)
        due = "gpt" if due == "human" else "human"
    require(bool(texts), f"{where}: holds no human turn")
    return Conversation(system, tuple(zip(texts[0::2], texts[1::2] + [None] * (len(texts) % 2), strict=True)))


def read_conversations(path: str) -> tuple[Conversation, ...]:
    """Every record of a conversation file (a JSON list), checked."""
    return _read(path, "conversations")


@dataclass(frozen=True)
class RecordedRequest:
    """A line of a run's requests.jsonl (`parse_recorded`): `max_new_tokens`, where absent, is `output`'s length."""

    number: int  # in the file, from 1
    rid: int
    round: int
    client: int
    prompt: tuple[int, ...]
    max_new_tokens: int


def parse_recorded(number: int, row: dict, path: str) -> RecordedRequest:
    where = f"--requests-file {path}:{number}"
    bad = next((name for name in ("rid", "round", "client") if not (is_integer(row.get(name)) and row[name] >= 0)), "")
    require(not bad, f"{where}: '{bad}' must be an integer >= 0, got {row.get(bad)!r}")
    prompt, output = row.get("prompt"), row.get("output")
    ok = isinstance(prompt, list) and bool(prompt) and all(is_integer(t) and t >= 0 for t in prompt)
    require(ok, f"{where}: 'prompt' must be a non-empty list of token ids (integers >= 0)")
    new = row.get("max_new_tokens", len(output) if isinstance(output, list) else None)
    require(
        is_integer(new) and new >= 1,
        f"{where}: 'max_new_tokens' (or the length of 'output') must be at least 1, got {new!r}",
    )
    return RecordedRequest(number, row["rid"], row["round"], row["client"], tuple(prompt), new)


def read_recorded_requests(path: str) -> tuple[RecordedRequest, ...]:
    """Every line of a requests.jsonl, checked: each rid once."""
    return _read(path, "requests")


def _read(path: str, kind: str):
    """A file read and checked once per version of it (the configuration asks for it again and again)."""
    return _parsed(path, Path(path).stat().st_mtime_ns if Path(path).is_file() else None, kind)


@functools.lru_cache(maxsize=8)
def _parsed(path: str, version: int | None, kind: str):
    if kind == "conversations":
        records = read_json(path, "--conversation-file")
        require(
            isinstance(records, list) and bool(records),
            f"--conversation-file {path}: needs a non-empty JSON list of records (ShareGPT's format)",
        )
        return tuple(parse_conversation(i, record, path) for i, record in enumerate(records))
    requests = tuple(parse_recorded(number, row, path) for number, row in read_jsonl(path, "--requests-file"))
    first: dict[int, int] = {}  # rid -> its line
    for r in requests:
        require(
            first.setdefault(r.rid, r.number) == r.number,
            f"--requests-file {path}:{r.number}: rid {r.rid} again (line {first[r.rid]})",
        )
    return requests
