"""`python -m hicache_lab exercise`: the check (exercise.py) from the shell (`--hint`: with what to change), and
`--table`, the table of every kind of mistake the audit names for docs/notebooks.md (with `--hint`, the teachers'
table of teaching/README.md: each kind with a wrong answer of teaching/mistakes/ that shows it, `EXAMPLES`, and
its fix)."""

from __future__ import annotations

import argparse
import sys

from ...config import SYNC_IMPL_SLOTS
from .edition import LEFT_OUT, student_edition
from .exercise import check
from .mistakes import MISTAKES

EXAMPLES = {  # kind -> a wrong answer in teaching/mistakes/ that shows it (tests/lab/test_exercise.py runs each)
    "symmetric_across_stages": "pp_sync.py:all_reduce_max",
    "blocking_send": "pp_sync.py:blocking_send",
    "send_aliases_data": "pp_sync.py:sends_data_itself",
    "lost_send_handle": "pp_sync.py:drops_the_handle",
    "recv_not_waited": "pp_sync.py:irecv_without_wait",
    "recv_elsewhere": "pp_sync.py:receives_into_a_new_tensor",
    "forwarded_before_receive": "pp_sync.py:forwards_before_receiving",
    "uses_the_lab_own": "pp_sync.py:calls_the_labs_own",
    "no_receive": "pp_sync.py:two_stages_only",
    "backwards": "pp_sync.py:upstream",
    "wrong_rank_space": "pp_sync.py:global_ranks",
    "wrong_ack_count": "writing_check.py:only_finished_here",
    "acks_out_of_order": "writing_check.py:newest_first",
    "copy_not_waited": "writing_check.py:no_wait",
    "lock_leaked": "writing_check.py:keeps_the_lock",
    "lock_released_twice": "writing_check.py:releases_twice",
    "node_left_in_flight": "writing_check.py:leaves_them_in_flight",
    "node_not_published": "writing_check.py:forgets_to_publish",
    "wrong_node_taken": "writing_check.py:unlocks_every_write",
    "group_spans_stages": "attn_groups.py:with_the_pipeline",
    "missing_group": "attn_groups.py:attention_tp_only",
    "not_groups": "attn_groups.py:the_ranks_not_the_groups",
}


def mistakes_table(hint: bool = False) -> str:
    """The markdown table of every kind of mistake the audit recognises: its name in a verdict, whether it stops
    the run, and the check's words for why it is wrong (docs/notebooks.md, for students). `hint`: with a wrong
    answer of teaching/mistakes/ that shows it and the fix (teaching/README.md, for teachers)."""
    head = "shown by `teaching/mistakes/` | the hint" if hint else "why it is wrong (the check's words)"
    rows = [f"| `WRONG (kind)` | stops the run | {head} |", "|---|---|---|" + "---|" * hint]
    rows += [
        f"| `{kind}` | {stops(m)} | " + (f"`{EXAMPLES[kind]}` | {m.fix} |" if hint else f"{m.why} |")
        for kind, m in MISTAKES.items()
    ]
    return "\n".join(rows)


def stops(mistake) -> str:
    return "at once" if mistake.fatal else "no: the run shows it"


def add_exercise_flags(parser: argparse.ArgumentParser) -> None:
    for slot in SYNC_IMPL_SLOTS:
        parser.add_argument(
            f"--{slot.replace('_', '-')}",
            metavar="FILE.py:FUNCTION",
            help=f"your {slot} (a .py file's path, or MODULE:FUNCTION)",
        )
    parser.add_argument("--out", default="runs/exercise", help="where each world's run is written")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--full", action="store_true", help="twice the clients, rounds and device pool")
    parser.add_argument(
        "--hint", action="store_true", help="add what to change to a verdict that names a kind of mistake"
    )
    teachers = "" if student_edition() else " (with --hint: the teachers' table, with the fixes)"
    parser.add_argument(
        "--table", action="store_true", help=f"print the table of mistakes the check recognises{teachers}"
    )


def cmd_exercise(args: argparse.Namespace) -> int:
    if args.table and args.hint and student_edition():
        print(
            f"--table --hint is the teachers' table, with every fix; this checkout has no {LEFT_OUT}/ (a student "
            "edition): --table alone gives the students' table, and --hint on a verdict the fix for that mistake",
            file=sys.stderr,
        )
        return 2
    if args.table:
        print(mistakes_table(args.hint))
        return 0
    given = {slot: getattr(args, slot) for slot in SYNC_IMPL_SLOTS}
    if not any(given.values()):
        print("give at least one of --pp-sync, --writing-check, --attn-groups (FILE.py:FUNCTION)", file=sys.stderr)
        return 2
    verdict = check(**given, out_dir=args.out, device=args.device, quick=not args.full, hint=args.hint)
    print(verdict)
    return verdict.exit_code
