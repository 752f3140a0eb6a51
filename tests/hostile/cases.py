"""Every hostile-input case (judge.py judges them), gathered from the files of their classes (judge.CLASSES
names them), class by class, each class in the order its file gives."""

from __future__ import annotations

from . import (
    c01_foreign_model,
    c02_misnamed_pages,
    c03_damaged_stage,
    c04_hangs,
    c05_orphans,
    c06_mixed_files,
    c07_different_flags,
    c08_silent_failures,
    c09_blame,
    c10_preflight,
    c11_verdicts,
)
from .judge import Hostile

BY_CLASS = {
    1: c01_foreign_model,
    2: c02_misnamed_pages,
    3: c03_damaged_stage,
    4: c04_hangs,
    5: c05_orphans,
    6: c06_mixed_files,
    7: c07_different_flags,
    8: c08_silent_failures,
    9: c09_blame,
    10: c10_preflight,
    11: c11_verdicts,
}
CASES: list[Hostile] = [case for module in BY_CLASS.values() for case in module.CASES]
