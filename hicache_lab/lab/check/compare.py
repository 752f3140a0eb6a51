"""`python -m hicache_lab compare [run flags]` (compare_cli.py): one world and workload, run with the lab's
cache and with SGLang's own (`--cache-impl sglang`, 0.5.23, lab/sglang/rank_cache.py; or an installed release,
`--against sglang==X`), compared rank by rank and step by step.

Compared, in causal order: per step and rank, the acks each rank consumed per queue (the agreed counts), the
batch it ran (its requests, new tokens and cached prefix) and the relay sends it issued down the pipeline (a
step one run reached and the other did not, a crash, shows there); per rank, whether it completed or crashed,
and its storage prefetches issued, declined for the rate limit and revoked; per round, the hit tokens by tier
(storage hits among them); whether outputs matched the reference. Differences are reported first to last
(step, rank, quantity, both values); where the world has a difference the lab keeps on purpose, it is
reported under its row of docs/fidelity.md (`KEPT`), never hidden, and only where both runs completed, never
diverged and matched their references, or diverged alike: a crash, a divergence or a wrong output is never a
kept difference. A run that went wrong on either side is reported before anything else (`went_wrong`); two runs
that diverged at the same step on the same queue, parting the same ranks, hold the same bug and are compared up to
that step (`diverged_alike`); two that went wrong the same way otherwise are equal only in that sense, and said so.
Exit 0: equal and both sound; 1: different, or either run went wrong; 2: cannot compare (a world SGLang's cache
refuses, or no sglang); 128 + signal: interrupted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ...config import RunConfig
from ...entrypoints import launch
from ...managers.step_trace import read_trace
from .. import plugins
from ..sglang import releases
from ..sglang.reverts import NO_SGLANG_SITE

STEP_QUANTITIES = ("acks_write", "acks_load", "kind", "requests", "extend_tokens", "prefix_tokens", "relay_sent")
ROUND_QUANTITIES = ("cached_device", "cached_host", "cached_storage")
# what both caches' storage summaries count the same way (SGLang's: lab/sglang/rank_cache.SGLangRankCache.summary)
PREFETCH_QUANTITIES = ("prefetches", "rate_limited", "revoked")
# Differences the lab keeps on purpose, by what makes a world have them: (row in docs/fidelity.md, applies to the
# world and SGLang's side, why)
KEPT = (
    (
        "N1",
        lambda cfg, against: cfg.parallel.pp > 1 and bool({"alloc_agreement", "prefetch_vote"} & cfg.parallel.fixes),
        "the proposals turned on by name (`--enable-fix`: the allocation vote of #31425, the prefetch vote of "
        "#38273) are agreements no release has: more relay sends down the pipeline than 0.5.23's one per step",
    ),
    (
        "V1",
        lambda cfg, against: cfg.cache.latency == "real",
        "real latency: each run's copies finish at its own machine's times, so steps are not comparable; only "
        "completion and outputs are",
    ),
    (
        "V2",
        lambda cfg, against: cfg.cache.storage_backend != "none",
        "L3 timing: SGLang's storage threads read and write files on the wall clock (and its `timeout` policy "
        "waits in seconds), the lab's storage tier completes by steps under virtual latency",
    ),
    (
        "R1",
        lambda cfg, against: releases.generation(against) == "hiradix",
        "HiRadixCache releases start a node's host write as it is queued (one copy, one ack per node, each finishing "
        "at its own step) and relay the write and load counts in a send each; the lab, as 0.5.23, starts a batch's "
        "writes as one copy and relays one tensor a step: from the first write on, steps are not comparable; only "
        "completion, outputs and where ranks part are",
    ),
)


def parted(divergence: dict | None):
    """Where a divergence happened and which ranks it parted (ranks grouped by the value each held), whatever the
    values: None for no divergence."""
    if divergence is None:
        return None
    groups: dict = {}
    for rank, value in divergence["values"].items():
        groups.setdefault(repr(value), set()).add(rank)
    return divergence["step"], divergence["quantity"], sorted(sorted(g) for g in groups.values())


@dataclass
class StepDifference:
    where: str  # "step 12, rank 1" / "rank 0" / "round 3"
    quantity: str
    lab: object
    sglang: object
    other: str = "SGLang"  # what the other side is called

    def __str__(self) -> str:
        return f"{self.where}: {self.quantity}: lab {self.lab}, {self.other} {self.sglang}"


def with_impl(cfg: RunConfig, impl: str) -> RunConfig:
    """`cfg` for one side, outputs checked. SGLang's side agrees with its own code: no `--sync-impl`, and no
    switch of a fix it has no site for (0.5.23 does what it does, whatever the lab's side turns off); a release
    (`sglang==X`) runs its own agreement whatever `--sync` the lab's side has. `--enable-dp-attention` is the SGLang
    side's (the TP group its scheduler gives its cache); the lab's cache agrees as its `--sync` says."""
    p = cfg.parallel
    if impl == "lab":
        cfg = cfg.with_lab(dp_attention=False)
    elif impl == "sglang":
        no_site = set(NO_SGLANG_SITE)
        p = dataclasses.replace(
            p,
            enable_fixes=tuple(f for f in p.enable_fixes if f not in no_site),
            disable_fixes=tuple(f for f in p.disable_fixes if f not in no_site),
        )
        cfg = cfg.with_lab(sync_impls=())
    else:
        p = dataclasses.replace(p, sync="fixed", enable_fixes=(), disable_fixes=())
        cfg = cfg.with_lab(sync_impls=())
    return dataclasses.replace(cfg.with_lab(cache_impl=impl), parallel=p, check_outputs=True)


def by_step(out: Path) -> dict[tuple[int, int], dict]:
    return {(row["step"], row["rank"]): row for row in read_trace(out)}


def _ranks(out: Path) -> dict[int, dict]:
    results = {}
    for path in sorted(out.glob("rank*.json")):
        result = json.loads(path.read_text())
        results[result["rank"]] = result
    return results


def step_differences(lab: Path, sglang: Path, until: int | None = None) -> list[StepDifference]:
    """Every quantity in which the two runs' traces differ, by (step, rank) and in causal order within one, up to
    step `until` (None: all); a step one run reached and the other did not is a difference too."""
    a, b = by_step(lab), by_step(sglang)
    found = []
    for step, rank in sorted(k for k in set(a) | set(b) if until is None or k[0] <= until):
        left, right = a.get((step, rank)), b.get((step, rank))
        where = f"step {step}, rank {rank}"
        if left is None or right is None:
            found.append(StepDifference(where, "step reached", left is not None, right is not None))
            continue
        found += [StepDifference(where, q, left[q], right[q]) for q in STEP_QUANTITIES if left[q] != right[q]]
    return found


def rank_differences(lab: Path, sglang: Path) -> list[StepDifference]:
    """Per rank: how it ended, and its storage prefetch counts."""
    found = []
    a, b = _ranks(lab), _ranks(sglang)
    for rank in sorted(set(a) | set(b)):
        left, right = a.get(rank, {}), b.get(rank, {})
        where = f"rank {rank}"
        for key in ("completed", "crashed"):
            if left.get(key) != right.get(key):
                found.append(StepDifference(where, key, left.get(key), right.get(key)))
        storage, theirs = left.get("storage"), right.get("storage")
        if storage is None or theirs is None:
            continue
        found += [
            StepDifference(where, f"prefetch {q}", storage.get(q), theirs.get(q))
            for q in PREFETCH_QUANTITIES
            if storage.get(q) != theirs.get(q)
        ]
    return found


def round_differences(lab: dict, sglang: dict) -> list[StepDifference]:
    found = []
    for left, right in zip(lab["rounds"], sglang["rounds"], strict=False):
        for quantity in ROUND_QUANTITIES:
            if left[quantity] != right[quantity]:
                found.append(StepDifference(f"round {left['round']}", quantity, left[quantity], right[quantity]))
    if len(lab["rounds"]) != len(sglang["rounds"]):
        found.append(StepDifference("rounds", "rounds answered", len(lab["rounds"]), len(sglang["rounds"])))
    return found


def went_wrong(summary: dict) -> str | None:
    """How one side's run went wrong, in words (first: where its ranks diverged, then how it ended, then its
    outputs); None for a run that completed, never diverged and matched its reference."""
    words = []
    if d := summary["first_divergence"]:
        words.append(f"diverged at step {d['step']} on {d['quantity']} {d['values']}")
    if summary["interrupted"]:
        words.append(f"interrupted by {summary['interrupted']}")
    elif summary["crashed"]:
        words.append(f"crashed (rank {summary['failing_rank']}): {summary['error']}")
    elif not summary["completed"]:
        words.append(f"did not complete: {summary['error']}")
    elif summary["outputs_match_reference"] is not True:
        words.append(f"outputs match reference: {summary['outputs_match_reference']}")
    return "; ".join(words) or None


@dataclass
class Comparison:
    summaries: dict[str, dict]
    differences: list[StepDifference]
    kept: list[tuple[str, str]]  # the fidelity rows that explain the differences: (row, why)
    named: list[StepDifference] = field(default_factory=list)  # what the lab side's plug-ins say they change

    @property
    def equal(self) -> bool:
        return not self.differences

    @property
    def diverged_alike(self) -> dict | None:
        """The first divergence both runs took, at the same step on the same queue, parting the same ranks: the
        same bug in both (their steps are compared up to it; after it each diverged world goes its own way)."""
        first = [s["first_divergence"] for s in self.summaries.values()]
        return first[0] if first[0] is not None and parted(first[0]) == parted(first[1]) else None

    @property
    def wrong(self) -> dict[str, str]:
        """{side: how it went wrong} for each side whose run did (`went_wrong`)."""
        return {impl: words for impl, s in self.summaries.items() if (words := went_wrong(s)) is not None}

    @property
    def interrupted(self) -> str | None:
        """The signal that interrupted either run: then nothing can be judged."""
        return next((s["interrupted"] for s in self.summaries.values() if s["interrupted"]), None)

    @property
    def sound(self) -> bool:
        """Both runs completed, never diverged and matched their references: only then is "equal" a verdict of
        fidelity, and only then (or up to a divergence both took alike) can a difference be a kept one (a timing
        row never explains a crash, a divergence or a wrong output)."""
        return not self.wrong


def compare(
    cfg: RunConfig, out: Path, binders: tuple, lab_binders: tuple = (), verbose: bool = False, against: str = "sglang"
) -> Comparison:
    """Both runs of `cfg` (into OUT/lab and OUT/sglang), compared: the lab's cache against SGLang's (`against`:
    `sglang`, 0.5.23, or a release `sglang==X`), or, `against="lab"`, the lab with its `--plugin`s against the lab
    without them (the other side always runs without them). `binders`: what both runs bind (the lab's:
    `lab.binders.LAB`, which serves `--cache-impl`); `lab_binders` bind into the lab's run only (a deliberate
    change: mutants.py). What the plug-ins say they change (their `differences`) is set apart (`named`)."""
    sides = {"lab": with_impl(cfg, "lab"), "sglang": with_impl(cfg, against).with_lab(plugins=())}
    summaries = {
        side: launch.run_world(side_cfg, out / side, verbose, (*binders, *(lab_binders * (side == "lab"))))
        for side, side_cfg in sides.items()
    }
    first = [parted(s["first_divergence"]) for s in summaries.values()]
    alike = first[0][0] if first[0] is not None and first[0] == first[1] else None
    differences = step_differences(out / "lab", out / "sglang", alike) + rank_differences(out / "lab", out / "sglang")
    if alike is None:  # the rounds a diverged world answered are its own
        differences += round_differences(summaries["lab"], summaries["sglang"])
    outputs = [summaries[impl]["outputs_match_reference"] for impl in ("lab", "sglang")]
    if outputs[0] != outputs[1]:
        differences.append(StepDifference("run", "outputs_match_reference", *outputs))
    if against == "lab":
        differences = [dataclasses.replace(d, other="without plug-ins") for d in differences]
    said = plugins.differences(cfg)
    named = [d for d in differences if d.quantity in said]
    differences = [d for d in differences if d.quantity not in said]
    sound = not any(went_wrong(s) for s in summaries.values())
    judged = (sound or alike is not None) and differences  # a kept row explains only differences of sound runs
    kept = [(row, why) for row, applies, why in KEPT if judged and against != "lab" and applies(cfg, against)]
    return Comparison(summaries, differences, kept, named)
