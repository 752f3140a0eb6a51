"""Notebook 06's two questions that a student answers by reading or predicting, each checked against what a run
records, with a verdict that says what does not fit without giving the answer:

* reading a trace: `check_reading(run_dir, step=..., queue=..., cause=...)` - where and why a diverged run's
  stages first parted (the step, the ack queue, one of `CAUSES`), against its step trace;
* a design question with a measured answer: the lab's relay (a chain: each stage passes the counts to the next)
  against a star (`star`: stage 0 sends them to every later stage itself) on PP = `DESIGN_PP` stages.
  `measure_relays` runs both and reads their audits (messages a call, each stage's time in a call, how far stage
  0 runs ahead of the last stage); `check_prediction` compares a prediction with the measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from ...entrypoints.launch import run_world
from ...errors import ConfigError
from ...managers.step_trace import first_divergence, read_trace
from ..presets import World
from .exercise import BINDERS, RELAY, exercise_config
from .explain import audit_lines, pp_sync_timing, relay_sends

QUEUES = {"write": "acks_write", "load": "acks_load"}
CAUSES = {  # what can make two stages consume different acks at a step: the key a student names
    "own_poll": "each stage consumed the acks its own poll found finished, and the stages' copies finished at "
    "different steps",
    "unfinished_copy": "a stage consumed an ack whose copy had not finished on it",
    "different_batches": "the stages had run different batches before, so they held different copies",
    "lost_count": "a stage consumed a count other than the one the stage before it found",
}


@dataclass
class Answer:
    """A checked answer: `ok`, and one line per part (what fits, or what does not)."""

    ok: bool = True
    lines: list[str] = field(default_factory=list)

    def judge(self, right: bool, yes: str, no: str) -> None:
        self.ok &= right
        self.lines.append(f"{'right' if right else 'not yet'}: {yes if right else no}")

    def __str__(self) -> str:
        return "\n".join([*self.lines, "RIGHT" if self.ok else "NOT YET"])


def trace_cause(rows: list[dict], step: int, quantity: str) -> str:
    """The key of `CAUSES` the trace shows at a first divergence in an ack queue (`step`, `quantity`). Up to it
    every stage's tree (digest) and batch were equal, so the stages had started the same copies."""
    at = [r for r in rows if r["step"] == step]
    ready = quantity.replace("acks", "ready")  # the leading finished acks its own poll found
    if any(r[quantity] > r[ready] for r in at):
        return "unfinished_copy"
    if all(r[quantity] == r[ready] for r in at):
        return "own_poll"
    return "lost_count"


def check_reading(run_dir: Path | str, step: int | None, queue: str | None, cause: str | None) -> Answer:
    """Your reading of the run in `run_dir` against its step trace: the step at which its stages first parted,
    the ack queue (`write` or `load`) on which they did, and the cause (a key of `CAUSES`); None: not read yet."""
    if queue is not None and queue not in QUEUES:
        raise ConfigError(f"queue={queue!r}: name the ack queue, one of {', '.join(map(repr, QUEUES))}")
    if cause is not None and cause not in CAUSES:
        raise ConfigError(f"cause={cause!r}: pick one of {', '.join(map(repr, CAUSES))} (CAUSES says each in words)")
    rows = read_trace(run_dir)
    first = first_divergence(rows)
    if first is None or first["quantity"] not in QUEUES.values():
        raise ConfigError(f"{run_dir}: its stages never parted first in an ack queue: give a legacy run's directory")
    answer, at = Answer(), first["step"]
    if step is None:
        answer.judge(False, "", "name the step at which the stages first parted")
    else:
        earlier = f"at step {step} every stage still held the same tree and consumed the same acks"
        later = f"the stages had already parted before step {step}: look earlier"
        answer.judge(step == at, f"the stages first parted at step {step}", earlier if step < at else later)
    if queue is None:
        answer.judge(False, "", f"name the queue: {' or '.join(QUEUES)}")
    else:
        same = f"where they first parted, every stage consumed the same number of {queue} acks"
        answer.judge(QUEUES[queue] == first["quantity"], f"they consumed different numbers of {queue} acks", same)
    if cause is None:
        answer.judge(False, "", f"name the cause, one of {', '.join(CAUSES)}")
    else:
        truth = trace_cause(rows, at, first["quantity"])
        answer.judge(cause == truth, CAUSES[cause], CAUSE_AGAINST[cause])
    return answer


CAUSE_AGAINST = {  # what the trace shows against a cause it does not show (without naming the one it does)
    "own_poll": "compare, on each stage, the acks it found finished (ready_*) with those it consumed (acks_*)",
    "unfinished_copy": "where they parted, no stage consumed more acks than its own poll found finished",
    "different_batches": "up to where they parted every stage held the same tree (digest) and ran the same "
    "batches, so they had started the same copies",
    "lost_count": "up to where they parted no stage sent another a count (relay_sent is 0): none was lost",
}


def star(self, data):
    """A relay that is no chain: stage 0 sends the counts to every later stage itself, each later stage receives
    from stage 0 (one-way, and right: the design question measures it against the lab's chain)."""
    group = self.groups.pp_cache_group
    if self.pp_rank == 0:
        for stage in range(1, self.pp_size):
            self.work_list.append(dist.isend(data.clone(), group_dst=stage, group=group, tag=2))
    else:
        dist.recv(data, group_src=0, group=group, tag=2)


DESIGN_PP = 4
RELAYS = {"chain": RELAY, "star": f"pp_sync={__name__}:star"}


def measure_relays(out_dir: Path | str, device: str = "cpu", quick: bool = True) -> dict[str, dict]:
    """The chain (the lab's relay) and the star on PP = DESIGN_PP, each run once: per relay the messages stage 0
    and all stages send in one call (one a step), the median time (ms) stage 0 and the last stage spend in a
    call, and how far (ms, median) stage 0 leaves a call before the last stage leaves the same one."""
    world, measured = World(f"PP={DESIGN_PP}", f"--pp {DESIGN_PP} --num-layers {DESIGN_PP}"), {}
    for name, spec in RELAYS.items():
        out = Path(out_dir) / name
        summary = run_world(exercise_config(world, (spec,), device, quick), out, False, BINDERS)
        if not summary["completed"] or summary["diverged"]:
            raise RuntimeError(f"the {name}'s run at PP={DESIGN_PP} did not complete alike: {summary['error']}")
        sends = relay_sends(audit_lines(out))
        calls, lead = pp_sync_timing(out)
        measured[name] = {
            "stage 0 messages": len(sends.get(0, [])),
            "messages": sum(map(len, sends.values())),
            "stage 0 ms": calls[0],
            "last stage ms": calls[DESIGN_PP - 1],
            "stage 0 ahead ms": lead,
        }
    return measured


def relay_table(measured: dict[str, dict]) -> str:
    """`measure_relays`' numbers, one line per relay."""
    return "\n".join(
        f"{name:>5}: stage 0 sends {m['stage 0 messages']} message(s) a step, all stages {m['messages']}; a call "
        f"takes stage 0 {m['stage 0 ms']:.3f} ms, the last stage {m['last stage ms']:.3f} ms (medians); stage 0 "
        f"leaves a call {m['stage 0 ahead ms']:.2f} ms before the last stage"
        for name, m in measured.items()
    )


PREDICTIONS = {  # the parts of a prediction, in words: check_prediction's keyword arguments
    "stage_0_messages": "messages stage 0 sends a step, per relay ({'chain': N, 'star': N})",
    "all_messages": "messages all stages send together a step, per relay ({'chain': N, 'star': N})",
    "longer_on_stage_0": "the relay whose call takes stage 0 longer ('chain' or 'star')",
    "sooner_to_last": "the relay with which the last stage leaves a call sooner after stage 0 ('chain' or 'star')",
}


def measured_answers(measured: dict[str, dict]) -> dict:
    """What `measure_relays` says to each part of `PREDICTIONS`."""
    return {
        "stage_0_messages": {name: m["stage 0 messages"] for name, m in measured.items()},
        "all_messages": {name: m["messages"] for name, m in measured.items()},
        "longer_on_stage_0": max(measured, key=lambda name: measured[name]["stage 0 ms"]),
        "sooner_to_last": min(measured, key=lambda name: measured[name]["stage 0 ahead ms"]),
    }


def check_prediction(measured: dict[str, dict], **prediction) -> Answer:
    """Your prediction (the parts of `PREDICTIONS`; None: not made yet) against `measure_relays`' numbers, which
    the answer shows only once every part is predicted."""
    unknown = set(prediction) - set(PREDICTIONS)
    if unknown:
        raise ConfigError(f"no part {sorted(unknown)} in the prediction: its parts are {', '.join(PREDICTIONS)}")
    answer, truth = Answer(), measured_answers(measured)
    made = {part: prediction.get(part) for part in PREDICTIONS}
    made = {part: None if isinstance(v, dict) and None in v.values() else v for part, v in made.items()}
    for part, words in PREDICTIONS.items():
        given = made[part]
        if given is None:
            answer.judge(False, "", f"predict {part}: {words}")
        elif isinstance(truth[part], dict):
            if not isinstance(given, dict) or set(given) != set(truth[part]):
                raise ConfigError(f"{part}={given!r}: give a number per relay, {{'chain': N, 'star': N}}")
            odd = [name for name in truth[part] if given[name] != truth[part][name]]
            answer.judge(not odd, f"{part} as measured", f"{part}: the {' and the '.join(odd)} measured otherwise")
        else:
            if given not in RELAYS:
                raise ConfigError(f"{part}={given!r}: name a relay, 'chain' or 'star'")
            answer.judge(given == truth[part], f"{part}: the {given}", f"{part}: the measurement says otherwise")
    if None not in made.values():
        answer.lines.append(f"measured on PP={DESIGN_PP}:\n{relay_table(measured)}")
    else:
        answer.lines.append("the measurement is shown once every part is predicted")
    return answer
