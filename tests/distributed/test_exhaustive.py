"""Every completion timing of two host writes on two pipeline stages, played through the real CacheSync and
HiRadixCache of each stage: fixed never lets the stages' trees differ; legacy lets them differ whenever the
stages see their copies finish at different steps."""

from __future__ import annotations

import pytest

from hicache_lab.lab.check.exhaustive import check, completion_steps, timings

pytestmark = pytest.mark.spawns


def test_fixed_keeps_every_schedule_identical_and_legacy_breaks_every_uneven_one():
    report = check(stages=2, copies=2, max_delay=2, modes=["fixed", "legacy"])
    per_stage = len(timings(2, 2))
    assert report["fixed"] == {"schedules": per_stage**2, "broken": 0, "breaking": []}
    assert report["legacy"]["broken"] == per_stage**2 - per_stage  # all but the stages-agree diagonal
    assert all(completion_steps(a) != completion_steps(b) for a, b in report["legacy"]["breaking"])
