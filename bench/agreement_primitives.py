"""Parts 2 and 3 of `bench.agreement_cost` (its docstring says what they measure), in worlds of gloo processes
spawned here. Part 2: a modelled pipeline whose stages agree once a step by the relay (`CacheSync._pp_sync`
verbatim, with the bounded drain), a barrier or an all-reduce over the PP group, or not at all; every stage's
step time and time in the agreement. Part 3: one combined [write, load] all-reduce vs two, in a tight loop.
What they print: bench/agreement_report.py."""

from __future__ import annotations

import datetime
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hicache_lab.entrypoints.launch import join_world, spawn_ranks

PP_VARIANTS = ("none", "relay", "barrier", "all_reduce")
SCENARIOS = ("equal", "slow_last")  # every stage's forward takes --stage-ms; the last stage's --slow-factor times
ATTN_OPS = ("combined_1x2", "separate_2x1")
MIN = dist.ReduceOp.MIN
HIDDEN = 256  # elements of the modelled activations (a few tokens of a small model)
TAG_HIDDEN, TAG_RING, TAG_RELAY = 0, 1, 2
# A timed step's marks (agreement_timeline.csv): it starts, the relay's drain ends (= start for the other
# variants), the agreement ends, the activations are in, the forward ends, the step ends (its activations or
# tokens sent on; stage 0 has also received the tokens of step - PP + 1).
TIMELINE_MARKS = ("start", "drained", "agreed", "received", "forwarded", "end")


def _agree(variant: str, data: torch.Tensor, rank: int, size: int, group, relay_works: list) -> float:
    """One agreement at the start of a step, as `CacheSync.agree_ack_counts` places it (before the forward).
    Returns the seconds spent in the relay's drain (0 for the other variants)."""
    start = time.perf_counter()
    if variant == "relay":  # CacheSync.drain_async_work (bounded_drain), then CacheSync._pp_sync
        for work in relay_works:
            work.wait()
        relay_works.clear()
        drained = time.perf_counter()
        if rank > 0:
            dist.recv(data, group_src=rank - 1, group=group, tag=TAG_RELAY)
        if rank + 1 < size:
            relay_works.append(dist.isend(data.clone(), group_dst=rank + 1, group=group, tag=TAG_RELAY))
        return drained - start
    if variant == "barrier":
        dist.barrier(group=group)
    elif variant == "all_reduce":
        dist.all_reduce(data, op=MIN, group=group)
    return 0.0


def _pipeline(variant: str, forward_s: float, rank: int, size: int, groups: tuple, args: dict) -> dict:
    """`args['warmup'] + args['steps']` steps of one stage of a modelled pipeline, shaped like
    `scheduler_pp.PPEventLoop`: agree; receive the activations from the previous stage (blocking); forward
    (a sleep of `forward_s`: a GPU stage's CPU waits on its device); send the activations on (async). The last
    stage sends the sampled tokens to stage 0, which takes back step j's at the end of step j + size - 1
    (`pp_loop_size` = pp micro-batch slots), so stage 0 runs at most a slot cycle ahead. Times the steps after
    the warmup: seconds per step, and per step the time in the agreement and in the activations' receive. With
    `args['timeline']`, also every timed step's marks (`TIMELINE_MARKS`, perf_counter seconds: on Linux
    CLOCK_MONOTONIC, one clock for every process of the machine)."""
    agree_group, act_group = groups
    data = torch.zeros(1, dtype=torch.int64)
    hidden = torch.zeros(HIDDEN)
    token = torch.zeros(1, dtype=torch.int64)
    relay_works: list = []
    sends: list[tuple[int, dist.Work]] = []
    last = size - 1
    agree_s = drain_s = act_s = 0.0
    marks: list[list[float]] = []  # per timed step: TIMELINE_MARKS
    start = time.perf_counter()
    for step in range(args["warmup"] + args["steps"]):
        if step == args["warmup"]:
            agree_s = drain_s = act_s = 0.0
            start = time.perf_counter()
        t0 = time.perf_counter()
        drained = _agree(variant, data, rank, size, agree_group, relay_works)
        t1 = time.perf_counter()
        if rank > 0:
            dist.recv(hidden, group_src=rank - 1, group=act_group, tag=TAG_HIDDEN)
        t2 = time.perf_counter()
        drain_s, agree_s, act_s = drain_s + drained, agree_s + t1 - t0, act_s + t2 - t1
        time.sleep(forward_s)
        if step >= args["warmup"] and args.get("timeline"):
            marks.append([t0, t0 + drained, t1, t2, time.perf_counter()])
        if rank < last:
            sends.append((step, dist.isend(hidden.clone(), group_dst=rank + 1, group=act_group, tag=TAG_HIDDEN)))
        else:
            sends.append((step, dist.isend(token.clone(), group_dst=0, group=act_group, tag=TAG_RING)))
        if rank == 0 and step >= last:
            dist.recv(token, group_src=last, group=act_group, tag=TAG_RING)
        for _, work in (s for s in sends if s[0] <= step - size):  # scheduler_pp.drain_sends' bound
            work.wait()
        sends = [s for s in sends if s[0] > step - size]
        if marks and len(marks[-1]) < len(TIMELINE_MARKS):
            marks[-1].append(time.perf_counter())
    elapsed = time.perf_counter() - start
    if rank == 0:  # the tokens of the last size - 1 steps
        for _ in range(last):
            dist.recv(token, group_src=last, group=act_group, tag=TAG_RING)
    for work in relay_works + [w for _, w in sends]:
        work.wait()
    steps = args["steps"]
    return {
        "step_s": elapsed / steps,
        "agree_s": agree_s / steps,
        "drain_s": drain_s / steps,
        "act_wait_s": act_s / steps,
        "timeline": marks,
    }


def _time_attn_op(op: str, group, calls: int) -> float:
    """Per step: build the ack tensor(s), agree (MIN), read back, as `CacheSync.agree_ack_counts` does."""
    write, load = 3, 1
    start = time.perf_counter()
    for _ in range(calls):
        if op == "combined_1x2":
            data = torch.tensor([write, load], dtype=torch.int64)
            dist.all_reduce(data, op=MIN, group=group)
            data.tolist()
        else:
            for local in (write, load):
                data = torch.tensor([local], dtype=torch.int64)
                dist.all_reduce(data, op=MIN, group=group)
                int(data.item())
    return time.perf_counter() - start


def _world_main(rank: int, size: int, port: int, args: dict, out_dir: str) -> None:
    torch.set_num_threads(1)  # as entrypoints/rank.run_rank: tiny tensors, shared cores
    join_world(rank, size, port, args["timeout_s"])
    timeout = datetime.timedelta(seconds=args["timeout_s"])
    everyone = list(range(size))
    groups = tuple(dist.new_group(everyone, backend="gloo", timeout=timeout) for _ in range(2))  # agree, act
    attn_size = min(2, size)
    attn_group = dist.new_group(list(range(attn_size)), backend="gloo", timeout=timeout)
    records = []
    for block in range(args["blocks"]):
        for scenario in SCENARIOS:
            for variant in PP_VARIANTS:
                slow = args["slow_factor"] if scenario == "slow_last" and rank == size - 1 else 1.0
                dist.barrier(group=groups[0])
                rec = _pipeline(variant, args["stage_ms"] * slow / 1e3, rank, size, groups, args)
                records.append({"part": "pipeline", "scenario": scenario, "op": variant, "block": block, **rec})
        for op in ATTN_OPS:
            dist.barrier(group=groups[0])
            if rank < attn_size:
                _time_attn_op(op, attn_group, args["warmup"])
                dist.barrier(group=attn_group)
                loop_s = _time_attn_op(op, attn_group, args["calls"])
                records.append({"part": "attn", "op": op, "block": block, "loop_s": loop_s})
    dist.barrier(group=groups[0])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    dist.destroy_process_group()


def measure_world(size: int, args: dict) -> dict[int, list[dict]]:
    with tempfile.TemporaryDirectory() as scratch:
        codes = spawn_ranks(_world_main, size, (args, scratch), timeout_s=4 * args["timeout_s"])
        if codes != [0] * size:
            raise RuntimeError(f"a rank of the world of {size} failed: exit codes {codes}")
        return {rank: json.loads(Path(scratch, f"rank{rank}.json").read_text()) for rank in range(size)}


PIPELINE_METRICS = (  # record key, CSV metric, scale, unit, note
    ("step_s", "step_ms", 1e3, "ms", "this stage's wall time per step (the last stage's is the pipeline's)"),
    ("agree_s", "agree_us_per_step", 1e6, "us", "time in the agreement per step (relay: drain, recv, isend)"),
    ("drain_s", "drain_us_per_step", 1e6, "us", "of which the relay's drain: its previous send received"),
    ("act_wait_s", "act_wait_us_per_step", 1e6, "us", "time receiving the previous stage's activations per step"),
)


def timeline_rows(size: int, per_rank: dict[int, list[dict]]) -> list[dict]:
    """agreement_timeline.csv's rows of one world: one per stage and timed step of every run (scenario, variant,
    block), its `TIMELINE_MARKS` in ms from the moment the run's first stage began its first timed step."""
    runs: dict[tuple, dict[int, list]] = {}
    for rank, records in per_rank.items():
        for rec in records:
            if rec["part"] == "pipeline" and rec["timeline"]:
                runs.setdefault((rec["scenario"], rec["op"], rec["block"]), {})[rank] = rec["timeline"]
    rows = []
    for (scenario, variant, block), by_rank in runs.items():
        origin = min(marks[0][0] for marks in by_rank.values())
        for rank, marks in sorted(by_rank.items()):
            for step, times in enumerate(marks):
                where = {"pp": size, "scenario": scenario, "variant": variant, "block": block, "rank": rank}
                ms = {name: round((t - origin) * 1e3, 4) for name, t in zip(TIMELINE_MARKS, times, strict=True)}
                rows.append({**where, "step": step, **ms})
    return rows


def measure_primitives(pp_sizes: list[int], args: dict) -> tuple[list[dict], dict, list[dict]]:
    """CSV rows (one per stage, measurement and block), {pp: {key: {rank: [value per block]}}}, key
    (scenario, variant, metric) for part 2 and ('attn', op, 'us_per_step') for part 3, and with
    `args['timeline']` the timeline's rows (`timeline_rows`; else none)."""
    rows, values, timeline = [], {}, []
    for size in pp_sizes:
        started = time.perf_counter()
        per_rank = measure_world(size, args)
        print(f"  world of {size} ranks: {time.perf_counter() - started:.1f} s")
        timeline += timeline_rows(size, per_rank)
        rows += [row for rank, records in per_rank.items() for rec in records for row in _rows(size, rank, rec, args)]
        rows += _forward_rows(size, args)
        for row in rows:
            if row["pp"] == size and row["metric"] != "forward_ms":
                key = (row["scenario"] or "attn", row["variant"], row["metric"])
                values.setdefault(size, {}).setdefault(key, {}).setdefault(row["rank"], []).append(row["value"])
    return rows, values, timeline


def _rows(size: int, rank: int, rec: dict, args: dict) -> list[dict]:
    """The CSV rows of one record of a stage: a pipeline run's `PIPELINE_METRICS`, or an attention op's loop."""
    base = {"pp": size, "variant": rec["op"], "rank": rank, "repeat": rec["block"]}
    if rec["part"] != "pipeline":
        return [
            {
                **base,
                "part": "attn_agreement",
                "scenario": "",
                "metric": "us_per_step",
                "value": rec["loop_s"] / args["calls"] * 1e6,
                "unit": "us",
                "n": args["calls"],
                "note": "attention group = ranks 0, 1",
            }
        ]
    return [
        {
            **base,
            "part": "pipeline",
            "scenario": rec["scenario"],
            "metric": metric,
            "value": rec[key] * scale,
            "unit": unit,
            "n": args["steps"],
            "note": note,
        }
        for key, metric, scale, unit, note in PIPELINE_METRICS
    ]


def _forward_rows(size: int, args: dict) -> list[dict]:
    """Each stage's modelled forward in each scenario, for reference lines."""
    return [
        {
            "part": "pipeline",
            "pp": size,
            "scenario": scenario,
            "variant": "",
            "rank": rank,
            "repeat": "",
            "metric": "forward_ms",
            "value": args["stage_ms"] * (args["slow_factor"] if scenario == "slow_last" and rank == size - 1 else 1.0),
            "unit": "ms",
            "n": "",
            "note": "the modelled forward (a sleep) of this stage",
        }
        for scenario in SCENARIOS
        for rank in range(size)
    ]
