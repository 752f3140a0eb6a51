"""SGLang's releases as every rank's cache (`--cache-impl sglang==X`, lab/sglang/releases.py): each cross-rank bug
shows in the releases whose own code has it and stops in the release its fix landed in, release beside release on
the same world and seed, and the lab's `--sync legacy` diverges as the release it stands for. A test whose
releases are not installed skips, saying how to install them (`make test` installs them).
"""

from __future__ import annotations

import sys
import types

import pytest

from hicache_lab.errors import ConfigError
from hicache_lab.lab.binders import LAB
from hicache_lab.lab.check.compare import compare
from hicache_lab.lab.check.releases import WORLDS, config, judge, run_cell
from hicache_lab.lab.check.zoo import ENTRIES, impls, not_in_releases
from hicache_lab.lab.presets import WORLD, World
from hicache_lab.lab.presets import config as preset_config
from hicache_lab.lab.sglang import releases
from hicache_lab.lab.sglang.binder import SGLANG_CACHE

WORLD_BY_KEY = {w.key: w for w in WORLDS}
PP2_SHORT = World("PP 2, 1 round", "--pp 2 --num-rounds 1", key="pp2")  # one round: the suite's budget
CP2_SHORT = World("CP 2, DP attention, 1 round", "--cp 2 --enable-dp-attention --num-rounds 1", key="cp2-dpa")


def installed(*versions: str):
    reasons = [why for v in versions if (why := releases.missing(v))]
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons))


@pytest.mark.spawns
@installed("0.5.12", "0.5.13", "0.5.15")
def test_the_pp_relay_lands_in_0_5_13_and_its_leak_is_drained_in_0_5_15(tmp_path):
    """0.5.12 diverges where the lab's legacy does; 0.5.13 agrees but never reaps its relay sends; 0.5.15 agrees
    and drains them."""
    cfg = preset_config(WORLD, PP2_SHORT.flags, "--sync legacy")
    legacy = compare(cfg, tmp_path / "legacy", LAB, against="sglang==0.5.12")
    lab, old = legacy.summaries["lab"], legacy.summaries["sglang"]
    assert old["diverged"] and old["first_divergence"]["quantity"] == "acks_write"
    assert lab["first_divergence"] == old["first_divergence"]
    relay = run_cell("0.5.13", PP2_SHORT, tmp_path)
    assert relay.outcome == "leaked", relay.detail
    drained = run_cell("0.5.15", PP2_SHORT, tmp_path)
    assert drained.outcome == "agreed", drained.detail
    assert "at most 2 relay sends" in drained.detail or "at most 1 relay send " in drained.detail


@pytest.mark.spawns
@installed("0.5.10", "0.5.11")
def test_the_cp_groups_land_in_0_5_11_under_dp_attention(tmp_path):
    """Under DP attention 0.5.10 agrees write acks over the attention-TP group alone: CP peers diverge on them.
    0.5.11 agrees them over the CP group too; its CP peers still disagree on load acks (agreed from 0.5.13)."""
    before, after = run_cell("0.5.10", CP2_SHORT, tmp_path), run_cell("0.5.11", CP2_SHORT, tmp_path)
    assert before.outcome == "diverged" and "acks_write" in before.detail, before.detail
    assert after.outcome != "diverged" or "acks_load" in after.detail, after.detail


def test_the_zoo_names_the_releases_that_have_a_bug_and_its_fix():
    """An entry whose bug lives in SGLang's releases runs broken on the last one with it and fixed on the first
    with the fix, neither with a fix switched; one whose bug no release has says so."""
    assert impls(ENTRIES["write_acks"], "releases") == ("sglang==0.5.12", "sglang==0.5.13")
    assert impls(ENTRIES["relay_send_growth"], "releases") == ("sglang==0.5.14", "sglang==0.5.15")
    assert "no release the lab runs" in not_in_releases(ENTRIES["early_return"])
    assert impls(ENTRIES["write_acks"], "sglang") == ("sglang", "sglang")


def test_cache_impl_names_a_release_the_lab_runs_or_says_which_it_does():
    with pytest.raises(ValueError, match="0.5.12"):
        releases.parse("sglang==0.5.99")
    assert releases.parse("sglang") == releases.REFERENCE and releases.parse("lab") is None
    with pytest.raises(ConfigError, match="unknown --cache-impl"):
        SGLANG_CACHE.check(preset_config(WORLD, "--cache-impl sglang=0.5.12"))


def test_a_release_not_installed_is_refused_saying_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HICACHE_LAB_RELEASES", str(tmp_path))
    assert releases.installed() in ([], [releases.REFERENCE])  # the reference is the venv's
    with pytest.raises(ConfigError, match="make releases RELEASES=0.5.12 installs it"):
        SGLANG_CACHE.check(config("0.5.12", WORLD_BY_KEY["pp2"]))


@installed("0.5.12")
def test_what_a_release_cannot_run_is_refused_before_any_rank_starts():
    for flags, reason in (
        ("pp2-l3", "storage flow"),
        ("pp2", None),
    ):
        cfg = config("0.5.12", WORLD_BY_KEY[flags])
        if reason is None:
            SGLANG_CACHE.check(cfg)
        else:
            with pytest.raises(ConfigError, match=reason):
                SGLANG_CACHE.check(cfg)
    with pytest.raises(ConfigError, match="agrees as its own code does"):
        SGLANG_CACHE.check(preset_config(WORLD, "--pp 2 --sync legacy --cache-impl sglang==0.5.12"))


def test_one_process_holds_one_release(monkeypatch):
    version = next((v for v in releases.RELEASES if v != releases.REFERENCE and not releases.missing(v)), None)
    if version is None:
        pytest.skip("no release is installed: make releases")
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(__file__="/elsewhere/sglang/__init__.py"))
    with pytest.raises(RuntimeError, match="one release per process"):
        releases.activate(version)


def test_a_run_is_judged_by_what_it_shows_first():
    base = {"interrupted": None, "diverged": False, "crashed": False, "error": None, "outputs_match_reference": True}
    world = WORLD_BY_KEY["pp2"]

    def outcome(**fields):
        return judge("0.5.13", world, {**base, **fields}).outcome

    divergence = {"step": 3, "quantity": "acks_write", "values": {"0": 0, "1": 1}}
    assert outcome(diverged=True, first_divergence=divergence, crashed=True, error="boom") == "diverged"
    assert outcome(crashed=True, error="rank 1 timed out in all_reduce") == "deadlocked"
    assert outcome(crashed=True, error="boom") == "crashed"
    assert outcome(outputs_match_reference=False) == "wrong"
    assert outcome(scheduling={"max_relay_sends": 9, "max_older_relay_sends": 8}) == "leaked"
    assert outcome(scheduling={"max_relay_sends": 1, "max_older_relay_sends": 0}) == "agreed"
    assert outcome(interrupted="SIGINT") == "not judged"
