"""What bench/e2e_ttft.py makes of its runs: when each request's first token came and which loads it waited for,
one round step by step, the bounds of each round and the cut ratios, the medians and the table.

Why the floor is a run of the same schedule. A round's prompts hold every conversation's whole history (the round
barrier), so when the history outgrows the device pool, as it must for anything to be loaded, the round cannot run
as one batch: its requests run in waves of as many as the pool holds, and a later wave's first tokens wait for the
earlier waves' prefills and decodes. A pool that holds everything (`all on device`) runs the round as one wave: that
is how fast a larger GPU is, not how fast this pool could be. The floor of the bounds is therefore `L2 on device`:
the L1 + L2 run itself (the same pools, cache, waves and copies) with the host pool's bytes in device memory, so
that its copies stay inside the GPU (20-50x PCIe's bandwidth). And a request's first token waits only for the loads
started at or before its own prefill, not for the round's later waves: the copy a round's bounds add is that of
the mean over its requests of the bytes loaded before each one's first token (`waited_tokens`).
"""

from __future__ import annotations

import math
import statistics

from bench.common import check, ratio

RUNS = ("L1 only", "L1 + L2", "L2 on device", "all on device")
TTFT_KEYS = {
    "L1 only": "l1_only_ttft_ms",
    "L1 + L2": "l1_l2_ttft_ms",
    "L2 on device": "l2_on_device_ttft_ms",
    "all on device": "all_on_device_ttft_ms",
}


def loaded_tokens(row: dict) -> int:
    """Tokens a round's requests had copied host -> device: those found on the host and those a prefetch brought
    to the host from storage (report.round_rows; a retracted request's second load is not counted again)."""
    return row["cached_host"] + row["cached_storage"]


def first_token_steps(steps: list[dict]) -> dict[int, int]:
    """Each request's first-token step: its last prefill step (chunk) before its first decode step."""
    first = {}
    for s in steps:  # in step order
        for rid in s["requests"]:
            if s["kind"] == "prefill" and first.get(rid, (None, True))[1]:
                first[rid] = (s["step"], True)  # a later chunk of the same prefill moves it on
            elif s["kind"] == "decode" and rid in first:
                first[rid] = (first[rid][0], False)  # decoding: the first token is out
    return {rid: step for rid, (step, _) in first.items()}


def round_steps(steps: list[dict], rids: set[int]) -> list[dict]:
    """The steps of one round: from its first request's first step to its last request's last."""
    mine = [s["step"] for s in steps if rids.intersection(s["requests"])]
    return [s for s in steps if mine and mine[0] <= s["step"] <= mine[-1]]


def waited_tokens(steps: list[dict], rids: set[int]) -> float:
    """The mean over a round's requests of the tokens loaded host -> device (`host_load_tokens`) in the round's
    steps up to and including each one's first-token step."""
    first, loaded, upto = first_token_steps(steps), 0, {}
    for s in round_steps(steps, rids):
        loaded += s["host_load_tokens"]
        upto[s["step"]] = loaded
    return statistics.fmean(upto[first[rid]] for rid in rids)


def waves(steps: list[dict], rids: set[int]) -> list[dict]:
    """One round step by step, cut where a prefill step begins: each piece's first tokens, the tokens its
    prefill loaded, its prefill ms and the decode steps that follow it (count and ms)."""
    first, pieces = first_token_steps(steps), []
    for s in round_steps(steps, rids):
        if s["kind"] == "prefill" or not pieces:
            firsts = sum(first.get(rid) == s["step"] for rid in rids)
            pieces.append({"first_tokens": firsts, "loaded_tokens": s["host_load_tokens"], "prefill_ms": s["ms"]})
            pieces[-1] |= {"decodes": 0, "decode_ms": 0.0}
        else:
            pieces[-1]["decodes"] += 1
            pieces[-1]["decode_ms"] += s["ms"]
    return pieces


def format_waves(label: str, pieces: list[dict], bytes_per_token: int) -> str:
    """A run's round on one line per piece: `prefill (first tokens, MB loaded) ms, then N decodes ms`."""
    lines = [f"  {label}:"]
    for p in pieces:
        mb = p["loaded_tokens"] * bytes_per_token / 1e6
        lines.append(
            f"    prefill: {p['first_tokens']:>2} first tokens, {mb:7.1f} MB loaded, {p['prefill_ms']:6.1f} ms; "
            f"then {p['decodes']} decodes, {p['decode_ms']:6.1f} ms"
        )
    return "\n".join(lines)


def bound_ms(floor: float, copy: float | None) -> dict:
    """A round's bounds: serial, the copy before the compute (floor + copy); overlap, the copy hidden under it
    (max of the two). None where the copy was not timed."""
    if copy is None:
        return {"serial_bound_ms": None, "overlap_bound_ms": None}
    return {"serial_bound_ms": floor + copy, "overlap_bound_ms": max(floor, copy)}


def cut_ratios(row: dict) -> dict:
    """L1 + L2's TTFT cut (L1 only - L1 + L2) as a ratio of each bound's cut (L1 only - bound): 1.0 = the bound
    reached. None where there is no bound, or it cuts nothing."""
    l1, got, ratios = row["l1_only_ttft_ms"], row["l1_l2_ttft_ms"], {}
    for name in ("serial", "overlap"):
        bound = row[f"{name}_bound_ms"]
        cut = None if bound is None else ratio(l1 - got, l1 - bound)
        ratios[f"cut_vs_{name}"] = cut if cut is not None and math.isfinite(cut) else None
    return ratios


def round_table(rounds: dict[str, list[dict]], copy_ms: list[float | None], bytes_per_token: int) -> list[dict]:
    """One row per round: the TTFTs, what L1 + L2 loaded and what its first tokens waited for, the copy time of
    the latter, the bounds on `L2 on device` and the ratios."""
    rows = []
    for i, l12 in enumerate(rounds["L1 + L2"]):
        row = {"round": l12["round"], **{TTFT_KEYS[k]: rounds[k][i]["ttft_ms"] for k in RUNS}}
        row |= {"loaded_tokens": l12["loaded_tokens"], "waited_tokens": l12["waited_tokens"]}
        row |= {"waited_bytes": l12["waited_tokens"] * bytes_per_token, "copy_ms": copy_ms[i]}
        row |= bound_ms(row["l2_on_device_ttft_ms"], copy_ms[i])
        rows.append(row | cut_ratios(row))
    return rows


def later_mean(rows: list[dict], later_from: int) -> dict:
    """The rounds from `later_from` on: mean TTFTs, tokens, copy time and bounds (a round's bound holds for that
    round, so the mean of the bounds bounds the mean TTFT), and the ratios of those means."""
    later = [r for r in rows if r["round"] >= later_from]
    check(bool(later), f"--later-from {later_from}: no round that late (the workload has {len(rows)})")
    mean = {"rounds": [r["round"] for r in later]}
    keys = ("loaded_tokens", "waited_tokens", "waited_bytes", "copy_ms", "serial_bound_ms", "overlap_bound_ms")
    for key in (*TTFT_KEYS.values(), *keys):
        values = [r[key] for r in later]
        mean[key] = None if None in values else statistics.fmean(values)
    return mean | cut_ratios(mean)


def median_of(tables: list):
    """The median, field by field, of equally shaped rows (or row lists) from each repeat; None stays None."""
    if isinstance(tables[0], list):
        return [median_of([t[i] for t in tables]) for i in range(len(tables[0]))]
    merged = {}
    for field, first in tables[0].items():
        values = [t[field] for t in tables]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        merged[field] = statistics.median(values) if numeric else first
    return merged


def of_medians(row: dict) -> dict:
    """A row of medians over repeats (`median_of`), its cut ratios taken of those medians. One run's TTFT moves by
    up to 2x from the next run's of the same configuration (bf16 on an H200, BENCHMARKS.md), and not with the run
    beside it in the repeat: pairing the runs of a repeat cancels nothing, and a ratio of differences of single runs
    swings widely (from -6.2 to 2.1 in one bench). The ratio of the medians does not."""
    return row | cut_ratios(row)


def _cell(value: float | None, decimals: int) -> str:
    return f"{'n/a':>8}" if value is None else f"{value:>8.{decimals}f}"


def format_table(rows: list[dict], mean: dict) -> str:
    """The per-round table and the mean of the later rounds, in ms (ratios: 1.0 = the bound reached)."""
    head = (
        f"{'round':>6} {'L1 only':>8} {'L1+L2':>8} {'L2 dev':>8} {'all dev':>8} {'waited':>9} {'copy':>8} "
        f"{'serial':>8} {'overlap':>8} {'cut/ser':>8} {'cut/ovl':>8}"
    )
    units = f"{'':>6} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8} {'MB':>9} {'ms':>8} {'ms':>8} {'ms':>8}"
    lines = [head, units]
    for label, r in [(str(r["round"]), r) for r in rows] + [(f">={mean['rounds'][0]}", mean)]:
        ratios = r["loaded_tokens"] > 0  # a round that loads nothing cuts nothing: its ratios are noise over noise
        ttfts = " ".join(f"{r[key]:>8.1f}" for key in TTFT_KEYS.values())
        lines.append(
            f"{label:>6} {ttfts} {r['waited_bytes'] / 1e6:>9.1f} {_cell(r['copy_ms'], 1)} "
            f"{_cell(r['serial_bound_ms'], 1)} {_cell(r['overlap_bound_ms'], 1)} "
            f"{_cell(r['cut_vs_serial'] if ratios else None, 2)} {_cell(r['cut_vs_overlap'] if ratios else None, 2)}"
        )
    return "\n".join(lines)
