"""The causal chain of a legacy pipeline crash, found in a run's step trace (the figures room draws it).

Every stage keeps its own tree. With legacy sync a stage consumes the acks its own poll found finished, so now
and then one stage consumes an ack (and unlocks the node its copy held) a step before another. Most of these
differences heal a step or two later, when the other stage consumes the same ack. The one that does not:

    ack consumed on one stage only -> the node it unlocked (on that stage only: its tokens now count as
    evictable room) -> a different admission (or prefix match) -> a different eviction -> different batches
    -> the crash

`find_chain(rows, summary)` returns those links (`Link`: step, stages, what happened, per-stage values), in
causal order: by step, and within a step in the order above (the scheduler consumes acks first, then admits
requests against free + evictable room, evicting to make that room, then runs the batch; the forward pass
crashes). Where the eviction came a step before the match it changed, the step order puts it first.
The figures room draws them (`figures/chain.py`: `draw_chain`, one lane per stage, and `chain_figure`); what its
top strip shows is found here too (`healed_steps`, `ahead_at`, `differing_steps`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

PHASES = ("ack", "unlock", "admit", "evict", "batch", "crash")  # causal order within one step
PHASE_TITLES = {
    "ack": "ack consumed",
    "unlock": "node unlocked",
    "admit": "prefix match / admission",
    "evict": "eviction",
    "batch": "batch",
    "crash": "crash",
}


def _short(text: str, length: int) -> str:
    """`text`, cut to `length` characters with an ellipsis where it is longer."""
    return text if len(text) <= length else text[: length - 1] + "…"


def crash_what(error: str) -> str:
    """A short name for a forward-pass crash: the failing view of the received hidden states, or the first
    matmul on them; anything else: the exception's first words."""
    if m := re.search(r"shape '(\[[^\]]*\])' is invalid for input of size (\d+)", error or ""):
        return f"view as {m.group(1)} of {m.group(2)} values"
    if m := re.search(r"mat1 and mat2 shapes cannot be multiplied \((\w+) and (\w+)\)", error or ""):
        return f"matmul {m.group(1)} by {m.group(2)}"
    return _short(error or "crashed", 40)


@dataclass(frozen=True)
class Link:
    step: int
    what: str  # one of PHASES
    stages: tuple[int, ...]  # where it happened (the stages whose value differs from the rest, or the crashing one)
    text: str  # one line with the numbers
    values: dict[int, str] = field(default_factory=dict)  # per stage: what that stage did, for its lane

    @property
    def order(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.what)


def _by_step(rows: list[dict]) -> tuple[list[int], dict[int, dict[int, dict]]]:
    ranks = sorted({r["rank"] for r in rows})
    steps: dict[int, dict[int, dict]] = {}
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
    evict_step = next(
        (
            s
            for s in sorted(steps, reverse=True)
            if s <= batch_step and len({frozenset(_ids(r.get("evicted_nodes", ()))) for r in steps[s].values()}) > 1
        ),
        None,
    )
    links: list[Link] = []
    # the ack: the latest one-stage ack before the eviction that unlocked a node evicted there only
    key_node, ack_step, ahead = None, (ack_steps[-1] if ack_steps else None), ()
    if evict_step is not None:
        evicted = {k: _ids(r.get("evicted_nodes", ())) for k, r in steps[evict_step].items()}
        for s in reversed([s for s in ack_steps if s <= evict_step]):
            unlocked = {k: _ids(r.get("unlocked_nodes", ())) for k, r in steps[s].items()}
            for k in ranks:
                only = [
                    n for n in unlocked[k] if n in evicted[k] and all(n not in unlocked[o] for o in ranks if o != k)
                ]
                only = [n for n in only if all(n not in evicted[o] for o in ranks if o != k)]
                if only:
                    key_node, ack_step, ahead = only[0], s, (k,)
                    break
            if key_node is not None:
                break
    if ack_step is not None:
        at = steps[ack_step]
        if not ahead:
            most = max(sum(_acks(r)) for r in at.values())
            ahead = tuple(k for k in ranks if sum(_acks(at[k])) == most)
        links.append(
            Link(
                ack_step,
                "ack",
                ahead,
                "acks consumed (write, load): " + ", ".join(f"stage {k} {_acks(at[k])}" for k in ranks),
                {
                    k: f"consumed {at[k]['acks_write']} write, {at[k]['acks_load']} load ack(s)\n"
                    f"(its own poll: {at[k]['ready_write']} write ready)"
                    for k in ranks
                },
            )
        )
        unlocked = {k: _ids(at[k].get("unlocked_nodes", ())) for k in ranks}
        only = {k: {n: t for n, t in unlocked[k].items() if any(n not in unlocked[o] for o in ranks)} for k in ranks}
        node = key_node if key_node is not None else next((n for k in ahead for n in only[k]), None)
        if node is not None:
            tokens = next(only[k][node] for k in ahead if node in only[k])
            links.append(
                Link(
                    ack_step,
                    "unlock",
                    ahead,
                    f"node {node} ({tokens} tokens) unlocked on stage {', '.join(map(str, ahead))} only",
                    {
                        k: f"node {node} unlocked: its {tokens} tok\nnow count as evictable room"
                        if k in ahead
                        else f"node {node} still locked\n(its ack not consumed yet)"
                        for k in ranks
                    },
                )
            )
    if evict_step is not None:
        evicted = {k: _ids(steps[evict_step][k].get("evicted_nodes", ())) for k in ranks}
        extra = {k: [n for n in evicted[k] if any(n not in evicted[o] for o in ranks)] for k in ranks}
        differs = tuple(k for k in ranks if extra[k])
        values = {}
        for k in ranks:
            count, tokens = len(evicted[k]), sum(evicted[k].values())
            shown = ", ".join(map(str, extra[k][:3])) + (", …" if len(extra[k]) > 3 else "")
            values[k] = f"evicted {count} node{'s' * (count != 1)} ({tokens} tok)" + (
                f"\n{len(extra[k])} not on the other stage: {shown}" if extra[k] else ""
            )
        text = "device evictions: " + ", ".join(
            f"stage {k} {len(evicted[k])} nodes ({sum(evicted[k].values())} tokens)" for k in ranks
        )
        if key_node is not None:
            text += f"; node {key_node} on stage {ahead[0]} only"
        links.append(Link(evict_step, "evict", differs, text, values))
    at = steps[batch_step]
    prefix = {k: dict(zip(at[k]["requests"], at[k].get("prefix_lens", ()), strict=False)) for k in ranks}
    extend = {k: dict(zip(at[k]["requests"], at[k].get("extend_lens", ()), strict=False)) for k in ranks}
    requests = sorted({rid for k in ranks for rid in prefix[k]})
    odd = [rid for rid in requests if len({prefix[k].get(rid) for k in ranks}) > 1]
    if odd:  # a request admitted on some stages only, or with a different prefix
        rid = odd[0]
        where = tuple(k for k in ranks if rid in prefix[k])
        values = {
            k: f"request {rid}: {prefix[k][rid]} cached + {extend[k][rid]} new tok"
            if rid in prefix[k]
            else f"request {rid} not admitted"
            for k in ranks
        }
        text = f"request {rid}: " + ", ".join(
            f"stage {k} " + (f"prefix {prefix[k][rid]}" if rid in prefix[k] else "not admitted") for k in ranks
        )
        links.append(Link(batch_step, "admit", where, text, values))
    differ = tuple(k for k in ranks if any(_batch(at[k]) != _batch(at[o]) for o in ranks))
    links.append(
        Link(
            batch_step,
            "batch",
            differ,
            "batches: "
            + "; ".join(
                f"stage {k} {at[k]['kind']} {at[k]['requests']} ({at[k]['extend_tokens']} new, "
                f"{at[k]['prefix_tokens']} cached tokens)"
                for k in ranks
            ),
            {
                k: f"{at[k]['kind']} {at[k]['requests']}\n"
                f"{at[k]['extend_tokens']} new, {at[k]['prefix_tokens']} cached tok"
                for k in ranks
            },
        )
    )
    if summary.get("crashed") and summary.get("failing_rank") is not None:
        failing = summary["failing_rank"]
        crash_step = max(r["step"] for r in rows if r["rank"] == failing)
        model = summary.get("config", {}).get("model", {})
        hidden, heads = model.get("hidden_size"), model.get("num_heads")
        mine = next((r for r in rows if r["rank"] == failing and r["step"] == crash_step), None)
        before = next((r for r in rows if r["rank"] == failing - 1 and r["step"] == crash_step), None)
        values = {k: "" for k in ranks}
        if before is not None and hidden:
            rows_sent = before["extend_tokens"]
            values[failing - 1] = f"sends {rows_sent} rows × {hidden} to stage {failing}" + (
                "\n(it ran nothing)" if not rows_sent else ""
            )
        if mine is not None:
            label = crash_what(summary["error"])
            size = re.search(r"input of size (\d+)", summary["error"] or "")
            if before is not None and hidden and heads and size and label.startswith("view"):
                n, d = mine["extend_tokens"], hidden // heads
                label = (
                    f"views {size.group(1)} = {before['extend_tokens']} × {hidden} values as [{n}, -1, {d}]:\n"
                    f"not a multiple of {n} × {d} = {n * d}: the view fails"
                )
            if before is not None and not before["extend_tokens"] and label.startswith("matmul") and heads:
                shape = f"[{mine['extend_tokens']}, -1, {hidden // heads}]"
                label = f"views 0 values as {shape}: legal (-1 is 0);\nits first matmul fails: {label[7:]}"
            values[failing] = f"with its own {mine['extend_tokens']} rows, it\n{label}"
        links.append(Link(crash_step, "crash", (failing,), f"stage {failing} crashed: {summary['error']}", values))
    return sorted(links, key=lambda link: link.order)


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
