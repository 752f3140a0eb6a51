"""`python -m hicache_lab conform RUN_DIR`: one rank of a run made with `--record-cache-ops`, replayed through
SGLang's cache (replay.py), and what the replay found: per round and tier, the hit tokens of both, then every
difference."""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import ConfigError
from .cpu import SGLANG_VERSION
from .recording import ops_path
from .replay import Replay, replay


def format_replay(result: Replay, prompt_tokens: list[int]) -> str:
    """Per round and tier, the hit tokens (and rates, given each round's prompt tokens) of lab and SGLang."""
    head = f"{'round':>5} {'admitted':>8} {'lab device':>10} {'lab host':>8} {'SGLang device':>13} {'SGLang host':>11}"
    lines = [head + ("  lab hit  SGLang hit" if prompt_tokens else "")]
    for i, (lab, sg) in enumerate(zip(result.lab, result.sglang, strict=True)):
        line = f"{i:>5} {lab.admitted:>8} {lab.device:>10} {lab.host:>8} {sg.device:>13} {sg.host:>11}"
        if i < len(prompt_tokens):
            rates = [(hits.device + hits.host) / prompt_tokens[i] for hits in (lab, sg)]
            line += f"  {rates[0]:>7.1%} {rates[1]:>11.1%}"
        lines.append(line + ("" if (lab.device, lab.host) == (sg.device, sg.host) else "   <- differs"))
    return "\n".join(lines)


def add_conform_flags(parser) -> None:
    parser.add_argument(
        "run_dir", nargs="?", default="runs/latest", help="a run made with --record-cache-ops (default: runs/latest)"
    )
    parser.add_argument("--rank", type=int, default=0, help="whose operations to replay (default 0)")
    parser.add_argument("--show", type=int, default=10, help="differences to print (default 10)")


def cmd_conform(args) -> int:
    """Replay one rank of a run made with `run --record-cache-ops --out RUN_DIR` through sglang 0.5.23's own
    cache (every answer and the pools after every operation compared), and print per round the device and host
    hit tokens of both. Exit 0 when all are equal, 1 on any difference (listed), 2 for a run that recorded
    nothing, one with an L3 tier, or no sglang 0.5.23."""
    run_dir = Path(args.run_dir)
    try:
        result = replay(ops_path(run_dir, args.rank))
    except RuntimeError as exc:  # sglang missing or of another release
        raise ConfigError(str(exc)) from None
    try:  # the run's own result gives each round's prompt tokens, for the rates (the table stands without them)
        rounds = json.loads((run_dir / f"rank{args.rank}.json").read_text())["rounds"]
        prompt_tokens = [r["prompt_tokens"] for r in rounds] if len(rounds) == len(result.lab) else []
    except (OSError, ValueError, KeyError, TypeError):
        prompt_tokens = []
    print(
        f"{run_dir}, rank {args.rank}: {result.replayed} of {result.operations} cache operations replayed "
        f"through sglang {SGLANG_VERSION}'s UnifiedRadixCache"
    )
    print(format_replay(result, prompt_tokens))
    if result.fault:
        print(f"the run was recorded with --fault {result.fault}: it changes the lab's answers on purpose, so any")
        print("difference below is the fault's, not the lab's (conform compares runs without --fault)")
    if result.equal:
        print("every answer and every pool state after every operation equal")
        return 0
    print(
        f"{len(result.differences)} answers differ"
        + (f"; replay stopped at {result.stopped}" if result.stopped else "")
    )
    for difference in result.differences[: args.show]:
        print(f"  {difference}")
    if not result.fault:
        print("known differences and why: docs/fidelity.md")
    return 1
