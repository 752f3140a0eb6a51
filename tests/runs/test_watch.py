"""The launcher watches its ranks (entrypoints/watch.py): a rank that holds the interpreter in C code or is
stopped by a signal stops beating and is named after the silence bound; a rank that exits 0 without its result
failed; a stopped fork server, which would never report the ranks' exits, is ended and said, the run's results
kept."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hicache_lab.entrypoints.launch import rank_processes, run_world
from hicache_lab.entrypoints.report import WorldEnd
from hicache_lab.entrypoints.watch import Watch, fork_server_pid, start_beating
from hicache_lab.lab.presets import WORLD, config


def _beat_then(beats, rank: int, what: str) -> None:
    start_beating(beats, rank)
    time.sleep(1)
    if what == "holds the interpreter":
        sum(range(10**12))  # one C call: no other thread of this process runs meanwhile
    elif what == "stops":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(60)


@pytest.mark.spawns
def test_a_rank_that_holds_the_interpreter_or_is_stopped_is_named_after_the_silence_bound(tmp_path):
    ctx = rank_processes()
    beats = ctx.Array("d", 3, lock=False)
    kinds = ("holds the interpreter", "stops", "sleeps")
    procs = [ctx.Process(target=_beat_then, args=(beats, rank, what), daemon=True) for rank, what in enumerate(kinds)]
    for proc in procs:
        proc.start()
    watch, end = Watch(procs, beats, tmp_path, "run", silence_s=3.0), WorldEnd("run")
    try:
        deadline = time.monotonic() + 60
        while len(end.failed) < 2 and time.monotonic() < deadline:
            watch.look(end)
            time.sleep(0.1)
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)
    assert sorted(end.failed) == [0, 1], end.failed  # the sleeper still beats
    assert "stopped answering (no heartbeat for 3 s" in end.failed[0]
    assert "stopped by a signal (state T)" in end.failed[1]


@pytest.mark.spawns
def test_a_stopped_fork_server_is_ended_and_the_run_keeps_its_results(tmp_path):
    """The server is stopped as the ranks start: they complete, but their exits would never be reported."""
    out = tmp_path / "out"

    def stop_the_server_once_ranks_run() -> None:
        deadline = time.monotonic() + 60
        while not list(out.glob("trace_rank*.jsonl")) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(fork_server_pid(), signal.SIGSTOP)

    stopper = threading.Thread(target=stop_the_server_once_ranks_run)
    stopper.start()
    summary = run_world(config(WORLD, "--pp 2 --num-rounds 2"), out, verbose=False)
    stopper.join()
    assert summary["completed"] and summary["outputs_match_reference"]
    assert summary["notes"] and "was stopped by a signal" in summary["notes"][0]
