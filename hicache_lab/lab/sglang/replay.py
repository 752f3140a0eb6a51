"""The lab's cache against SGLang's, operation by operation.

A run with `--record-cache-ops` writes every operation its scheduler asked of its cache, with the lab's answers
(lab/sglang/recording.py). `replay` (`python -m hicache_lab conform RUN_DIR`) sends the same operations, in the same
order, to SGLang's cache (cache.py), and each answer is compared with the lab's: matched device length and
slots, host hit length, room, load-back length, inserted prefix, the slots and node a prefill's insert hands back
(`cache_unfinished_req`), whether eviction freed what a decode step needs, acks consumed, loads started, copies
in flight, and free device / host slots and evictable tokens after every operation. The two caches number their
slots and nodes differently, so the replay keeps a map from the lab's to SGLang's, built from the answers
(`alloc_device`, load backs) and checked by every later one: a match must name the same KV in both. Each copy
finishes in SGLang at the step the recorded rank consumed its ack (`completion.AgreedCompletion`). Where the
answers differ the lab's decisions are kept (its next operations are replayed as recorded), so later rounds show
what the difference led to.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...config import CacheConfig
from ...errors import ConfigError
from ...jsonl import read_jsonl
from .cache import SGLangCache
from .completion import AgreedCompletion
from .cpu import SGLANG_VERSION
from .recording import ops_path

# -- replay ----------------------------------------------------------------------------------------------


def read_ops(path: Path) -> tuple[dict, list[dict]]:
    """The recorded configuration and operations of one rank's file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no recorded cache operations (run with --record-cache-ops)")
    records = [record for _, record in read_jsonl(path, "conform")]
    if records[0].get("op") != "config":
        raise ConfigError(f"{path}: not a cache-operations file (no configuration line)")
    end, ops = records[-1], records[1:-1]
    if end.get("op") != "end" or end.get("operations") != len(ops):
        raise ConfigError(
            f"{path}: the recording stops after {len(records) - 1} operations without its end line (its run was "
            "killed, or the file was cut): conform compares only whole recordings; record the run again"
        )
    unknown = sorted(set(records[0]["cache"]) - {f.name for f in dataclasses.fields(CacheConfig)})
    if unknown:
        raise ConfigError(
            f"{path}: recorded by another version of the lab (cache fields unknown here: {', '.join(unknown)}); "
            "record the run again with this one"
        )
    return records[0], ops


@dataclass
class RoundHits:
    """Hit tokens of one round's admissions, by tier."""

    admitted: int = 0
    device: int = 0
    host: int = 0


@dataclass
class OpDifference:
    index: int  # operation number in the file (0 = the first operation after the configuration)
    op: str
    what: str
    lab: object
    sglang: object

    def __str__(self) -> str:
        return f"operation {self.index} ({self.op}): {self.what}: lab {self.lab}, SGLang {self.sglang}"


@dataclass
class Replay:
    """What a replay found: per-round hits as the lab answered and as SGLang did, and every difference."""

    operations: int = 0
    replayed: int = 0
    lab: list[RoundHits] = field(default_factory=list)
    sglang: list[RoundHits] = field(default_factory=list)
    differences: list[OpDifference] = field(default_factory=list)
    stopped: str | None = None  # why the replay could not go on (SGLang refused an operation the lab did)
    fault: str = ""  # the --fault the run was recorded with: it, not the lab, explains the differences

    @property
    def equal(self) -> bool:
        return not self.differences and self.stopped is None


class _Replayer:
    def __init__(self, config: dict):
        cfg = CacheConfig(**config["cache"])
        self.clock = AgreedCompletion()
        self.sglang = SGLangCache(cfg, config["host_tokens"], self.clock)
        self.nodes: dict[int, int] = {}  # lab node id -> SGLang node id
        self.slots: dict[int, int] = {}  # lab slot -> SGLang slot
        self.match = None
        self.lab_match: dict | None = None
        self.result = Replay()

    def differ(self, index: int, op: str, what: str, lab, sglang) -> None:
        self.result.differences.append(OpDifference(index, op, what, lab, sglang))

    def to_sglang(self, slots: list[int]) -> torch.Tensor:
        missing = [s for s in slots if s not in self.slots]
        if missing:
            raise LookupError(f"lab slots {missing[:4]} were never matched to SGLang's")
        return torch.tensor([self.slots[s] for s in slots], dtype=torch.int64)

    def learn_slots(self, lab: list[int], sglang: torch.Tensor) -> None:
        self.slots.update(zip(lab, sglang.tolist(), strict=True))

    def same_slots(self, index: int, op: str, lab: list[int], sglang: torch.Tensor) -> None:
        """The same KV on both sides: same length, and the lab's slots are (by the map) SGLang's."""
        if len(lab) != len(sglang):
            self.differ(index, op, "prefix length", len(lab), len(sglang))
        elif any(self.slots.get(a) != b for a, b in zip(lab, sglang.tolist(), strict=True)):
            self.differ(index, op, "prefix slots (another KV)", lab[:8], sglang.tolist()[:8])

    def apply(self, index: int, record: dict) -> None:
        op, args, lab = record["op"], record.get("args", {}), record.get("ans")
        s = self.sglang
        rounds = self.result
        if op == "advance":
            s.clock.advance(args["step"])
        elif op == "check_hicache_events":
            self.clock.allow(*lab)
            got = list(s.check_hicache_events())
            if got != lab:
                self.differ(index, op, "acks consumed (write, load)", lab, got)
        elif op == "match_prefix":
            self.match, self.lab_match = s.match_prefix(tuple(args["key"])), lab
            self.nodes[lab["device_node"]] = self.match.last_device_node
            self.same_slots(index, op, lab["device"], self.match.device_indices)
            if self.match.host_hit_length != lab["host"]:
                self.differ(index, op, "host hit length", lab["host"], self.match.host_hit_length)
        elif op in ("inc_lock_ref", "dec_lock_ref"):
            getattr(s, op)(self.nodes[args["node"]])
        elif op == "device_room":
            got = s.device_room()
            if got != lab:
                self.differ(index, op, "device room", lab, got)
        elif op == "lock_match":
            device = len(self.lab_match["device"])
            prefix, last = s.lock_match(self.match)
            self.nodes[lab["node"]] = last
            loaded_lab, loaded = lab["prefix"][device:], prefix[len(self.match.device_indices) :]
            if len(loaded_lab) == len(loaded):
                self.learn_slots(loaded_lab, loaded)
            self.same_slots(index, op, lab["prefix"], prefix)
            for hits, prefix_len, device_len in (
                (rounds.lab[-1], len(lab["prefix"]), device),
                (rounds.sglang[-1], len(prefix), len(self.match.device_indices)),
            ):
                hits.admitted += 1
                hits.device += device_len
                hits.host += prefix_len - device_len
        elif op in ("evict", "evict_host"):
            got = getattr(s, op)(args["tokens"])
            if got != lab:
                self.differ(index, op, "tokens freed", lab, got)
        elif op == "alloc_device":
            self.learn_slots(lab, s.alloc_device(args["tokens"], args.get("demand")))
        elif op == "evict_to_free":
            if s.evict_to_free(args["tokens"]) != lab:
                self.differ(index, op, "the slots are free", lab, not lab)
        elif op == "free_request":
            s.free_request(self.to_sglang(args["slots"]), args["prefix_len"], self.nodes[args["node"]])
        elif op == "cache_unfinished_req":
            slots, node = self.to_sglang(args["slots"]), self.nodes[args["node"]]
            prefix, last = s.cache_unfinished_req(
                tuple(args["tokens"]), slots, args["prefix_len"], node, args["inserted_len"]
            )
            self.nodes[lab["node"]] = last
            self.same_slots(index, op, lab["prefix"], prefix)
        elif op == "cache_finished_req":
            slots, node = self.to_sglang(args["slots"]), self.nodes[args["node"]]
            tokens, prefix_len = tuple(args["tokens"]), args["prefix_len"]
            got = s.cache_finished_req(tokens, slots, prefix_len, node, args["inserted_len"], args["prompt_len"])
            if got != lab:
                self.differ(index, op, "tokens the tree already held", lab, got)
        elif op == "start_loading":
            if s.start_loading() != lab:
                self.differ(index, op, "a load started", lab, not lab)
        elif op == "copies_in_flight":
            if s.copies_in_flight() != lab:
                self.differ(index, op, "copies in flight", lab, not lab)
        elif op == "flush_pending_backups":
            s.flush_pending_backups()
        elif op == "new_round":
            rounds.lab.append(RoundHits())
            rounds.sglang.append(RoundHits())
        elif op == "flush":
            self.clock.finish_all()
            s.flush()
        else:
            raise ConfigError(f"operation {index}: unknown cache operation {op!r}")
        got_state = [s.device_free(), s.host_free(), s.evictable()]
        if got_state != record["state"]:
            self.differ(index, op, "after it: free device, free host, evictable", record["state"], got_state)


def replay(path: Path) -> Replay:
    """Replay one rank's recorded operations through SGLang's cache (needs sglang 0.5.23)."""
    config, ops = read_ops(path)
    if config["cache"].get("storage_backend", "none") != "none":
        raise ConfigError(
            f"{path}: a run with an L3 tier; conform compares the device and host tiers (run without "
            "--hicache-storage-backend)"
        )
    replayer = _Replayer(config)
    result = replayer.result
    result.operations, result.fault = len(ops), config.get("fault", "")
    result.lab.append(RoundHits())
    result.sglang.append(RoundHits())
    for index, record in enumerate(ops):
        try:
            replayer.apply(index, record)
        except Exception as exc:  # SGLang refused what the lab did (after an earlier difference)
            result.stopped = f"operation {index} ({record['op']}): {type(exc).__name__}: {exc}"
            break
        result.replayed = index + 1
    if not (result.lab[0].admitted or result.sglang[0].admitted):  # what came before the first round
        del result.lab[0], result.sglang[0]
    return result


# -- the command -----------------------------------------------------------------------------------------


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
