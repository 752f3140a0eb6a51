"""Exhaustive check on small worlds: every completion timing of a few in-flight host writes, on every stage.

A gloo world of 2 or 3 pipeline stages (processes; no model) runs the real `CacheSync` and `HiRadixCache` of each
stage through one scripted schedule: at step i a stage inserts sequence i (its write-through host copy starts as the
batch ends), and every step it advances the copies, consumes the agreed acks (`check_hicache_events`) and evicts one
sequence's worth of device slots. Copy i completes d_i steps after it was issued (d_i in 0..max_delay, in order, as
a stream does: `ScriptedCopyEngine`), separately on each stage; every combination of the stages' distinct completion
timings is played in each sync mode. A schedule *breaks* a mode when two stages hold different trees (digest:
structure, tiers, locks) after any step.

    python -m hicache_lab exhaustive --stages 2 --copies 3 --max-delay 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import tempfile
from pathlib import Path

import torch.distributed as dist

from ...config import CacheConfig
from ...distributed.cache_sync import CacheSync
from ...distributed.parallel_state import RankLayout, build_groups
from ...entrypoints.launch import join_world, spawn_ranks
from ...entrypoints.preflight import check_writable_dir
from ...errors import ConfigError
from ...mem_cache.build import KVShape, build_cache
from ...mem_cache.copy_engine import VirtualCopyEngine
from ...parallel_config import SYNC_MODES, ParallelConfig

SEQ = 4  # tokens per inserted sequence
TIMEOUT_S = 30
MAX_STAGE_STEPS = 150_000  # schedules x modes x steps x stages: ~0.5-0.75 ms each on 2 cores, a minute or two


class ScriptedCopyEngine(VirtualCopyEngine):
    """The virtual engine with the delays given instead of drawn: copy i completes `delays[i]` steps after it
    was issued (still in order per stream), so a test can enumerate every completion order."""

    def __init__(self, delays: list[int]):
        super().__init__(max(delays, default=0), seed=0, rank=0)
        self.script = list(delays)

    def _delay(self) -> int:
        return self.script.pop(0)


def completion_steps(delays: tuple[int, ...]) -> tuple[int, ...]:
    """The step at whose ack check each copy is seen finished. Copy i is issued at step i, as the scheduler
    issues writes: when step i starts, before the engine advances to it (it stands at i - 1, or 0 at first),
    so it is due `delay` steps after that; it is seen at step i at the earliest; a stream completes in order."""
    due, steps = 0, []
    for issued, delay in enumerate(delays):
        due = max(due, issued, max(issued - 1, 0) + delay)
        steps.append(due)
    return tuple(steps)


def timings(copies: int, max_delay: int) -> list[tuple[int, ...]]:
    """Delays giving every distinct completion timing of `copies` writes, one each: the smallest delays that
    give it, in order. Built copy by copy (copy i can complete at any step from `lo`, where the copy before it
    and its issue put it, to `base + max_delay`), so the work is the number of timings, not (max_delay + 1) **
    copies."""
    found = [((), 0)]  # (delays so far, the last copy's completion step)
    for issued in range(copies):
        base = max(issued - 1, 0)
        found = [
            (delays + (0 if due == lo else due - base,), due)
            for delays, last in found
            for lo in [max(last, issued)]
            for due in range(lo, max(lo, base + max_delay) + 1)
        ]
    return [delays for delays, _ in found]


def count_timings(copies: int, max_delay: int, cap: float = math.inf) -> int:
    """len(timings(copies, max_delay)), counted without building them (ways to reach each completion step);
    once past `cap`, a number past it (a copy more never has fewer timings)."""
    ways = {0: 1}
    for issued in range(copies):
        base, reached = max(issued - 1, 0), {}
        for last, n in ways.items():
            lo = max(last, issued)
            for due in range(lo, max(lo, base + max_delay) + 1):
                reached[due] = reached.get(due, 0) + n
        ways = reached
        if sum(ways.values()) > cap:
            break
    return sum(ways.values())


def play(delays: tuple[int, ...], steps: int, sync: CacheSync) -> list[str]:
    """One stage through the schedule (the same number of steps on every stage); the digest after each."""
    copies = len(delays)
    cfg = CacheConfig(max_total_tokens=SEQ * copies, enable_hierarchical_cache=True, hicache_ratio=2)
    engine = ScriptedCopyEngine(list(delays))
    _, cache = build_cache(cfg, KVShape(num_layers=1, num_heads=1, head_dim=2), sync, engine=engine)
    digests = []
    for step in range(steps):
        if step < copies:
            cache.insert(tuple(range(step * SEQ + 1, (step + 1) * SEQ + 1)), cache.alloc_device(SEQ))
            cache.flush_pending_backups()  # as a batch's results end
        cache.advance(step)
        cache.check_hicache_events()
        cache.evict(SEQ)
        digests.append(cache.tree.digest())
    sync.drain_async_work()
    return digests


def _stage(rank: int, stages: int, port: int, schedules: list, steps: int, modes: list[str], result: Path) -> None:
    join_world(rank, stages, port, TIMEOUT_S)
    groups = build_groups(RankLayout(1, 1, stages, rank), ParallelConfig(pp=stages, collective_timeout_s=TIMEOUT_S))
    report = {}
    for mode in modes:
        sync = CacheSync(groups, ParallelConfig(pp=stages, sync=mode))
        mine = [play(schedule[rank], steps, sync) for schedule in schedules]
        everyone = [None] * stages
        dist.all_gather_object(everyone, mine)
        broken = [s for i, s in enumerate(schedules) if any(d[i] != everyone[0][i] for d in everyone)]
        report[mode] = {"schedules": len(schedules), "broken": len(broken), "breaking": broken}
    if rank == 0:
        result.write_text(json.dumps(report))
    dist.destroy_process_group()


def check(stages: int, copies: int, max_delay: int, modes: list[str]) -> dict:
    """Play every schedule in each mode: {mode: {schedules, broken, breaking: [per-stage delays, ...]}}.
    The work is counted first and refused past MAX_STAGE_STEPS (a ConfigError naming the flags)."""
    work = check_work(stages, copies, max_delay, modes)
    schedules = list(itertools.product(timings(copies, max_delay), repeat=stages))
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "result.json"
        limit = TIMEOUT_S + work / 1000  # 1 ms a stage-step, twice what 2 cores take
        codes = spawn_ranks(_stage, stages, (schedules, copies + max_delay + 1, modes, result), limit)
        if not result.exists():
            raise RuntimeError(f"the exhaustive world failed: exit codes {codes}")
        return json.loads(result.read_text())


def check_work(stages: int, copies: int, max_delay: int, modes: list[str]) -> int:
    """Stage-steps the check would play (schedules x modes x steps x stages), counted before any is built;
    a ConfigError naming the flags where they are out of range or the work past MAX_STAGE_STEPS."""
    if stages not in (2, 3) or copies < 1 or max_delay < 0 or not modes:
        raise ConfigError(
            f"--stages {stages} --copies {copies} --max-delay {max_delay}: give 2 or 3 stages, at least 1 copy, "
            "a delay of at least 0 steps and at least one mode"
        )
    per_schedule = len(modes) * (copies + max_delay + 1) * stages
    most = MAX_STAGE_STEPS / per_schedule
    first = (max_delay + 1) ** stages  # the first copies alone: past the bound, nothing more need be counted
    schedules = first if first > most else count_timings(copies, max_delay, cap=most ** (1 / stages)) ** stages
    if schedules > most:
        raise ConfigError(
            f"--stages {stages} --copies {copies} --max-delay {max_delay} asks for at least {schedules:.3g} "
            f"schedules in {len(modes)} --modes ({schedules * per_schedule:.3g} stage-steps, at most "
            f"{MAX_STAGE_STEPS:,}): lower --copies or --max-delay, or give fewer --modes"
        )
    return schedules * per_schedule


def describe(schedule: list[list[int]]) -> str:
    """Per stage, the step each copy completes at."""
    stages = []
    for s, delays in enumerate(schedule):
        stages.append(f"stage {s} sees its copies finish at steps {completion_steps(delays)}")
    return "; ".join(stages)


def add_exhaustive_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=int, default=2, choices=[2, 3], help="pipeline stages (default 2)")
    parser.add_argument("--copies", type=int, default=3, help="host writes in flight (default 3)")
    parser.add_argument("--max-delay", type=int, default=2, help="a copy completes 0..N steps late (default 2)")
    parser.add_argument("--modes", nargs="+", default=["fixed", "legacy"], choices=SYNC_MODES)
    parser.add_argument("--out", default=None, help="also write the result as JSON here")


def cmd_exhaustive(args: argparse.Namespace) -> int:
    if args.out:
        if Path(args.out).is_dir():
            raise ConfigError(f"--out {args.out} is a directory: give the JSON file's name")
        check_writable_dir(Path(args.out).parent, "--out")
    report = check(args.stages, args.copies, args.max_delay, args.modes)
    print(f"{args.stages} stages, {args.copies} copies in flight, each 0..{args.max_delay} steps late:")
    for mode, r in report.items():
        print(f"  {mode:<7} {r['broken']} of {r['schedules']} schedules give stages different trees")
        for schedule in r["breaking"][:5]:
            print(f"          e.g. {describe(schedule)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        world = {"stages": args.stages, "copies": args.copies, "max_delay": args.max_delay}
        Path(args.out).write_text(json.dumps({**world, **report}, indent=1) + "\n")
    return 0 if report.get("fixed", {"broken": 0})["broken"] == 0 else 1
