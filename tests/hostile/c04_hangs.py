"""Class 4, hangs no timeout covers: sizes past any machine (refused at start, naming the flag), special files
under a page's name (misses, never a read that blocks), and `--sync-impl` code that never returns (bounded)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from hicache_lab.lab.sglang.cpu import SGLANG_VERSION, sglang_version

from .common import (
    ONE_RANK,
    OUT,
    STORE,
    TRACE_LINE,
    USER_CODE,
    WORLD2,
    after_filling,
    children,
    lines,
    ranks,
    refusal,
    user_code,
)
from .judge import Hostile, Outcome, run_cli


def _special_files(make: Callable[[Path], None], flags: tuple[str, ...] = ()):
    """A case that fills the store with R, puts a special file (`make(path)`) under every page's name, then runs
    R on it again: each must be a miss, never a read that blocks or never ends."""

    def change(files: list[Path]) -> None:
        for file in files:
            file.unlink()
            make(file)

    return after_filling(change, flags)


def _million_ids() -> str:
    """A trace whose second line names 2,000,000 hash ids: a prompt of 32 million tokens at 16 per id."""
    return lines(TRACE_LINE, {**TRACE_LINE, "input_length": 512 * 2_000_000, "hash_ids": list(range(2_000_000))})


LONG_TRACE = {"files": {"long.jsonl": _million_ids}}


def _fork_server_stopped(scratch: Path) -> Outcome:
    def during(proc: subprocess.Popen) -> None:
        if ranks(proc) and (servers := children(proc.pid, "multiprocessing.forkserver")):
            os.kill(servers[0], signal.SIGSTOP)

    return run_cli(scratch, *WORLD2, "--num-rounds", "2", "--out", "out", during=during)


# fmt: off
BOUNDS = [  # (what the adversary asks for, `python -m hicache_lab` ARGS, what the lab says[, refusal's options])
    ("`--hicache-ratio 1e12`: a host pool of 4e15 tokens",
     "run --enable-hierarchical-cache --hicache-ratio 1e12", "for host KV pools: lower --hicache-ratio"),
    ("`--max-total-tokens 1000000000000`: a device pool of 10**12 tokens",
     "run --max-total-tokens 1000000000000", "for device KV pools: lower --max-total-tokens"),
    ("`--vocab-size 1000000000`: embeddings and logits of a billion tokens",
     "run --vocab-size 1000000000", "GB, for logits of every output: lower --vocab-size"),
    ("`--injected-delay-ms 1e9`: every copy waits 11 days on average",
     "run --enable-hierarchical-cache --latency real --injected-delay-ms 1e9",
     "keep it under 1/100 of --collective-timeout (600 ms for 60 s)"),
    ("`exhaustive --copies 50 --max-delay 50`: 10**79 schedules",
     "exhaustive --copies 50 --max-delay 50", "--stages 2 --copies 50 --max-delay 50 asks for at least"),
    ("a `--trace-file` line of 2,000,000 hash ids (32 million tokens to draw)",
     "run --trace-file long.jsonl --num-rounds 2",
     "--trace-file long.jsonl:2: its request holds 32000001 tokens of KV", LONG_TRACE),
]
SLOW_BOUNDS = [  # only in soak --hostile
    ("`--enable-hierarchical-cache --hicache-size 1e6`: a petabyte of host pool",
     "run --enable-hierarchical-cache --hicache-size 1e6", "for host KV pools: lower --hicache-size"),
    ("`--num-clients 1000000000`: a billion conversations", "run --num-clients 1000000000",
     "for logits of every output: lower --vocab-size, --output-length, --num-clients x --num-rounds"),
    ("`--chunked-prefill-size -1` with 200,000-token prompts: one attention of 4 x 200k x 200k",
     "run --chunked-prefill-size -1 --request-length 200000 --max-total-tokens 300000 --num-rounds 1",
     "for attention of one prefill: lower --chunked-prefill-size"),
    ("`--pp-async-batch-depth 10000000`: ten million micro-batch slots per step", "run --pp-async-batch-depth 10000000",
     "--pp-async-batch-depth 10000000: every slot is one more turn of each stage's event loop per step"),
    ("`--collective-timeout 1e9`: a stuck collective would wait 31 years", "run --collective-timeout 1e9",
     "--collective-timeout 1e+09 s: a stuck collective would hang that long; give at most 86400 s"),
    ("`exhaustive --copies 1000000000 --max-delay 1`: few timings, a billion steps each",
     "exhaustive --copies 1000000000 --max-delay 1", "stage-steps, at most 150,000"),
]
# fmt: on


def _bound(row: tuple, slow: bool) -> Hostile:
    """A row of BOUNDS as its case, in a process of its own (if it were not refused, it would hang or take the
    machine's memory: never in the judge's process). `run` gets `--out out`."""
    name, args, says, *options = row
    args = args.split() + (list(OUT) if args.startswith("run") else [])
    return refusal(4, name, args, says, slow=slow, **(options[0] if options else {}))


SYNC_IMPL = [
    Hostile(
        4,
        "`--sync-impl pp_sync=...` that sleeps for an hour, in a world of one rank (no peer times out)",
        user_code(*ONE_RANK, "--sync-impl", "pp_sync=user_sync:sleep"),
        1,
        "--sync-impl pp_sync=user_sync:sleep did not return within 4 s (2 x --collective-timeout 2)",
        owns=USER_CODE,
    ),
    Hostile(
        4,
        "`--sync-impl writing_check=...` that loops forever (holding the GIL), one rank",
        user_code(*ONE_RANK, "--sync-impl", "writing_check=user_sync:spin"),
        1,
        "--sync-impl writing_check=user_sync:spin did not return within 4 s",
        owns=USER_CODE,
    ),
    Hostile(
        4,
        "`--sync-impl pp_sync=...` that waits on a socket no one writes, one rank",
        user_code(*ONE_RANK, "--sync-impl", "pp_sync=user_sync:deaf"),
        1,
        "--sync-impl pp_sync=user_sync:deaf did not return within 4 s",
        owns=USER_CODE,
    ),
    Hostile(
        4,
        "`--sync-impl writing_check=...` that holds the interpreter in one C call, one rank (no thread of the "
        "rank runs, no bound of its own acts)",
        user_code(*ONE_RANK, "--sync-impl", "writing_check=user_sync:in_c"),
        1,
        "rank 0 stopped answering (no heartbeat for",
        owns=USER_CODE,
        slow=True,
    ),
    Hostile(
        4,
        "`--sync-impl writing_check=...` that calls os._exit(0), one rank (no exception, no result, exit code 0)",
        user_code(*ONE_RANK, "--sync-impl", "writing_check=user_sync:ends_the_process"),
        1,
        "crashed (rank 0): rank 0 exited with code 0 (code the rank ran ended its process",
        owns=USER_CODE,
    ),
    Hostile(
        4,
        "`--sync-impl pp_sync=...` whose first call starts a thread (not a daemon) that sleeps an hour, two stages",
        user_code(*ONE_RANK, "--pp", "2", "--sync-impl", "pp_sync=user_sync:leaves_a_thread"),
        0,
        "note: the run's code left thread 'Thread-",
        owns=USER_CODE,
        exact=True,
    ),
    Hostile(
        4,
        "SIGSTOP of the fork server that starts the ranks, as they start (it never reports their exits)",
        _fork_server_stopped,
        0,
        "was stopped by a signal (state T): it could not report the ranks' exits",
        exact=True,
    ),
    Hostile(
        4,
        "a `--sync-impl` module whose import never ends (a loop at its top level)",
        user_code(*ONE_RANK, "--sync-impl", "pp_sync=user_sync_top:f", top="while True:\n    time.sleep(1)"),
        2,
        "cannot import 'user_sync_top': its import did not return within 60 s",
        owns=USER_CODE,
        slow=True,
    ),
]

CASES = [
    refusal(
        4, "asks the soak for worlds of 0 ranks (`soak --max-ranks 0`)", ["soak", "--max-ranks", "0"], "1 to 16 ranks"
    ),
    Hostile(
        4,
        "puts a FIFO nobody writes under every page's name in a filled store",
        _special_files(os.mkfifo),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
    Hostile(
        4,
        "links every page's name in a filled store to /dev/zero (a read that never ends)",
        _special_files(lambda path: path.symlink_to("/dev/zero")),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
    Hostile(
        4,
        "puts a FIFO under every page's name in a store SGLang's own cache filled (`--cache-impl sglang`): its file "
        "backend would block opening one",
        _special_files(os.mkfifo, ("--cache-impl", "sglang")),
        2,
        "in --hicache-storage-dir is a FIFO (named pipe), and SGLang's file backend would block forever",
        owns=STORE,
        needs=lambda: None if sglang_version() == SGLANG_VERSION else f"it runs sglang {SGLANG_VERSION}'s cache",
    ),
    *(_bound(row, slow=False) for row in BOUNDS),
    *(_bound(row, slow=True) for row in SLOW_BOUNDS),
    *SYNC_IMPL,
]
