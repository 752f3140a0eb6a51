"""bench/e2e_ttft.py on CPU with its tiny settings: three runs of one workload, the floor holds everything, and
the bounds and ratios follow from the stored TTFTs and copy times (a stand-in copy timer gives CPU copy times)."""

from __future__ import annotations

import json

import pytest

from bench import e2e_ttft

TTFT = ("l1_only_ttft_ms", "l1_l2_ttft_ms", "all_on_device_ttft_ms")


def bench(tmp_path, *flags: str) -> dict:
    out = tmp_path / "e2e_ttft.json"
    returned = e2e_ttft.main(["--smoke", "--out", str(out), *flags])
    stored = json.loads(out.read_text())
    assert stored == json.loads(json.dumps(returned)), "what it returns is what it wrote"
    return stored


def test_three_runs_of_one_workload_and_no_copy_time_on_cpu(tmp_path):
    result = bench(tmp_path)
    assert len(result["runs"]) == 1 and set(result["runs"][0]) == {"L1 only", "L1 + L2", "all on device"}
    runs, rows = result["runs"][0], result["rounds"]
    assert [len(r) for r in runs.values()] == [len(rows)] * 3 == [result["config"]["workload"]["num_rounds"]] * 3
    for row, l1, l12, floor in zip(rows, runs["L1 only"], runs["L1 + L2"], runs["all on device"], strict=True):
        assert [row[k] for k in TTFT] == [l1["ttft_ms"], l12["ttft_ms"], floor["ttft_ms"]]
        assert row["loaded_tokens"] == l12["cached_host"] + l12["cached_storage"]
        assert row["loaded_bytes"] == row["loaded_tokens"] * result["kv_bytes_per_token"]
        assert floor["hit_rate"] == pytest.approx(floor["upper_bound_hit_rate"]), "the floor evicts nothing"
        assert row["copy_ms"] is row["serial_bound_ms"] is row["cut_vs_overlap"] is None, "not applicable on CPU"
    assert sum(r["loaded_tokens"] for r in rows) > 0, "the L1 + L2 run must load from the host"
    assert sum(r["cached_host"] for r in runs["all on device"]) == 0
    w = result["config"]["workload"]
    history = w["request_length"] + (w["num_rounds"] - 1) * (w["sub_question_input_length"] + w["output_length"])
    assert result["all_on_device_tokens"] >= w["num_clients"] * (history + w["output_length"])
    assert result["machine"]["gpu"] is None and result["machine"]["dtype"] == "float32"


def test_bounds_and_ratios_follow_from_the_stored_times(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e_ttft, "time_copies", lambda sizes, device, repeats: [n / 1e4 for n in sizes])
    result = bench(tmp_path, "--dtype", "bfloat16", "--later-from", "2")
    assert result["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 2, "2 layers x 4 heads x 16 dims, K and V, 2 bytes"
    for row in result["rounds"]:
        l1, got, floor = (row[k] for k in TTFT)
        assert row["copy_ms"] == row["loaded_bytes"] / 1e4
        assert row["serial_bound_ms"] == floor + row["copy_ms"]
        assert row["overlap_bound_ms"] == max(floor, row["copy_ms"])
        if l1 != row["serial_bound_ms"]:
            assert row["cut_vs_serial"] == pytest.approx((l1 - got) / (l1 - floor - row["copy_ms"]))
    mean, later = result["later_mean"], [r for r in result["rounds"] if r["round"] >= 2]
    assert mean["rounds"] == [r["round"] for r in later] and len(later) == 2
    l1, got, floor, copy = (sum(r[k] for r in later) / 2 for k in (*TTFT, "copy_ms"))
    overlap = sum(max(r["all_on_device_ttft_ms"], r["copy_ms"]) for r in later) / 2
    assert mean["cut_vs_serial"] == pytest.approx((l1 - got) / (l1 - (floor + copy)))
    assert mean["cut_vs_overlap"] == pytest.approx((l1 - got) / (l1 - overlap))
    assert result["later_mean_ttft_ms"] == pytest.approx({"L1 only": l1, "L1 + L2": got, "all on device": floor})


def test_repeats_take_turns_and_each_figure_is_the_median_of_per_repeat_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e_ttft, "time_copies", lambda sizes, device, repeats: [n / 1e4 for n in sizes])
    result = bench(tmp_path, "--repeats", "3")
    runs, repeats = result["runs"], result["repeats"]
    assert len(runs) == len(repeats) == 3 and all(set(r) == set(e2e_ttft.RUNS) for r in runs)
    for label, key in e2e_ttft.TTFT_KEYS.items():
        for i, row in enumerate(result["rounds"]):
            ttfts = sorted(run[label][i]["ttft_ms"] for run in runs)
            assert row[key] == ttfts[1], f"{label} round {i}: the median of the repeats"
    for run, repeat in zip(runs, repeats, strict=True):  # a repeat's ratio uses its own TTFTs only
        l1, got = (run[k][2]["ttft_ms"] for k in ("L1 only", "L1 + L2"))
        bound = repeat["rounds"][2]["serial_bound_ms"]
        assert bound == run["all on device"][2]["ttft_ms"] + repeat["rounds"][2]["copy_ms"]
        assert repeat["rounds"][2]["cut_vs_serial"] == pytest.approx((l1 - got) / (l1 - bound))
    cuts = sorted(r["later_mean"]["cut_vs_serial"] for r in repeats)
    assert result["later_mean"]["cut_vs_serial"] == cuts[1], "the headline: the median repeat's ratio"
