"""`python -m hicache_lab soak --hostile`: every hostile-input case, the slow ones too, and a table of what
failed; `--table` prints the README's table instead (the package's lab/check/soak_hostile.py parses the flags,
finds this file in the source checkout and calls `cmd_hostile`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cases import CASES
from .judge import judge_all, table


def cmd_hostile(args: argparse.Namespace) -> int:
    """Every hostile-input case, `--jobs` at once (those run in this process one at a time, first); a table of
    what failed in `--results`/hostile.md."""
    if args.table:
        print(table(CASES))
        return 0
    lines = ["| class | case | result |", "|---|---|---|"]
    failed, cases = 0, []
    for case in CASES:
        if why := case.needs():
            escaped = why.replace("|", "\\|")
            lines.append(f"| {case.klass} | {case.name} | skipped: {escaped} |")
            print(f"class {case.klass:>2}  {case.name[:70]:<70} skipped: {why}")
        else:
            cases.append(case)
    for case, problems in judge_all(cases, args.jobs):
        failed += bool(problems)
        verdict = "ok" if not problems else "; ".join(problems[:-1]).replace("|", "\\|")
        lines.append(f"| {case.klass} | {case.name} | {verdict} |")
        print(f"class {case.klass:>2}  {case.name[:70]:<70} {'ok' if not problems else 'FAILED'}")
        for problem in problems:
            print(f"    {problem}")
    Path(args.results).mkdir(parents=True, exist_ok=True)
    report = Path(args.results) / "hostile.md"
    counts = f"{len(cases) - failed} of {len(cases)} cases as required, {len(CASES) - len(cases)} skipped"
    report.write_text(f"# Hostile input: {counts}\n\n" + "\n".join(lines) + "\n")
    print(f"{counts}; {report}")
    return 1 if failed else 0
