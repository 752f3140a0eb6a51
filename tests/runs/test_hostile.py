"""Hostile input (lab/hostile_cases.py): every fast case ends as it must, and the README's table is the cases'."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache_lab.lab.check.hostile.cases import CASES
from hicache_lab.lab.check.hostile.judge import judge, table

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("case", [c for c in CASES if not c.slow], ids=lambda c: f"{c.klass}-{c.name[:48]}")
def test_hostile_case(case, tmp_path):
    if why := case.needs():
        pytest.skip(why)
    _, problems = judge(case, tmp_path)
    assert not problems, "\n".join(problems)


def test_readme_table_is_generated_from_the_cases():
    block = re.search(r"<!-- hostile:begin -->\n(.*?)\n<!-- hostile:end -->", README.read_text(), re.S)
    assert block, "README.md lacks its <!-- hostile:begin --> ... <!-- hostile:end --> block"
    assert block.group(1) == table(CASES), "regenerate it: python -m hicache_lab soak --hostile --table"
