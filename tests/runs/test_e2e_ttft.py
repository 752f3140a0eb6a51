"""bench/e2e_ttft.py on CPU with its tiny settings: four runs of one workload, the all-on-device pool holds
everything, and the bounds and ratios follow from the stored TTFTs and copy times (a stand-in copy timer gives CPU
copy times); bench/e2e_bounds.py's reading of a step trace, on a trace written here."""

from __future__ import annotations

import json

import pytest

from bench import e2e_bounds, e2e_ttft, gpu_timeline

TTFT = tuple(e2e_bounds.TTFT_KEYS.values())


def bench(tmp_path, *flags: str) -> dict:
    out = tmp_path / "e2e_ttft.json"
    returned = e2e_ttft.main(["--smoke", "--out", str(out), "--warmup", "0", *flags])
    stored = json.loads(out.read_text())
    assert stored == json.loads(json.dumps(returned)), "what it returns is what it wrote"
    return stored


def test_four_runs_of_one_workload_and_no_copy_time_on_cpu(tmp_path):
    result = bench(tmp_path)
    assert len(result["runs"]) == 1 and tuple(result["runs"][0]) == e2e_bounds.RUNS
    runs, rows = result["runs"][0], result["rounds"]
    assert [len(r) for r in runs.values()] == [len(rows)] * 4 == [result["config"]["workload"]["num_rounds"]] * 4
    for row, *measured in zip(rows, *runs.values(), strict=True):
        assert [row[k] for k in TTFT] == [m["ttft_ms"] for m in measured]
        l12, floor = runs["L1 + L2"][row["round"]], runs["all on device"][row["round"]]
        assert row["loaded_tokens"] == l12["cached_host"] + l12["cached_storage"]
        assert 0 <= row["waited_tokens"] <= row["loaded_tokens"], "a first token waits for some of the round's loads"
        assert row["waited_bytes"] == row["waited_tokens"] * result["kv_bytes_per_token"]
        assert floor["hit_rate"] == pytest.approx(floor["upper_bound_hit_rate"]), "all on device evicts nothing"
        assert row["copy_ms"] is row["serial_bound_ms"] is row["cut_vs_overlap"] is None, "not applicable on CPU"
    assert sum(r["loaded_tokens"] for r in rows) > 0, "the L1 + L2 run must load from the host"
    assert sum(r["waited_tokens"] for r in rows) > 0
    assert [r["loaded_tokens"] for r in runs["L2 on device"]] == [r["loaded_tokens"] for r in runs["L1 + L2"]]
    assert sum(r["cached_host"] for r in runs["all on device"]) == 0
    w = result["config"]["workload"]
    history = w["request_length"] + (w["num_rounds"] - 1) * (w["sub_question_input_length"] + w["output_length"])
    assert result["all_on_device_tokens"] >= w["num_clients"] * (history + w["output_length"])
    assert result["machine"]["gpu"] is None and result["machine"]["dtype"] == "float32"
    waves = result["timelines"][0]
    assert tuple(waves) == e2e_bounds.RUNS and result["timeline_round"] == 3
    for label, pieces in waves.items():  # every request of the round has its first token in one wave
        assert sum(p["first_tokens"] for p in pieces) == w["num_clients"], label
    assert sum(p["loaded_tokens"] for p in waves["L1 + L2"]) > 0 == sum(p["loaded_tokens"] for p in waves["L1 only"])


def test_bounds_and_ratios_follow_from_the_stored_times(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e_ttft, "time_copies", lambda sizes, device, repeats: [n / 1e4 for n in sizes])
    result = bench(tmp_path, "--dtype", "bfloat16", "--later-from", "2")
    assert result["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 2, "2 layers x 4 heads x 16 dims, K and V, 2 bytes"
    for row in result["rounds"]:
        l1, got, floor = row["l1_only_ttft_ms"], row["l1_l2_ttft_ms"], row["l2_on_device_ttft_ms"]
        assert row["copy_ms"] == round(row["waited_bytes"]) / 1e4
        assert row["serial_bound_ms"] == floor + row["copy_ms"]
        assert row["overlap_bound_ms"] == max(floor, row["copy_ms"])
        if l1 != row["serial_bound_ms"]:
            assert row["cut_vs_serial"] == pytest.approx((l1 - got) / (l1 - floor - row["copy_ms"]))
    mean, later = result["later_mean"], [r for r in result["rounds"] if r["round"] >= 2]
    assert mean["rounds"] == [r["round"] for r in later] and len(later) == 2
    l1, got, floor, copy = (sum(r[k] for r in later) / 2 for k in (*TTFT[:3], "copy_ms"))
    overlap = sum(max(r["l2_on_device_ttft_ms"], r["copy_ms"]) for r in later) / 2
    assert mean["cut_vs_serial"] == pytest.approx((l1 - got) / (l1 - (floor + copy)))
    assert mean["cut_vs_overlap"] == pytest.approx((l1 - got) / (l1 - overlap))
    ttfts = {label: mean[key] for label, key in e2e_bounds.TTFT_KEYS.items()}
    assert result["later_mean_ttft_ms"] == pytest.approx(ttfts)


def test_repeats_take_turns_each_figure_is_the_median_of_the_repeats_and_each_ratio_that_of_medians(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(e2e_ttft, "time_copies", lambda sizes, device, repeats: [n / 1e4 for n in sizes])
    result = bench(tmp_path, "--repeats", "3")
    runs, repeats = result["runs"], result["repeats"]
    assert len(runs) == len(repeats) == 3 and all(tuple(r) == e2e_bounds.RUNS for r in runs)
    for label, key in e2e_bounds.TTFT_KEYS.items():
        for i, row in enumerate(result["rounds"]):
            ttfts = sorted(run[label][i]["ttft_ms"] for run in runs)
            assert row[key] == ttfts[1], f"{label} round {i}: the median of the repeats"
    for run, repeat in zip(runs, repeats, strict=True):  # a repeat's ratio uses its own TTFTs only
        l1, got = (run[k][2]["ttft_ms"] for k in ("L1 only", "L1 + L2"))
        bound = repeat["rounds"][2]["serial_bound_ms"]
        assert bound == run["L2 on device"][2]["ttft_ms"] + repeat["rounds"][2]["copy_ms"]
        assert repeat["rounds"][2]["cut_vs_serial"] == pytest.approx((l1 - got) / (l1 - bound))
    medians = {k: sorted(r["later_mean"][k] for r in repeats)[1] for k in ("l1_only_ttft_ms", "l1_l2_ttft_ms")}
    serial = sorted(r["later_mean"]["serial_bound_ms"] for r in repeats)[1]
    l1, got = medians["l1_only_ttft_ms"], medians["l1_l2_ttft_ms"]
    assert result["later_mean"]["cut_vs_serial"] == pytest.approx((l1 - got) / (l1 - serial)), "of the medians"


def test_warm_up_turns_run_every_configuration_first_and_are_not_recorded(tmp_path, monkeypatch):
    calls, measure_run = [], e2e_ttft.measure_run
    monkeypatch.setattr(e2e_ttft, "measure_run", lambda label, *a: calls.append(label) or measure_run(label, *a))
    result = bench(tmp_path, "--warmup", "1")
    assert calls == [*e2e_bounds.RUNS, *e2e_bounds.RUNS] and len(result["runs"]) == 1
    assert result["warmup"] == 1


def step(n: int, kind: str, rids: list[int], loaded: int = 0, ms: float = 1.0) -> dict:
    return {"step": n, "kind": kind, "requests": rids, "host_load_tokens": loaded, "ms": ms}


# A round of requests 10-12 in two waves after a step of another round: 10 and 11 load 40 and 30 tokens, 11's
# prefill takes two chunks; 12 loads 50 once they are done, is retracted after one decode and prefilled again.
TRACE = [
    step(0, "decode", [9]),
    step(1, "prefill", [10, 11], loaded=70, ms=5.0),
    step(2, "prefill", [11], ms=4.0),
    step(3, "decode", [10, 11], ms=2.0),
    step(4, "decode", [10, 11], ms=2.0),
    step(5, "prefill", [12], loaded=50, ms=3.0),
    step(6, "decode", [12], ms=1.0),
    step(7, "prefill", [12], loaded=50, ms=3.0),
    step(8, "decode", [12], ms=1.0),
    step(9, "prefill", [13]),
]


def test_a_first_token_waits_for_the_loads_up_to_its_prefills_last_chunk():
    assert e2e_bounds.first_token_steps(TRACE) == {10: 1, 11: 2, 12: 5, 13: 9}, "not the retracted re-prefill"
    rids = {10, 11, 12}
    assert [s["step"] for s in e2e_bounds.round_steps(TRACE, rids)] == list(range(1, 9))
    assert e2e_bounds.waited_tokens(TRACE, rids) == pytest.approx((70 + 70 + 120) / 3)
    assert e2e_bounds.waves(TRACE, rids) == [
        {"first_tokens": 1, "loaded_tokens": 70, "prefill_ms": 5.0, "decodes": 0, "decode_ms": 0.0},
        {"first_tokens": 1, "loaded_tokens": 0, "prefill_ms": 4.0, "decodes": 2, "decode_ms": 4.0},
        {"first_tokens": 1, "loaded_tokens": 50, "prefill_ms": 3.0, "decodes": 1, "decode_ms": 1.0},
        {"first_tokens": 0, "loaded_tokens": 50, "prefill_ms": 3.0, "decodes": 1, "decode_ms": 1.0},
    ]


def gpu_event(stream: int, start: float, length: float, name: str = "gemm", cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": length, "args": {"stream": stream}}


def test_a_gpu_timeline_counts_each_stream_its_overlap_with_the_forward_and_the_idle_time():
    """bench/gpu_timeline.py's reading of a profiler trace (µs): the forward is the stream that ran the most;
    a copy stream's time splits into beside the forward's kernels and alone; CPU events are no GPU time."""
    trace = {
        "traceEvents": [
            *(gpu_event(7, start, 10) for start in (0, 10, 30)),  # the forward: 0-20 and 30-40
            gpu_event(20, 5, 30, "_copy_rows_kernel"),  # 5-35: 15 + 5 beside the forward, 10 alone
            gpu_event(21, 60, 5, "Memcpy DtoH", "gpu_memcpy"),
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100, "args": {}},
        ]
    }
    got = gpu_timeline.summarize(trace, wall_ms=0.1)
    assert got["gpu_busy_ms"] == pytest.approx(0.045) and got["gpu_idle_ms"] == pytest.approx(0.055)  # 0-40, 60-65
    forward, load, backup = got["streams"]
    assert (forward["stream"], forward["role"], forward["busy_ms"], forward["events"]) == (7, "forward", 0.03, 3)
    assert (load["stream"], load["busy_ms"]) == (20, pytest.approx(0.030))
    assert load["beside_forward_ms"] == pytest.approx(0.020) and load["forward_idle_ms"] == pytest.approx(0.010)
    assert backup["top"] == [["Memcpy DtoH", 0.01]] and backup["beside_forward_ms"] == 0.0


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--repeats", "0"], "give at least 1"),
        (["--warmup", "-1"], "give 0 or more"),
        (["--timeline-round", "4"], "rounds are 0 to 3"),
        (["--enable-hierarchical-cache"], "runs with and without the host tier itself"),
    ],
)
def test_bad_bench_flags_are_refused_with_what_to_change(flags, says, capsys):
    with pytest.raises(SystemExit):
        e2e_ttft.parse(["--smoke", *flags])
    assert says in capsys.readouterr().err
