"""torchrun across nodes, in this process: a rank that completed says so over the world's store, so rank 0, not
finding its result in its own --out (one not shared between the nodes), says so at once instead of waiting the
collective timeout and calling the rank dead."""

from __future__ import annotations

import dataclasses
import json
import time

import torch.distributed as dist

from hicache_lab.entrypoints import torchrun
from hicache_lab.entrypoints.report import WorldEnd, blame
from hicache_lab.lab.presets import config

QUESTION = "is --out one directory shared by every node?"


def _rank0_alone(tmp_path):
    """rank 0's view: its own result in its --out, rank 1's not (it went to the other node's --out)."""
    cfg = config("--pp 2 --collective-timeout 60")
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "run_id": "r", "completed": True, "crashed": False}))
    result = {"completed": True, "crashed": False, "peers": {"0": 1}}  # rank 1 ran on another host: no pid here
    return cfg, result, WorldEnd("r")


def test_a_rank_that_completed_where_rank_0_cannot_see_its_result_is_named_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(torchrun, "VISIBLE_S", 0.3)
    cfg, result, end = _rank0_alone(tmp_path)
    store = dist.HashStore()
    store.set(torchrun._key("completed", 1), "node-b")  # what rank 1 says as it leaves
    started = time.monotonic()
    assert torchrun._await_peers(cfg, tmp_path, result, end, store) is None
    assert time.monotonic() - started < 5  # not the collective timeout (60 s)
    torchrun._name_missing(cfg, tmp_path, result, end, store)
    assert end.stopped[1].endswith(f"though it completed on host node-b: {QUESTION}")
    error, rank = blame([json.loads((tmp_path / "rank0.json").read_text())], [1], end, 1.0)
    assert rank == 1 and error.startswith(f"rank 1 never reported: its result is not visible here in {tmp_path}")


def test_a_rank_that_said_nothing_is_not_said_to_have_completed(tmp_path):
    cfg, result, end = _rank0_alone(tmp_path)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, collective_timeout_s=0.3))
    store = dist.HashStore()
    store.set(torchrun._key("completed", 1).replace("/0/", "/1/"), "node-b")  # another attempt's word
    assert torchrun._await_peers(cfg, tmp_path, result, end, store) is None
    torchrun._name_missing(cfg, tmp_path, result, end, store)
    assert end.stopped[1] == "no process of it known here (on another host, or it never met rank 0)"
    torchrun._name_missing(cfg, tmp_path, result, end, None)  # no store (it could not be joined): the same
    assert QUESTION not in end.stopped[1]
