"""The causal chain of a legacy pipeline crash, found in a run's step trace (the figures room puts it in words and
draws it).

Every stage keeps its own tree. With legacy sync a stage consumes the acks its own poll found finished, so now
and then one stage consumes an ack (and unlocks the node its copy held) a step before another. Most of these
differences heal a step or two later, when the other stage consumes the same ack. The one that does not:

    ack consumed on one stage only -> the node it unlocked (on that stage only: its tokens now count as
    evictable room) -> a different admission (or prefix match) -> a different eviction -> different batches
    -> the crash

`find_chain(rows, summary)` returns those links (`Link`: step, what happened, the stages it happened on, and its
numbers: per stage, and the node, tokens, request or error it is about), in causal order: by step, and within a
step in the order above (the scheduler consumes acks first, then admits requests against free + evictable room,
evicting to make that room, then runs the batch; the forward pass crashes). Where the eviction came a step before
the match it changed, the step order puts it first. Each link is found by a function of its own (`_ack_link`,
`_unlock_link`, `_evict_link`, `_admit_link`, `_batch_link`, `_crash_link`). The figures room puts the links in
words and draws them (`figures/chain.py`: `describe`, `lane_labels`, `draw_chain`, one lane per stage, and
`chain_figure`); what its top strip shows is found here too (`healed_steps`, `ahead_at`, `differing_steps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("ack", "unlock", "admit", "evict", "batch", "crash")  # causal order within one step
Steps = dict[int, dict[int, dict]]  # step -> stage -> its trace row, for the steps every stage recorded


@dataclass(frozen=True)
class Link:
    """One link of the chain, as numbers. `per_stage[k]` holds, by `what`: ack `acks_write`, `acks_load`,
    `ready_write`; evict `evicted` ({node: tokens}) and `unmatched` (those of its nodes another stage kept);
    admit `prefix` and `extend` of `request` (empty where the stage did not admit it); batch `kind`,
    `requests`, `extend_tokens`, `prefix_tokens`; crash `rows` (the rows the crashing stage and the one before
    it ran); unlock `unlocked` (whether the stage unlocked `node`)."""

    step: int
    what: str  # one of PHASES
    stages: tuple[int, ...]  # where it happened (the stages whose value differs from the rest, or the crashing one)
    per_stage: dict[int, dict] = field(default_factory=dict)
    node: int | None = None  # unlock: the node unlocked on `ahead` only; evict: that node, evicted there only
    tokens: int | None = None  # unlock: the node's tokens
    ahead: tuple[int, ...] = ()  # unlock, evict: the stages that consumed the ack first (evict: where `node` went)
    request: int | None = None  # admit: the first request admitted differently
    error: str | None = None  # crash: the failing stage's error
    model: tuple[int | None, int | None] = (None, None)  # crash: hidden size and heads (the received rows' view)

    @property
    def order(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.what)


def _by_step(rows: list[dict]) -> tuple[list[int], Steps]:
    ranks = sorted({r["rank"] for r in rows})
    steps: Steps = {}
    for r in rows:
        steps.setdefault(r["step"], {})[r["rank"]] = r
    common = {s: v for s, v in steps.items() if len(v) == len(ranks)}  # steps every stage recorded
    return ranks, common


def _batch(row: dict) -> tuple:
    return row["kind"], tuple(row["requests"]), tuple(row.get("extend_lens", ())), tuple(row.get("prefix_lens", ()))


def _acks(row: dict) -> tuple[int, int]:
    return row["acks_write"], row["acks_load"]


def _ids(pairs) -> dict[int, int]:
    return {node: tokens for node, tokens in pairs}


def find_chain(rows: list[dict], summary: dict) -> list[Link]:
    """The links from the ack consumed on one stage only to the first step at which the stages' batches differ,
    and the crash; [] when the batches never differ (a fixed run)."""
    ranks, steps = _by_step(rows)
    batch_step = next((s for s in sorted(steps) if len({_batch(r) for r in steps[s].values()}) > 1), None)
    if batch_step is None:
        return []
    ack_steps = [s for s in sorted(steps) if s <= batch_step and len({_acks(r) for r in steps[s].values()}) > 1]
    evict_step = next((s for s in sorted(steps, reverse=True) if s <= batch_step and _evictions_differ(steps[s])), None)
    key_node, ack_step, ahead = _key_ack(ranks, steps, ack_steps, evict_step)
    links = []
    if ack_step is not None:
        ack = _ack_link(ranks, ack_step, steps[ack_step], ahead)
        links += [ack, *_unlock_link(ranks, ack_step, steps[ack_step], ack.stages, key_node)]
    if evict_step is not None:
        links.append(_evict_link(ranks, evict_step, steps[evict_step], key_node, ahead))
    at = steps[batch_step]
    links += [*_admit_link(ranks, batch_step, at), _batch_link(ranks, batch_step, at), *_crash_link(rows, summary)]
    return sorted(links, key=lambda link: link.order)


def _evictions_differ(at: dict[int, dict]) -> bool:
    return len({frozenset(_ids(r.get("evicted_nodes", ()))) for r in at.values()}) > 1


def _key_ack(
    ranks: list[int], steps: Steps, ack_steps: list[int], evict_step: int | None
) -> tuple[int | None, int | None, tuple[int, ...]]:
    """The latest ack consumed on one stage only, before the eviction, that unlocked a node evicted on that stage
    only: (the node, its step, (the stage,)); without one, (None, the latest such ack's step or None, ())."""
    latest = ack_steps[-1] if ack_steps else None
    if evict_step is None:
        return None, latest, ()
    evicted = {k: _ids(r.get("evicted_nodes", ())) for k, r in steps[evict_step].items()}
    for s in reversed([s for s in ack_steps if s <= evict_step]):
        unlocked = {k: _ids(r.get("unlocked_nodes", ())) for k, r in steps[s].items()}
        for k in ranks:
            others = [o for o in ranks if o != k]
            only = [
                n
                for n in unlocked[k]
                if n in evicted[k] and all(n not in unlocked[o] and n not in evicted[o] for o in others)
            ]
            if only:
                return only[0], s, (k,)
    return None, latest, ()


def _ack_link(ranks: list[int], step: int, at: dict[int, dict], ahead: tuple[int, ...]) -> Link:
    """The acks each stage consumed at `step`, ahead on `ahead` (else on the stages that consumed the most)."""
    if not ahead:
        most = max(sum(_acks(r)) for r in at.values())
        ahead = tuple(k for k in ranks if sum(_acks(at[k])) == most)
    numbers = {k: {q: at[k][q] for q in ("acks_write", "acks_load", "ready_write")} for k in ranks}
    return Link(step, "ack", ahead, numbers)


def _unlock_link(
    ranks: list[int], step: int, at: dict[int, dict], ahead: tuple[int, ...], key_node: int | None
) -> list[Link]:
    """The node the ack unlocked on `ahead` only: `key_node` where the chain found one, else the first such node;
    [] where there is none."""
    unlocked = {k: _ids(at[k].get("unlocked_nodes", ())) for k in ranks}
    only = {k: {n: t for n, t in unlocked[k].items() if any(n not in unlocked[o] for o in ranks)} for k in ranks}
    node = key_node if key_node is not None else next((n for k in ahead for n in only[k]), None)
    if node is None:
        return []
    tokens = next(only[k][node] for k in ahead if node in only[k])
    numbers = {k: {"unlocked": k in ahead} for k in ranks}
    return [Link(step, "unlock", ahead, numbers, node=node, tokens=tokens, ahead=ahead)]


def _evict_link(ranks: list[int], step: int, at: dict[int, dict], key_node: int | None, ahead: tuple[int, ...]) -> Link:
    """What each stage evicted at `step` and which of it another stage did not; `key_node` went on `ahead` only."""
    evicted = {k: _ids(at[k].get("evicted_nodes", ())) for k in ranks}
    unmatched = {k: [n for n in evicted[k] if any(n not in evicted[o] for o in ranks)] for k in ranks}
    numbers = {k: {"evicted": evicted[k], "unmatched": unmatched[k]} for k in ranks}
    return Link(step, "evict", tuple(k for k in ranks if unmatched[k]), numbers, node=key_node, ahead=ahead)


def _admit_link(ranks: list[int], step: int, at: dict[int, dict]) -> list[Link]:
    """The first request (by id) the stages admitted differently at `step`: on some of them only, or with
    different prefixes; [] where they admitted alike."""
    prefix = {k: dict(zip(at[k]["requests"], at[k].get("prefix_lens", ()), strict=False)) for k in ranks}
    extend = {k: dict(zip(at[k]["requests"], at[k].get("extend_lens", ()), strict=False)) for k in ranks}
    requests = sorted({rid for k in ranks for rid in prefix[k]})
    odd = [rid for rid in requests if len({prefix[k].get(rid) for k in ranks}) > 1]
    if not odd:
        return []
    rid = odd[0]
    numbers = {k: {"prefix": prefix[k][rid], "extend": extend[k][rid]} if rid in prefix[k] else {} for k in ranks}
    return [Link(step, "admit", tuple(k for k in ranks if rid in prefix[k]), numbers, request=rid)]


def _batch_link(ranks: list[int], step: int, at: dict[int, dict]) -> Link:
    """The batch each stage ran at `step`, on the stages whose batch differs from another's."""
    differ = tuple(k for k in ranks if any(_batch(at[k]) != _batch(at[o]) for o in ranks))
    numbers = {k: {q: at[k][q] for q in ("kind", "requests", "extend_tokens", "prefix_tokens")} for k in ranks}
    return Link(step, "batch", differ, numbers)


def _crash_link(rows: list[dict], summary: dict) -> list[Link]:
    """The failing stage's crash at the last step it recorded, with the rows it and the stage before it ran
    there; [] where no stage crashed."""
    if not summary.get("crashed") or summary.get("failing_rank") is None:
        return []
    failing = summary["failing_rank"]
    step = max(r["step"] for r in rows if r["rank"] == failing)
    numbers = {}
    for k in (failing - 1, failing):
        if (row := next((r for r in rows if r["rank"] == k and r["step"] == step), None)) is not None:
            numbers[k] = {"rows": row["extend_tokens"]}
    model = summary.get("config", {}).get("model", {})
    width = (model.get("hidden_size"), model.get("num_heads"))
    return [Link(step, "crash", (failing,), numbers, error=summary["error"], model=width)]


def healed_steps(rows: list[dict], before: int) -> tuple[list[int], int]:
    """Steps before `before` at which the stages consumed different ack counts, and the most steps any of them
    took to heal (until every stage's tree digest was equal again)."""
    _, steps = _by_step(rows)
    odd = [s for s in sorted(steps) if s < before and len({_acks(r) for r in steps[s].values()}) > 1]
    agree = [s for s in sorted(steps) if len({r["digest"] for r in steps[s].values()}) == 1]
    longest = max((next((a for a in agree if a >= s), before) - s for s in odd), default=0)
    return odd, longest


def ahead_at(rows: list[dict], steps: list[int]) -> dict[int, list[int]]:
    """Per stage: those of `steps` at which it consumed the most acks (more than another stage)."""
    ranks, by_step = _by_step(rows)
    most = {s: max(sum(_acks(r)) for r in by_step[s].values()) for s in steps}
    return {k: [s for s in steps if sum(_acks(by_step[s][k])) == most[s]] for k in ranks}


def differing_steps(rows: list[dict]) -> list[int]:
    """The steps (every stage recorded) at which the stages' tree digests differ."""
    _, by_step = _by_step(rows)
    return [s for s, seen in by_step.items() if len({r["digest"] for r in seen.values()}) > 1]
