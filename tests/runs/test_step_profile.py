"""The step profile (bench/step_profile.py, bench/step_timer.py): exclusive times nest right, every
category is there and the categories partition the loop, and nothing is timed unless asked."""

from __future__ import annotations

import csv
import json
import sys
import threading

import pytest

from bench import step_profile
from bench.step_timer import CATEGORIES, StepTimer
from hicache_lab.entrypoints.launch import run_world
from hicache_lab.lab.presets import WORKLOAD


class Clock:
    """A clock that moves only when told: times without timing."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Part:
    """`work` advances the clock by `before`, calls `inner.work` (if any), then advances it by `after`."""

    def __init__(self, clock: Clock, before: float, after: float = 0.0, inner: Part | None = None):
        self.clock, self.before, self.after, self.inner = clock, before, after, inner

    def work(self) -> None:
        self.clock.now += self.before
        if self.inner is not None:
            self.inner.work()
        self.clock.now += self.after


class OnAnotherThread:
    """`work` runs `part.work` on a thread of its own and waits for it."""

    def __init__(self, part: Part):
        self.part = part

    def work(self) -> None:
        thread = threading.Thread(target=self.part.work)
        thread.start()
        thread.join()


def test_a_nested_call_counts_once_where_it_ran_and_only_inside_the_root_on_its_thread():
    clock = Clock()
    elsewhere = Part(clock, 3.0)  # called on another thread: its time stays with its caller
    inner = Part(clock, 2.0, inner=OnAnotherThread(elsewhere))
    outer = Part(clock, 1.0, 1.0, inner)
    root = Part(clock, 0.5, 0.5, outer)
    timer = StepTimer(clock=clock)
    timer.wrap(elsewhere, "work", "model", "elsewhere")
    timer.wrap(inner, "work", "agreement", "inner")
    timer.wrap(outer, "work", "cache", "outer")
    timer.wrap_root(root, "work")
    outer.work()  # outside the root: not counted
    root.work()
    root.work()
    report = timer.report()
    expected = dict.fromkeys(CATEGORIES, 0.0) | {"cache": 4.0, "agreement": 10.0, "unattributed": 2.0}
    assert report["categories_s"] == expected and report["total_s"] == 16.0
    assert report["labels"]["outer"]["calls"] == 2 and report["labels"]["elsewhere"]["calls"] == 0


@pytest.mark.spawns
def test_every_rank_splits_its_steps_into_the_categories_at_pp_1_and_2(tmp_path, monkeypatch):
    argv = [*WORKLOAD.split(), "--num-layers", "2", "--pp-sizes", "1", "2", "--tiers", "L1+L2"]
    monkeypatch.setattr(sys, "argv", ["step_profile", *argv, "--results-dir", str(tmp_path)])
    step_profile.main()
    runs = {r["pp"]: r for r in json.loads((tmp_path / "step_profile.json").read_text())["runs"]}
    assert sorted(runs) == [1, 2] and [len(runs[pp]["ranks"]) for pp in (1, 2)] == [1, 2]
    for pp, result in runs.items():
        for report in result["ranks"]:
            ms = report["categories_ms_per_step"]
            assert list(ms) == list(CATEGORIES) and min(ms.values()) >= 0
            assert sum(ms.values()) <= report["ms_per_step"] * (1 + 1e-9)
            assert ms["model"] > 0 and ms["cache"] > 0 and ms["agreement"] > 0 and ms["scheduler"] > 0
            labels = report["labels"]
            hidden = labels["loop.send_hidden"]["calls"] + labels["loop.recv_hidden"]["calls"]
            assert (hidden > 0) == (pp > 1)  # hidden states cross stages only at pp 2
            assert report["steps"] > 0 and labels["cache.match_prefix"]["calls"] > 0
    rows = list(csv.DictReader((tmp_path / "step_profile.csv").read_text().splitlines()))
    assert {(r["pp"], r["rank"]) for r in rows} == {("1", "0"), ("1", "mean"), ("2", "0"), ("2", "1"), ("2", "mean")}
    assert {r["category"] for r in rows} == set(CATEGORIES)


def test_steps_are_not_timed_unless_asked(small_config, tmp_path):
    run_world(small_config(check_outputs=False), tmp_path, verbose=False)
    assert "step_time" not in json.loads((tmp_path / "rank0.json").read_text())
