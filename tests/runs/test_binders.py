"""The seam lab tooling attaches through (entrypoints/binders.py): a lab flag that nothing in the run serves is
refused before any rank starts, and what a binder binds reaches every rank and its result."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hicache_lab.config import LabConfig
from hicache_lab.entrypoints.binders import Binder
from hicache_lab.entrypoints.launch import run_world
from hicache_lab.errors import ConfigError
from hicache_lab.lab.binders import LAB


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"fault": "slow-rank:0@1"}, "--fault slow-rank:0@1"),
        ({"skip_load_wait": True}, "--skip-load-wait"),
        ({"sync_impls": ("pp_sync=my_sync:pp_sync",)}, "--sync-impl pp_sync=my_sync:pp_sync"),
        ({"record_cache_ops": True}, "--record-cache-ops"),
        ({"cache_impl": "sglang"}, "--cache-impl sglang"),
        ({"dp_attention": True}, "--enable-dp-attention"),
    ],
)
def test_a_lab_flag_nothing_serves_is_refused_before_any_rank_starts(small_config, tmp_path, change, flag):
    cfg = small_config(check_outputs=False).with_lab(**change)
    with pytest.raises(ConfigError, match=f"^{flag}: lab tooling that nothing in this run serves"):
        run_world(cfg, tmp_path / "out", verbose=False)
    assert not (tmp_path / "out").exists()


def test_the_lab_serves_every_lab_field():
    assert sorted(f for binder in LAB for f in binder.fields) == sorted(f.name for f in dataclasses.fields(LabConfig))


class Counting(Binder):
    """Counts the ranks it is bound into; each rank's result says so."""

    def bind(self, cfg, parts, out_dir):
        return lambda: {"bound_into": [parts.rank, type(parts.cache).__name__, parts.loop.iteration]}


def test_what_a_binder_binds_reaches_the_rank_and_its_result(small_config, tmp_path):
    run_world(small_config(check_outputs=False), tmp_path, verbose=False, binders=(Counting(),))
    rank, cache, iterations = json.loads((tmp_path / "rank0.json").read_text())["bound_into"]
    assert rank == 0 and cache == "RadixCache" and iterations > 0  # asked at the end: the run's steps are in it
