"""Recorded runs (`run --record-cache-ops`) replayed through SGLang 0.5.23's cache (`conform`): every answer, and the
pools after every operation, equal; so are the per-round device and host hits. Page 1 and 16; the three write
policies; a host pool that holds the history and one that must evict; acks 0 to 3 steps late; a cache flushed
between rounds; L1 only; both stages of a PP=2 world. Needs sglang 0.5.23 (make installs it); skipped with the
reason where it is missing.
"""

from __future__ import annotations

import pytest

from hicache_lab.__main__ import main
from hicache_lab.lab.binders import run
from hicache_lab.lab.presets import WORKLOAD, config
from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, sglang_version
from hicache_lab.lab.sglang.recording import ops_path
from hicache_lab.lab.sglang.replay import replay

pytestmark = pytest.mark.skipif(
    sglang_version() != SGLANG_VERSION,
    reason=f"sglang {SGLANG_VERSION} is not installed (make installs it; see requirements-sglang-cpu.txt)",
)

L2 = "--enable-hierarchical-cache"
RUNS = {  # name: run flags on top of the small workload (write_through, host 3x device, acks 0..3 steps late)
    "default": L2,
    "page_16": f"{L2} --page-size 16",
    "write_through_selective": f"{L2} --hicache-write-policy write_through_selective",
    "write_back": f"{L2} --hicache-write-policy write_back",
    "host_evicts": f"{L2} --hicache-ratio 1.5",
    "host_evicts_page_16": f"{L2} --hicache-ratio 1.5 --page-size 16",
    "host_evicts_write_back": f"{L2} --hicache-ratio 1.5 --hicache-write-policy write_back",
    "acks_on_time": f"{L2} --max-copy-delay-steps 0",
    "acks_1_late": f"{L2} --max-copy-delay-steps 1",
    "acks_2_late": f"{L2} --max-copy-delay-steps 2",
    "flushed_between_rounds": f"{L2} --flush-cache-between-rounds",
    "l1_only": "",
    "pp_2": f"{L2} --pp 2",
    "chunks_and_retractions": f"{L2} --chunked-prefill-size 16 --output-length 64 --num-rounds 2 --num-clients 8",
}


def record(flags: str, out) -> dict:
    cfg = config(WORKLOAD, flags).with_lab(record_cache_ops=True)
    return run(cfg, out, verbose=False)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.spawns] * ("--pp" in RUNS[n])) for n in RUNS])
def test_a_recorded_run_replays_equal_through_sglang(name, tmp_path):
    summary = record(RUNS[name], tmp_path)
    assert summary["completed"]
    for rank in range(len(summary["per_rank_hit_rates"])):
        result = replay(ops_path(tmp_path, rank))
        assert result.replayed == result.operations > 100
        assert result.equal, "\n".join(map(str, result.differences[:5]))
        lab = [(r.device, r.host) for r in result.lab]
        assert lab == [(r.device, r.host) for r in result.sglang]
        if rank == 0 and not summary["scheduling"]["retractions"]:  # the recorded answers are what the run
            # reported, round by round (a retracted request's second admission is not in the report's hits)
            assert lab == [(r["cached_device"], r["cached_host"]) for r in summary["rounds"]]


def test_conform_prints_the_table_and_exits_by_what_it_found(tmp_path, capsys):
    """0 when every answer is equal; 1 when one differs (a load-back threshold SGLang does not have: its is 10);
    2, naming the flag, for a run that recorded nothing."""
    record(L2, tmp_path / "same")
    assert main(["conform", str(tmp_path / "same")]) == 0
    out = capsys.readouterr().out
    assert "every answer and every pool state after every operation equal" in out
    assert "    3        4          0      348             0         348    83.7%       83.7%" in out
    record(f"{L2} --load-back-threshold 90", tmp_path / "other")
    assert main(["conform", str(tmp_path / "other")]) == 1
    assert "answers differ" in capsys.readouterr().out
    run(config(WORKLOAD, L2), tmp_path / "unrecorded", verbose=False)
    assert main(["conform", str(tmp_path / "unrecorded")]) == 2
    assert "run with --record-cache-ops" in capsys.readouterr().err
