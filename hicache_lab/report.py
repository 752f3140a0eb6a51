"""Per-round statistics, the summary table, and the files a run leaves behind."""

from __future__ import annotations

import json
from pathlib import Path

from .config import RunConfig
from .scheduler import Req, StepRecord


def round_rows(reqs: list[Req], records: list[StepRecord]) -> list[dict]:
    """One row per round: hit rates by tier against the infinite-cache bound, TTFT and step time."""
    rows = []
    for round_ in sorted({r.round for r in reqs}):
        batch = [r for r in reqs if r.round == round_]
        rids = {r.rid for r in batch}
        steps = [s.ms for s in records if rids.intersection(s.requests)]
        prompt = sum(len(r.prompt) for r in batch)
        device = sum(r.cached_device for r in batch)
        host = sum(r.cached_host for r in batch)
        rows.append(
            {
                "round": round_,
                "requests": len(batch),
                "prompt_tokens": prompt,
                "cached_tokens": device + host,
                "cached_device": device,
                "cached_host": host,
                "cached_storage": 0,
                "hit_rate": (device + host) / prompt,
                "upper_bound_hit_rate": sum(r.upper_bound_cached for r in batch) / prompt,
                "ttft_ms": 1e3 * sum(r.first_token_at - r.arrival for r in batch) / len(batch),
                "step_ms": sum(steps) / len(steps) if steps else 0.0,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'round':>5} {'prompt':>7} {'device':>7} {'host':>6} {'hit':>6} {'bound':>6} {'ttft_ms':>8} {'step_ms':>8}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['round']:>5} {r['prompt_tokens']:>7} {r['cached_device']:>7} {r['cached_host']:>6} "
            f"{r['hit_rate']:>6.1%} {r['upper_bound_hit_rate']:>6.1%} {r['ttft_ms']:>8.1f} {r['step_ms']:>8.2f}"
        )
    return "\n".join(lines)


def mean_hit_rate(rows: list[dict], first: int, last: int, key: str = "hit_rate") -> float:
    """Mean of `key` over rounds first..last (inclusive)."""
    chosen = [r[key] for r in rows if first <= r["round"] <= last]
    return sum(chosen) / len(chosen) if chosen else float("nan")


def sglang_flags(cfg: RunConfig) -> str:
    """The SGLang server flags this run corresponds to."""
    p, c = cfg.parallel, cfg.cache
    flags = [f"--tp-size {p.tp * p.cp}", f"--pp-size {p.pp}", f"--page-size {c.page_size}"]
    flags.append(f"--max-total-tokens {c.max_total_tokens}")
    if p.cp > 1:
        flags.append(f"--attn-cp-size {p.cp}")
    if c.enable_hierarchical_cache:
        flags.append("--enable-hierarchical-cache")
        size = f"--hicache-size {c.hicache_size_gb:g}" if c.hicache_size_gb else f"--hicache-ratio {c.hicache_ratio:g}"
        flags += [size, f"--hicache-write-policy {c.write_policy}", f"--hicache-mem-layout {c.host_layout}"]
    return " ".join(flags)


def write_outputs(out_dir: Path, summary: dict, reqs: list[Req]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out_dir / "requests.jsonl", "w") as f:
        for r in reqs:
            record = {
                "rid": r.rid,
                "round": r.round,
                "client": r.client,
                "prompt": r.prompt,
                "output": r.output,
            }
            f.write(json.dumps(record) + "\n")
