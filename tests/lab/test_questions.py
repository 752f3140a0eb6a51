"""Notebook 06's two questions (`hicache_lab.lab.teach.questions`): the trace reading is checked against the
trace, the design prediction against the measurement, and neither verdict gives the answer away; in-process, on
a trace written for the purpose and on numbers one PP = 4 measurement gave."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_lab.errors import ConfigError
from hicache_lab.lab.teach.questions import check_prediction, check_reading


def legacy_like_trace(run_dir: Path) -> None:
    """Two stages' step records as the legacy sync writes them: at step 3 stage 1's own poll finds its copy
    finished a step before stage 0's, and each consumes what its own poll found."""
    run_dir.mkdir()
    for rank in (0, 1):
        rows = []
        for step in range(6):
            ready = int(step == (3 if rank == 1 else 4))
            digest = "b" if step >= (3 if rank == 1 else 4) else "a"
            rows.append(
                {"rank": rank, "step": step, "kind": "decode", "requests": [0], "extend_tokens": 1,
                 "prefix_tokens": 8, "ready_write": ready, "acks_write": ready, "ready_load": 0, "acks_load": 0,
                 "digest": digest, "relay_sent": 0}
            )  # fmt: skip
        (run_dir / f"trace_rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_trace_reading_is_checked_against_the_trace_without_giving_the_answer(tmp_path):
    run_dir = tmp_path / "legacy"
    legacy_like_trace(run_dir)
    assert check_reading(run_dir, step=3, queue="write", cause="own_poll").ok
    for step, queue, cause in [(4, "write", "own_poll"), (3, "load", "own_poll"), (3, "write", "lost_count")]:
        answer = check_reading(run_dir, step=step, queue=queue, cause=cause)
        assert not answer.ok and str(answer).endswith("NOT YET"), str(answer)
        wrong = [line for line in str(answer).splitlines() if line.startswith("not yet")]
        assert len(wrong) == 1 and not [w for w in ("step 3", "write", "own poll") if w in wrong[0]], wrong
    assert str(check_reading(run_dir, step=None, queue=None, cause=None)).count("not yet") == 3
    with pytest.raises(ConfigError, match="pick one of"):
        check_reading(run_dir, step=3, queue="write", cause="a race")


MEASURED = {  # measure_relays' numbers, as one PP=4 run gave them
    "chain": {"stage 0 messages": 1, "messages": 3, "stage 0 ms": 0.17, "last stage ms": 0.86, "stage 0 ahead ms": 13},
    "star": {"stage 0 messages": 3, "messages": 3, "stage 0 ms": 0.33, "last stage ms": 0.68, "stage 0 ahead ms": 6.5},
}
RIGHT_PREDICTION = {
    "stage_0_messages": {"chain": 1, "star": 3},
    "all_messages": {"chain": 3, "star": 3},
    "longer_on_stage_0": "star",
    "sooner_to_last": "star",
}


def test_the_design_prediction_is_checked_against_the_measurement():
    assert check_prediction(MEASURED, **RIGHT_PREDICTION).ok
    assert "measured on PP=4" in str(check_prediction(MEASURED, **RIGHT_PREDICTION))
    for part, wrong in [("all_messages", {"chain": 3, "star": 6}), ("longer_on_stage_0", "chain")]:
        answer = check_prediction(MEASURED, **{**RIGHT_PREDICTION, part: wrong})
        assert not answer.ok and f"not yet: {part}" in str(answer), str(answer)
    unmade = check_prediction(MEASURED, **{**RIGHT_PREDICTION, "stage_0_messages": {"chain": 1, "star": None}})
    assert not unmade.ok and "measured on" not in str(unmade), "the numbers only once every part is predicted"
