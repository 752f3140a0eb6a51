"""`compare`: the lab's cache against SGLang 0.5.23's own in the same world, step by step and rank by rank. Equal
where they agree, and a deliberate change to the lab's agreement caught (lab/check/mutants.py); the bug zoo's
entries reverted in SGLang's own cache. Needs sglang 0.5.23 (make installs it); skipped with the reason where it
is missing.
"""

from __future__ import annotations

import pytest

from hicache_lab.lab.binders import LAB, run
from hicache_lab.lab.check.compare import compare, step_differences, with_impl
from hicache_lab.lab.check.mutants import Mutant
from hicache_lab.lab.check.zoo import ENTRIES, consistent, not_on_sglang, reproduce
from hicache_lab.lab.presets import WORLD, config
from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, sglang_version

pytestmark = pytest.mark.skipif(
    sglang_version() != SGLANG_VERSION,
    reason=f"sglang {SGLANG_VERSION} is not installed (make installs it; see requirements-sglang-cpu.txt)",
)


@pytest.mark.spawns
def test_compare_is_equal_on_cp2_and_catches_max_for_min(tmp_path):
    """The twin runs share SGLang's side: the bent lab run is compared with the same SGLang run."""
    cfg = config(WORLD, "--cp 2 --num-rounds 2")
    same = compare(cfg, tmp_path / "same", LAB)
    assert same.equal, "\n".join(map(str, same.differences[:5]))
    run(with_impl(cfg, "lab"), tmp_path / "bent", verbose=False, more=(Mutant("max_for_min"),))
    bent = step_differences(tmp_path / "bent", tmp_path / "same" / "sglang")
    assert bent and bent[0].quantity == "acks_write"


@pytest.mark.spawns
def test_compare_catches_a_relay_that_skips_a_stage(tmp_path):
    cfg = config(WORLD, "--pp 3 --num-rounds 2")
    bent = compare(cfg, tmp_path, LAB, (Mutant("relay_skips_stage"),))
    first = bent.differences[0]
    assert (first.where, first.quantity, first.lab, first.sglang) == ("step 0, rank 1", "relay_sent", 0, 1)


def test_the_zoo_says_which_entries_run_on_sglangs_cache():
    runnable = {name for name, entry in ENTRIES.items() if not_on_sglang(entry) is None}
    assert {"write_acks", "load_acks", "relay_send_growth", "write_back_heads"} <= runnable
    assert "lab's key format" in not_on_sglang(ENTRIES["storage_hits_per_stage"])
    assert "--fault" in not_on_sglang(ENTRIES["pop_empty"])


@pytest.mark.spawns
def test_the_relay_send_leak_reverted_in_sglangs_cache_grows_and_released_does_not(tmp_path):
    broken, fixed = reproduce(ENTRIES["relay_send_growth"], tmp_path, cache_impl="sglang")
    assert broken.symptom and "never freed" in broken.symptom
    assert consistent(fixed)
