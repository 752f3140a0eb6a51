"""A GPU timeline of one round of bench/e2e_ttft.py's workload: where its milliseconds go, stream by stream.

L1 + L2 and L2 on device (e2e_ttft.py says what each is) run the bench's workload with the torch profiler on for
one round (`--round`): a binder starts it as the round begins, after a CUDA synchronize, and stops it as the next
begins, after another. From the profiler's record of every kernel and copy on the GPU it reports, for that
window:

* the wall time, the time some stream ran something (GPU busy), and the time none did (the GPU waited on the CPU:
  Python launching the forward's kernels one by one, the scheduler between steps);
* each stream (the forward's, the copy engine's load and write streams, the staging ring's helper): its busy time,
  its kernels and copies by total time, and how much of a copy stream's busy time ran beside the forward's
  kernels (hidden) and how much while the forward's stream was idle.

The profiler costs CPU time per launch, so the window's wall time is longer than an unprofiled round's; the GPU's
own times are not.

    PYTHONPATH=. python -m bench.gpu_timeline --device cuda --latency real --dtype bfloat16

Writes bench/results/gpu_timeline.json (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from bench import e2e_ttft
from bench.common import RESULTS, check, machine_info, write_json
from hicache_lab.args import add_run_flags, config_from_args
from hicache_lab.entrypoints.binders import Binder, RankParts
from hicache_lab.lab.binders import run

GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) spans, in the spans' unit / 1e3 (µs in, ms out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def overlap_ms(spans: list[tuple[float, float]], others: list[tuple[float, float]]) -> float:
    """How long `spans` ran while some span of `others` did (µs in, ms out)."""
    both = union_ms(spans) + union_ms(others) - union_ms(spans + others)
    return max(both, 0.0)


def streams(trace: dict) -> dict[int, list[dict]]:
    """The GPU events of a chrome trace by stream."""
    by_stream: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in GPU_EVENTS:
            by_stream.setdefault(int(e["args"]["stream"]), []).append(e)
    return by_stream


def summarize(trace: dict, wall_ms: float) -> dict:
    """Where the window's milliseconds went (the module's docstring says what)."""
    by_stream = streams(trace)
    check(bool(by_stream), "the profiler recorded nothing on the GPU")
    spans = {s: [(e["ts"], e["ts"] + e["dur"]) for e in events] for s, events in by_stream.items()}
    forward = max(by_stream, key=lambda s: len(by_stream[s]))  # the forward launches the most
    everything = [span for ss in spans.values() for span in ss]
    rows = []
    for s, events in sorted(by_stream.items(), key=lambda item: -union_ms(spans[item[0]])):
        names = Counter()
        for e in events:
            names[e["name"][:60]] += e["dur"] / 1e3
        row = {"stream": s, "role": "forward" if s == forward else "copies", "busy_ms": union_ms(spans[s])}
        row |= {"events": len(events), "top": [[n, round(ms, 2)] for n, ms in names.most_common(4)]}
        if s != forward:
            row["beside_forward_ms"] = overlap_ms(spans[s], spans[forward])
            row["forward_idle_ms"] = row["busy_ms"] - row["beside_forward_ms"]
        rows.append(row)
    busy = union_ms(everything)
    return {"wall_ms": wall_ms, "gpu_busy_ms": busy, "gpu_idle_ms": wall_ms - busy, "streams": rows}


class RoundProfiler(Binder):
    """Profiles the rank's GPU through round `round_` (the k-th `Scheduler.new_round` call begins round k) and
    writes its summary to the run's directory (`gpu_timeline.json`)."""

    def __init__(self, round_: int):
        self.round = round_

    def bind(self, cfg, parts: RankParts, out_dir):
        scheduler, state = parts.loop.scheduler, {"rounds": 0, "profiler": None}
        new_round = scheduler.new_round

        def stop() -> None:
            profiler, state["profiler"] = state["profiler"], None
            if profiler is None:
                return
            torch.cuda.synchronize()
            profiler.stop()
            wall_ms = 1e3 * (time.perf_counter() - state["start"])
            path = Path(out_dir) / "trace.json"
            profiler.export_chrome_trace(str(path))
            summary = summarize(json.loads(path.read_text()), wall_ms)
            (Path(out_dir) / "gpu_timeline.json").write_text(json.dumps(summary))

        def timed_round(flush: bool) -> None:
            if state["rounds"] == self.round + 1:
                stop()
            if state["rounds"] == self.round:
                torch.cuda.synchronize()
                state["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                state["profiler"].start()
                state["start"] = time.perf_counter()
            state["rounds"] += 1
            new_round(flush)

        scheduler.new_round = timed_round
        return lambda: stop() or {}


def format_summary(label: str, s: dict) -> str:
    lines = [
        f"  {label}: {s['wall_ms']:.1f} ms; the GPU ran something for {s['gpu_busy_ms']:.1f} ms and nothing for "
        f"{s['gpu_idle_ms']:.1f} ms"
    ]
    for r in s["streams"]:
        hidden = ""
        if r["role"] == "copies":
            hidden = f"; {r['beside_forward_ms']:.1f} ms beside the forward's kernels, {r['forward_idle_ms']:.1f} alone"
        top = ", ".join(f"{name} {ms:.1f}" for name, ms in r["top"])
        busy = f"busy {r['busy_ms']:.1f} ms, {r['events']} events"
        lines.append(f"    stream {r['stream']} ({r['role']}): {busy}{hidden}")
        lines.append(f"      top: {top}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, **e2e_ttft.REALISTIC)
    parser.add_argument("--round", type=int, default=3, help="the round profiled (counts from 0)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_timeline.json", help="where the JSON goes")
    args = parser.parse_args(argv)
    base = config_from_args(args)
    check(base.device == "cuda", "--device cuda: the profile is of a GPU's streams")
    check(0 <= args.round < base.workload.num_rounds, f"--round {args.round}: the workload has no such round")
    configs = e2e_ttft.run_configs(base)
    result = {"machine": machine_info(gpu=torch.cuda.get_device_name(), dtype=base.model.dtype), "round": args.round}
    print(f"round {args.round}, GPU streams (ms):")
    for label in ("L1 + L2", "L2 on device"):
        more = [RoundProfiler(args.round)] + ([e2e_ttft.HOST_POOL_ON_DEVICE] if label == "L2 on device" else [])
        with tempfile.TemporaryDirectory(prefix="gpu_timeline_") as out:
            summary = run(configs[label], Path(out), verbose=False, more=tuple(more))
            check(summary["completed"], f"{label}: the run failed: {summary['error']}")
            result[label] = json.loads((Path(out) / "gpu_timeline.json").read_text())
        result[label]["ttft_ms"] = summary["rounds"][args.round]["ttft_ms"]
        print(format_summary(label, result[label]))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
