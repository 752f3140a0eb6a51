"""The modelled clock: what a step costs (managers/latency_model.py) and a trace replayed at its own arrival times
(workload.Feeder with `use_trace_timestamps`), in-process, without a model."""

from __future__ import annotations

import json

import pytest

from hicache_lab.config import ModelConfig, WorkloadConfig
from hicache_lab.errors import ConfigError
from hicache_lab.managers.latency_model import BENCH_MODEL, GpuCosts, LatencyModel, ModelledClock
from hicache_lab.managers.workload import Feeder, MooncakeWorkload

E2E = BENCH_MODEL


def test_a_step_costs_its_overhead_compute_and_the_loads_the_compute_does_not_hide():
    model = LatencyModel.of_stage(E2E, layers=16, tp=1, kv_bytes_per_token=262144)
    costs = GpuCosts()
    assert model.step_ms([], [], 0, 0) == costs.step_overhead_ms  # an idle step
    # "Layer-wise load overlap"'s compute: 512 new tokens over 1,024 cached ones, 27.6 ms measured there
    assert model.step_ms([512], [1536], 0, 0) - costs.step_overhead_ms == pytest.approx(27.6, rel=0.05)
    load = model.step_ms([512], [1536], 1024, 0) - model.step_ms([512], [1536], 0, 0)
    assert load == pytest.approx((1 - costs.load_hidden) * 1024 * 262144 / 45.7e6)  # ms at 45.7 GB/s
    assert model.step_ms([1], [2000], 0, 0) > model.step_ms([1], [100], 0, 0)  # a decode reads its whole context
    halves = LatencyModel.of_stage(E2E, layers=8, tp=2, kv_bytes_per_token=65536)
    assert halves.weights * 4 == model.weights  # half the layers, half of each


def test_priced_as_bench_a_stage_costs_its_share_of_the_bench_model_and_a_hit_saves_more_than_its_load():
    """`--priced-as bench`: the tiny model's stage of 2 of its 4 layers is priced as 8 of the bench model's 16."""
    tiny = ModelConfig(priced_as="bench")
    stage = LatencyModel.of_stage(tiny, layers=2, tp=1, kv_bytes_per_token=1024)
    half = LatencyModel.of_stage(E2E, layers=8, tp=1, kv_bytes_per_token=8 * 2 * 2048 * 4)
    assert stage == half
    assert LatencyModel.of_stage(ModelConfig(), layers=2, tp=1, kv_bytes_per_token=1024).weights < stage.weights / 1000
    recompute = stage.step_ms([256], [256], 0, 0)
    load = stage.step_ms([1], [256], 255, 0)  # the same prompt, 255 tokens loaded from the host
    assert load < recompute / 2, (load, recompute)


def write_trace(path, times: list[int]) -> str:
    lines = [
        {"timestamp": t, "input_length": 64, "output_length": 4, "hash_ids": [0, i + 1]} for i, t in enumerate(times)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def replay(trace: str, slowdown: float, step_ms_cost: float = 10.0) -> tuple[dict[int, float], int]:
    """Each request's modelled arrival and the steps taken, stage 0's loop reduced to the Feeder and a clock: each
    step costs `step_ms_cost` and answers what is outstanding."""
    cfg = WorkloadConfig(trace_file=trace, num_rounds=2, use_trace_timestamps=True, mooncake_slowdown_factor=slowdown)
    feeder, clock = Feeder(MooncakeWorkload(cfg, 256), page_size=1), ModelledClock(LatencyModel(1, 1, 1))
    arrived: dict[int, float] = {}
    steps = 0
    while not feeder.done():
        steps += 1
        reqs, _ = feeder.arrivals(clock)
        assert all(r.modelled_arrival_ms <= clock.now_ms for r in reqs)  # none arrives before its time
        arrived |= {r.rid: r.modelled_arrival_ms for r in reqs}
        clock.now_ms += step_ms_cost
        feeder.answered([r for r in feeder.arrived if r.rid in arrived and not r.output])
        for r in feeder.arrived:
            r.output = r.output or [0]
    return arrived, steps


def test_a_trace_at_twice_its_rate_arrives_no_later_and_an_idle_clock_jumps_to_the_next_arrival(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [1000, 1005, 1500, 4000])
    (once, steps), (twice, _) = replay(trace, 1.0), replay(trace, 0.5)
    assert once == {0: 0.0, 1: 5.0, 2: 500.0, 3: 3000.0}  # from the first request's time
    assert steps == 4  # each step answers its request, and the idle clock jumps to the next (not 300 steps)
    assert twice == {rid: ms / 2 for rid, ms in once.items()}
    assert all(twice[rid] <= once[rid] for rid in once)


def test_timed_replay_is_refused_without_a_trace_and_the_slowdown_without_timed_replay(tmp_path):
    with pytest.raises(ConfigError, match="--use-trace-timestamps .* give it --trace-file"):
        WorkloadConfig(use_trace_timestamps=True)
    trace = write_trace(tmp_path / "t.jsonl", [0, 10])
    with pytest.raises(ConfigError, match="only --use-trace-timestamps follows: add it"):
        WorkloadConfig(trace_file=trace, num_rounds=2, mooncake_slowdown_factor=0.5)
    with pytest.raises(ConfigError, match="must be > 0"):
        WorkloadConfig(trace_file=trace, num_rounds=2, use_trace_timestamps=True, mooncake_slowdown_factor=0)
