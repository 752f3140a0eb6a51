"""bench/agreement_cost.py's parts 2-3 at a smoke size: every stage of every world reports every measurement of
every variant and block, and the figure draws the panels of what was measured (part 1 is too slow for here: its
panel is drawn from a table written by hand)."""

from __future__ import annotations

import pandas as pd
import pytest
from PIL import Image

from bench.agreement_cost import CSV_FIELDS
from bench.agreement_primitives import ATTN_OPS, PP_VARIANTS, SCENARIOS, TIMELINE_MARKS, measure_primitives
from bench.agreement_tables import PART1_SKIPPED, sections
from bench.common import write_csv
from hicache_lab.lab.figures.lockstep import LOCKSTEP_VARIANTS, plot_lockstep
from hicache_lab.lab.figures.style import caption_line
from hicache_lab.lab.figures.sync_cost import plot_sync_cost
from hicache_lab.provenance import machine

SMOKE = {"steps": 3, "stage_ms": 0.2, "slow_factor": 2.0, "calls": 3, "warmup": 1, "blocks": 2, "timeout_s": 60}
SMOKE_TIMELINE = {**SMOKE, "steps": 5, "timeline": True}


@pytest.mark.spawns
def test_every_stage_reports_every_measurement(tmp_path):
    rows, values, timeline = measure_primitives([3], SMOKE)  # first, middle and last stage
    assert timeline == []  # only with args["timeline"]
    frame = pd.DataFrame(rows)
    pipe = frame[(frame["part"] == "pipeline") & (frame["metric"] != "forward_ms")]
    for size in (3,):
        for scenario in SCENARIOS:
            for variant in PP_VARIANTS:
                mine = pipe[(pipe["pp"] == size) & (pipe["scenario"] == scenario) & (pipe["variant"] == variant)]
                got = set(zip(mine["rank"], mine["metric"], mine["repeat"], strict=True))
                metrics = {"step_ms", "agree_us_per_step", "drain_us_per_step", "act_wait_us_per_step"}
                want = {(r, m, b) for r in range(size) for m in metrics for b in range(SMOKE["blocks"])}
                assert got == want, (size, scenario, variant, want - got)
        attn = frame[(frame["part"] == "attn_agreement") & (frame["pp"] == size)]
        assert set(zip(attn["rank"], attn["variant"], strict=True)) == {(r, op) for r in (0, 1) for op in ATTN_OPS}
    measured = pipe[pipe["metric"] == "step_ms"]["value"]
    assert (measured > 0).all() and len(measured) == 2 * 4 * 3 * SMOKE["blocks"]
    none = pipe[(pipe["variant"] != "relay") & (pipe["metric"] == "drain_us_per_step")]["value"]
    assert (none == 0).all()  # only the relay drains
    assert set(values[3]) >= {(s, v, "step_ms") for s in SCENARIOS for v in PP_VARIANTS}

    out = tmp_path / "sync_cost.png"
    panels = plot_sync_cost(frame, out, caption_line("smoke", "SMOKE", machine()))
    assert panels == ["stages", "equal", "slow_last"]  # no part 1 here: its panel is left out, not drawn empty
    assert Image.open(out).size[0] > 1000

    write_csv(tmp_path / "agreement_cost.csv", rows, CSV_FIELDS)  # the tables read the CSV back, as notebook 05
    (skipped, none), (_, steps), (_, stages), (_, attn) = sections(pd.read_csv(tmp_path / "agreement_cost.csv"))
    assert skipped == PART1_SKIPPED and none is None
    assert list(steps.index) == [(3, v) for v in PP_VARIANTS] and list(stages.columns) == [
        "stage 0",
        "stage 1",
        "stage 2",
    ]
    assert list(attn.columns) == ["one 2-element (us)", "two 1-element (us)", "two/one"] and list(attn.index) == [3]


def test_part_1_alone_is_one_panel(tmp_path):
    """A table of part 1 only (agreement_cost --skip-primitives): one panel, the step time by sync mode."""
    frame = pd.DataFrame(
        {"part": "step_time", "pp": 2, "variant": f"sync={mode}", "rank": rank, "repeat": repeat}
        | {"metric": "mean_step_ms_common", "value": 10.0 + rank + repeat}
        for mode in ("off", "legacy", "fixed")
        for rank in (0, 1)
        for repeat in (0, 1)
    )
    out = tmp_path / "sync_cost.png"
    assert plot_sync_cost(frame, out, "by hand") == ["step_time"]
    assert Image.open(out).size[0] > 500


@pytest.mark.spawns
def test_the_timeline_marks_every_timed_step_in_order_and_on_one_clock(tmp_path):
    """--timeline: every stage's every timed step of every run, its marks in order; a later stage has a step's
    activations only after the stage before ended that step's forward (one clock for every process); and the
    Gantt chart draws a panel per variant from it."""
    _, _, timeline = measure_primitives([3], SMOKE_TIMELINE)
    frame = pd.DataFrame(timeline)
    keys = ["scenario", "variant", "block", "rank", "step"]
    assert len(frame) == len(SCENARIOS) * len(PP_VARIANTS) * SMOKE["blocks"] * 3 * SMOKE_TIMELINE["steps"]
    assert not frame.duplicated(keys).any()
    marks = frame[list(TIMELINE_MARKS)].to_numpy()
    assert (marks[:, 1:] >= marks[:, :-1]).all()  # start <= drained <= agreed <= received <= forwarded <= end
    assert (frame[frame["variant"] != "relay"]["drained"] == frame[frame["variant"] != "relay"]["start"]).all()
    later = frame[frame["rank"] > 0].set_index(keys)
    before = frame.assign(rank=frame["rank"] + 1).set_index(keys).reindex(later.index)
    assert (later["received"] >= before["forwarded"]).all()
    table = plot_lockstep(
        frame, tmp_path / "lockstep.png", "smoke", pp=3, scenario="slow_last", first_step=1, span_ms=3
    )
    assert list(table.index) == list(LOCKSTEP_VARIANTS) and (table["pipeline step (ms)"] > 0).all()
    assert Image.open(tmp_path / "lockstep.png").size[0] > 1000
