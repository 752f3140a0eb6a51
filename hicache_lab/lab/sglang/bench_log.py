"""SGLang's bench_multiturn results, read for `run --compare-sglang LOG` (figures/against_sglang.py prints and
plots them beside a run's hit rates).

They are the JSONL that SGLang's `benchmark/hicache/bench_multiturn.py` appends to its `--log-file`, one line per
run: `{"tag", "summary": {"cache_hit_rate", "average_ttft", ...}, "round": {"round_0": {"cache_hit_rate",
"average_ttft", "request_count"}, ...}}` (the `round` part with `--enable-round-barrier`). `read_bench_multiturn`
turns them into rows the lab's plots take.
"""

from __future__ import annotations

import re

from ...errors import ConfigError
from ...jsonl import is_integer, is_number, read_jsonl


def read_bench_multiturn(path: str) -> list[dict]:
    """One row per run and round of a bench_multiturn log: tag, round (None for a run without rounds),
    hit_rate, ttft_ms, requests. Every field is checked; a ConfigError names the file, line and field."""
    rows = []
    for number, run in read_jsonl(path, "bench_multiturn log"):
        where = f"bench_multiturn log {path}:{number}"
        summary, tag, rounds = run.get("summary"), run.get("tag"), run.get("round")
        if not isinstance(summary, dict) or "cache_hit_rate" not in summary:
            raise ConfigError(
                f"{where}: no 'summary.cache_hit_rate'; is this bench_multiturn's --log-file (a version that "
                "reports cache hits)?"
            )
        if tag is not None and not isinstance(tag, str):
            raise ConfigError(f"{where}: 'tag' must be a string, got {tag!r}")
        if rounds is None or rounds == {}:  # a run without --enable-round-barrier
            parts = {None: ("summary", summary, "total_requests")}
        elif isinstance(rounds, dict):
            parts = {_round_number(key, where): (f"round.{key}", r, "request_count") for key, r in rounds.items()}
            if len(parts) < len(rounds):
                raise ConfigError(f"{where}: 'round' names a round twice ({', '.join(rounds)})")
        else:
            raise ConfigError(f"{where}: 'round' must be an object of round_N entries, got {rounds!r}")
        for round_, (name, part, count) in sorted(parts.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            rows.append(
                {"tag": tag or f"line {number}", "round": round_, **_round_row(part, count, f"{where}: '{name}'")}
            )
    return rows


def _round_number(key: str, where: str) -> int:
    if not (match := re.fullmatch(r"round_(\d+)", key)):
        raise ConfigError(f"{where}: 'round' key {key!r} is not round_N (N = 0, 1, ...)")
    return int(match.group(1))


def _round_row(part: object, count_key: str, where: str) -> dict:
    """hit_rate, ttft_ms, requests of one round (or a run's summary), each field checked."""
    if not isinstance(part, dict):
        raise ConfigError(f"{where} must be an object, got {part!r}")
    hit, ttft, count = part.get("cache_hit_rate"), part.get("average_ttft"), part.get(count_key, 0)
    if not (is_number(hit) and 0 <= hit <= 1):
        raise ConfigError(f"{where}: 'cache_hit_rate' must be a number in 0..1, got {hit!r}")
    if not (ttft is None or (is_number(ttft) and ttft >= 0)):
        raise ConfigError(f"{where}: 'average_ttft' must be a number of seconds >= 0, got {ttft!r}")
    if not (count is None or (is_integer(count) and count >= 0)):
        raise ConfigError(f"{where}: '{count_key}' must be an integer >= 0, got {count!r}")
    return {"hit_rate": float(hit), "ttft_ms": float("nan") if ttft is None else ttft * 1e3, "requests": count or 0}
