"""Parts 2 and 3 of `bench.agreement_cost` (its docstring says what they measure): the agreement primitives
alone, timed in worlds of gloo processes spawned here. Part 2: the relay (`CacheSync._pp_sync` verbatim) vs a
barrier vs an all-reduce over the PP group; part 3: one combined [write, load] all-reduce vs two."""

from __future__ import annotations

import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import ratio
from hicache_lab.entrypoints.launch import join_world, spawn_ranks

PP_OPS = ("relay", "barrier", "all_reduce")
ATTN_OPS = ("combined_1x2", "separate_2x1")
MIN = dist.ReduceOp.MIN


def _relay(data: torch.Tensor, rank: int, size: int, group, calls: int) -> tuple[float, float]:
    """`CacheSync._pp_sync` `calls` times, then the drain: (loop seconds, drain seconds)."""
    works = []
    start = time.perf_counter()
    for _ in range(calls):
        if rank > 0:
            dist.recv(data, group_src=rank - 1, group=group, tag=2)
        if rank + 1 < size:
            works.append(dist.isend(data.clone(), group_dst=rank + 1, group=group, tag=2))
    looped = time.perf_counter()
    for work in works:
        work.wait()
    return looped - start, time.perf_counter() - looped


def _time_pp_op(op: str, rank: int, size: int, group, calls: int) -> tuple[float, float]:
    if op == "relay":
        return _relay(torch.zeros(1, dtype=torch.int64), rank, size, group, calls)
    start = time.perf_counter()
    if op == "barrier":
        for _ in range(calls):
            dist.barrier(group=group)
    else:
        data = torch.ones(1, dtype=torch.int64)
        for _ in range(calls):
            dist.all_reduce(data, op=MIN, group=group)
    return time.perf_counter() - start, 0.0


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
    pp_group = dist.new_group(list(range(size)), backend="gloo", timeout=timeout)
    attn_size = min(2, size)
    attn_group = dist.new_group(list(range(attn_size)), backend="gloo", timeout=timeout)
    calls, warmup, records = args["calls"], args["warmup"], []
    for block in range(args["blocks"]):
        for op in PP_OPS:
            dist.barrier(group=pp_group)
            _time_pp_op(op, rank, size, pp_group, warmup)
            dist.barrier(group=pp_group)
            loop_s, drain_s = _time_pp_op(op, rank, size, pp_group, calls)
            records.append({"part": "pp", "op": op, "block": block, "loop_s": loop_s, "drain_s": drain_s})
        for op in ATTN_OPS:
            dist.barrier(group=pp_group)
            if rank < attn_size:
                _time_attn_op(op, attn_group, warmup)
                dist.barrier(group=attn_group)
                loop_s = _time_attn_op(op, attn_group, calls)
                records.append({"part": "attn", "op": op, "block": block, "loop_s": loop_s, "drain_s": 0.0})
    dist.barrier(group=pp_group)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    dist.destroy_process_group()


def measure_world(size: int, args: dict) -> dict[int, list[dict]]:
    with tempfile.TemporaryDirectory() as scratch:
        codes = spawn_ranks(_world_main, size, (args, scratch), timeout_s=4 * args["timeout_s"])
        if codes != [0] * size:
            raise RuntimeError(f"a rank of the world of {size} failed: exit codes {codes}")
        return {rank: json.loads(Path(scratch, f"rank{rank}.json").read_text()) for rank in range(size)}


def measure_primitives(pp_sizes: list[int], args: dict) -> tuple[list[dict], dict]:
    """CSV rows (one per rank, op and block) and {pp: {part: {op: {rank: median us per call}}}}."""
    rows, medians = [], {}
    for size in pp_sizes:
        started = time.perf_counter()
        per_rank = measure_world(size, args)
        print(f"  world of {size} ranks: {time.perf_counter() - started:.1f} s")
        for rank, records in per_rank.items():
            for rec in records:
                us = rec["loop_s"] / args["calls"] * 1e6
                part = "pp_agreement" if rec["part"] == "pp" else "attn_agreement"
                metric = "us_per_call" if rec["part"] == "pp" else "us_per_step"
                note = "" if rec["part"] == "pp" else "attention group = ranks 0, 1"
                rows.append(
                    {
                        "part": part,
                        "pp": size,
                        "variant": rec["op"],
                        "rank": rank,
                        "repeat": rec["block"],
                        "metric": metric,
                        "value": us,
                        "unit": "us",
                        "n": args["calls"],
                        "note": note,
                    }
                )
                if rec["op"] == "relay":
                    rows.append(
                        {
                            **rows[-1],
                            "metric": "drain_us_per_call",
                            "value": rec["drain_s"] / args["calls"] * 1e6,
                            "note": "waiting once, after the loop, for every isend handle",
                        }
                    )
        for row in rows:
            if row["pp"] != size:
                continue
            medians.setdefault(size, {}).setdefault(row["part"], {}).setdefault(
                row["variant"] + ("" if row["metric"] != "drain_us_per_call" else "_drain"), {}
            ).setdefault(row["rank"], []).append(row["value"])
    for parts in medians.values():
        for ops in parts.values():
            for op, by_rank in ops.items():
                ops[op] = {rank: statistics.median(v) for rank, v in by_rank.items()}
    return rows, medians


def report_primitives(medians: dict) -> dict:
    summary = {}
    print("\nPP group: microseconds per call (median block); relay loop excludes its drain, shown apart")
    print(
        f"{'pp':>3} {'rank':>6} {'relay':>9} {'drain':>9} {'barrier':>9} {'all_reduce':>10} "
        f"{'relay/barrier':>14} {'relay/all_reduce':>17}"
    )
    for size, parts in medians.items():
        ops = parts["pp_agreement"]
        for rank, label in ((0, "0"), (size - 1, "last")):
            relay, barrier, allred = ops["relay"][rank], ops["barrier"][rank], ops["all_reduce"][rank]
            drain = ops["relay_drain"][rank]
            r_b, r_a = ratio(relay, barrier), ratio(relay, allred)
            print(
                f"{size:3} {label:>6} {relay:9.1f} {drain:9.1f} {barrier:9.1f} {allred:10.1f} {r_b:14.3f} {r_a:17.3f}"
            )
            summary.setdefault(str(size), {})[f"rank_{label}"] = {
                "relay_us": relay,
                "relay_drain_us_per_call": drain,
                "barrier_us": barrier,
                "all_reduce_us": allred,
                "relay/barrier": r_b,
                "relay/all_reduce": r_a,
            }
    print(
        "  rank 0's relay is the isend alone: the relay never makes stage 0 wait; the last rank's relay is the "
        "recv, what the pipeline pays.\n  drain: the once-a-round wait for the isend handles, per call (rank 0 "
        "waits for the next stage to have received everything)."
    )
    print("\nattention group of 2 (ranks 0, 1): microseconds per step, [write, load] agreed (MIN)")
    print(f"{'pp world':>8} {'rank':>5} {'one 2-elem':>11} {'two 1-elem':>11} {'two/one':>8}")
    for size, parts in medians.items():
        ops = parts["attn_agreement"]
        for rank in (0, 1) if size > 1 else (0,):
            one, two = ops["combined_1x2"][rank], ops["separate_2x1"][rank]
            print(f"{size:8} {rank:5} {one:11.1f} {two:11.1f} {ratio(two, one):8.3f}")
            summary.setdefault(str(size), {})[f"attn_rank_{rank}"] = {
                "combined_us_per_step": one,
                "separate_us_per_step": two,
                "separate/combined": ratio(two, one),
            }
    return summary
