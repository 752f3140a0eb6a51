"""Every bug-zoo entry, on the same seed: its broken run shows the failure it is named after, its fixed run
completes with identical decisions on every rank and exact outputs (hicache_lab/lab/check/zoo.py says what each is)."""

from __future__ import annotations

import pytest

from hicache_lab.lab.check.zoo import ENTRIES, consistent, reproduce

pytestmark = pytest.mark.spawns


@pytest.mark.parametrize("name", ENTRIES)
def test_broken_shows_the_failure_and_the_fix_removes_it(name, tmp_path):
    entry = ENTRIES[name]
    broken, fixed = reproduce(entry, tmp_path)
    assert broken.symptom and entry.expect in broken.symptom, broken.symptom
    assert consistent(fixed), (fixed.symptom, fixed.summary["first_divergence"], fixed.summary["error"])
