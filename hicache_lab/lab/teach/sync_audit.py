"""What a `--sync-impl` function does, call by call (sync_impl.py wraps every such function in an `Audit`).

The audit watches the torch.distributed calls your function makes from its own thread (audit_patch.py; the lab's
own threads pass straight through), with the rules an operation breaks on sight (audit_call.py), then checks the
rules of its slot (audit_slots.py). Each call is one line of `sync_audit_rank{R}.jsonl` in the run's directory,
flushed as it is written, so a run that crashes or hangs keeps what every rank did up to there:
`hicache_lab.lab.teach.exercise` reads these lines to say in words what went wrong.

A finding is a broken rule: its kind (a key of `MISTAKES`, mistakes.py, which says why it is wrong) and one
sentence of what this rank did. A finding that is wrong in every world stops the run at once (`SyncImplError`, with
the sentence and the reason). The others are recorded and the run goes on, so that what they cost (a collective
that forces the stages into lockstep) or where they deadlock is measured, not asserted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

from ...entrypoints.outdir import open_run_file
from .audit_call import AuditFinding, Call
from .audit_patch import routed_to
from .audit_slots import attn_groups_rules, pp_sync_rules, writing_check_before, writing_check_rules
from .mistakes import MISTAKES, mistake_text


class Audit:
    """One rank's audit of every `--sync-impl` function: `wrap(slot, fn, owner)` gives the function to call."""

    def __init__(self, out_dir: Path | None, groups):
        self.layout = groups.layout
        self.groups = groups
        lists = groups.layout.group_rank_lists()
        mine = {kind: next(r for r in rank_lists if self.layout.rank in r) for kind, rank_lists in lists.items()}
        self.pipeline = mine["pp"]
        names = {"attn_tp": "attention-TP group", "attn_cp": "attention-CP group", "pp": "pipeline group"}
        self.names = {tuple(ranks): names[kind] for kind, ranks in mine.items() if len(ranks) > 1}
        self.attention = {kind: mine[kind] for kind in ("attn_tp", "attn_cp") if len(mine[kind]) > 1}
        self.calls: dict[str, int] = {}
        self.file = None
        if out_dir is not None:
            self.file = open_run_file(Path(out_dir) / f"sync_audit_rank{self.layout.rank}.jsonl")  # closed at exit

    def stage(self, rank: int) -> int:
        return rank // (self.layout.tp * self.layout.cp)

    def same_shard(self, rank: int) -> bool:
        return rank in self.pipeline

    def group_name(self, ranks: list[int]) -> str:
        if tuple(ranks) in self.names:
            return self.names[tuple(ranks)]
        return "world group" if len(ranks) == dist.get_world_size() else f"group of ranks {ranks}"

    def wrap(self, slot: str, fn, owner):
        def audited(*args):
            n = self.calls[slot] = self.calls.get(slot, -1) + 1
            call = Call(self, args[0] if slot == "pp_sync" else None)
            before = writing_check_before(owner) if slot == "writing_check" else None
            kept = list(owner.work_list) if slot == "pp_sync" else []  # the handles of earlier calls
            start = time.perf_counter()
            with routed_to(call):
                try:
                    value = fn(*args)
                except BaseException:
                    self._log(slot, n, 1e3 * (time.perf_counter() - start), call)  # what it did before it raised
                    raise
                finally:
                    if before is not None:
                        del owner.publish_write  # the method again
            ms = 1e3 * (time.perf_counter() - start)
            if slot == "writing_check":
                writing_check_rules(self, call, owner, args[0], before)
            elif slot == "pp_sync":
                pp_sync_rules(self, call, owner, args[0], kept)
            else:
                value = attn_groups_rules(self, call, value)
            self._log(slot, n, ms, call)
            for finding in call.findings:
                if MISTAKES[finding["kind"]][0]:
                    raise AuditFinding(mistake_text(finding["kind"], finding["what"]))
            return value

        return audited

    def _log(self, slot: str, n: int, ms: float, call: Call) -> None:
        if self.file is None or (slot == "attn_groups" and not call.findings):
            return  # attn_groups is asked many times a step: only what it got wrong is worth a line
        line = {"slot": slot, "call": n, "stage": self.layout.pp_rank, "ms": round(ms, 3), "end": time.time()}
        line |= {**call.facts, "ops": call.ops}
        self.file.write(json.dumps({**line, "findings": call.findings}) + "\n")
        self.file.flush()
