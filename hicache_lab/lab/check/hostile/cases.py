"""The hostile-input cases (lab/hostile.py judges them), one section per class.

`R` is the issue's storage run: 4 clients x 3 rounds, host tier and file store (in `store/`, beside the run's
`out/`), caches flushed between rounds so every later round's hits come from storage.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from ....entrypoints.launch import free_ports
from ....mem_cache.hicache_storage import mooncake_missing
from ...presets import WORKLOAD, WORLD
from .judge import CLEAN_ENV, Hostile, Outcome, lab, processes, reap_session

R = [
    *("run", "--num-clients", "4", "--num-rounds", "3", "--enable-hierarchical-cache"),
    *("--hicache-storage-backend", "file", "--hicache-storage-dir", "store", "--flush-cache-between-rounds"),
    *("--storage-prefetch-threshold", "16", "--hicache-storage-prefetch-policy", "wait_complete"),
]
STORE = ("out", "store", "first")  # what a storage case's runs own


def _twice(first: list[str], second: list[str]):
    """A case that runs R twice on one store: `first` flags, then `second` flags (checked, into out/)."""

    def run(scratch: Path):
        lab(scratch, *R, *first, "--out", "first")
        return lab(scratch, *R, *second, "--check-outputs", "--out", "out")

    return run


# -- 1. Storage serves another model's KV ---------------------------------------------------------------------

STORAGE_IDENTITY = [
    Hostile(
        1,
        "fills a store with one model, then runs another `--mlp-size` on it",
        _twice([], ["--mlp-size", "64"]),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
    Hostile(
        1,
        "fills a store, then runs a model of another `--vocab-size` (same page shape) on it",
        _twice([], ["--vocab-size", "200"]),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
]

# -- 2. A page under another page's name ----------------------------------------------------------------------


def _after_filling(change: Callable[[list[Path]], None], flags: tuple[str, ...] = ()):
    """A case that fills the store with R, changes its page files (`change(files)`), then runs R on it again."""

    def run(scratch: Path):
        lab(scratch, *R, *flags, "--out", "first")
        change(sorted((scratch / "store").glob("*.bin")))
        return lab(scratch, *R, *flags, "--check-outputs", "--out", "out")

    return run


def _rotate(files: list[Path]) -> None:
    """Every page file takes the bytes of the next one: intact pages, each under another page's name."""
    payloads = [f.read_bytes() for f in files]
    for file, payload in zip(files, payloads[1:] + payloads[:1], strict=True):
        file.write_bytes(payload)


def _other_shard(files: list[Path]) -> None:
    """TP rank 1's pages replaced by TP rank 0's pages of the same hash: the right page, the wrong shard."""
    for file in files:
        if "_tp1of2_" in file.name:
            file.write_bytes(file.with_name(file.name.replace("_tp1of2_", "_tp0of2_")).read_bytes())


PAGE_NAMES = [
    Hostile(
        2,
        "rotates a filled store's page files, so every valid page sits under another page's name",
        _after_filling(_rotate),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
    Hostile(
        2,
        "copies TP rank 0's pages over TP rank 1's (`--tp 2`): the right page of the wrong shard",
        _after_filling(_other_shard, ("--tp", "2")),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
    ),
]

# -- 3. One stage's damaged page ------------------------------------------------------------------------------


def _damaged(policy: str, *flags: str, rank: int = 1, slow: bool = False) -> Hostile:
    """`--pp 2` (and `flags`): rank `rank`, on stage 1, finds its 4th page read damaged on disk."""
    run = [*R, "--pp", "2", "--hicache-storage-prefetch-policy", policy, *flags, "--fault", f"damage-page:{rank}@3"]
    return Hostile(
        3,
        f"damages a page of stage 1's shard before rank {rank} reads it (`--pp 2`, {policy}"
        f"{', ' if flags else ''}{' '.join(flags)})",
        lambda scratch: lab(scratch, *run, "--check-outputs", "--out", "out"),
        0,
        "outputs_match_reference: True",
        owns=STORE,
        exact=True,
        slow=slow,
    )


STAGE_DAMAGE = [  # (best_effort takes a prefetch before it reads anything here: the fault would never fire)
    _damaged("wait_complete"),
    _damaged("timeout", "--latency", "real"),
    _damaged("wait_complete", "--tp", "2", rank=3, slow=True),  # 4 ranks
]

# -- 4. Hangs no timeout covers -------------------------------------------------------------------------------

TRACE_LINE = {"timestamp": 1, "input_length": 100, "output_length": 5, "hash_ids": [1]}  # a valid Mooncake line


def _lines(*rows: object) -> str:
    """JSONL text: dicts and lists as JSON, strings as they are."""
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def _refusal(
    klass: int,
    name: str,
    args: list[str],
    says: str,
    *,
    files: dict[str, str | bytes | Callable[[], str]] | None = None,
    env: dict[str, str] | None = None,
    cwd: str = "",
    slow: bool = False,
) -> Hostile:
    """A case refused at start: `python -m hicache_lab ARGS` exits 2 saying `says`, and writes nothing. `files`
    (name: text or bytes, or a function giving text) are written beside the run first; `cwd` replaces the scratch
    directory as the working directory; `env` is added to the environment."""

    def run(scratch: Path) -> Outcome:
        for file, text in (files or {}).items():
            text = text() if callable(text) else text
            (scratch / file).write_bytes(text if isinstance(text, bytes) else text.encode())
        return lab(Path(cwd) if cwd else scratch, *args, env=env)

    return Hostile(klass, name, run, 2, says, owns=("out", *(files or {})), slow=slow)


def _million_ids() -> str:
    """A trace whose second line names 2,000,000 hash ids: a prompt of 32 million tokens at 16 per id."""
    return _lines(TRACE_LINE, {**TRACE_LINE, "input_length": 512 * 2_000_000, "hash_ids": list(range(2_000_000))})


OUT = ("--out", "out")
PREFLIGHT_BOUNDS = [
    _refusal(
        4,
        "`--hicache-ratio 1e12`: a host pool of 4e15 tokens",
        ["run", "--enable-hierarchical-cache", "--hicache-ratio", "1e12", *OUT],
        "for host KV pools: lower --hicache-ratio",
    ),
    _refusal(
        4,
        "`--max-total-tokens 1000000000000`: a device pool of 10**12 tokens",
        ["run", "--max-total-tokens", "1000000000000", *OUT],
        "for device KV pools: lower --max-total-tokens",
    ),
    _refusal(
        4,
        "`--vocab-size 1000000000`: embeddings and logits of a billion tokens",
        ["run", "--vocab-size", "1000000000", *OUT],
        "GB, for logits of every output: lower --vocab-size",
    ),
    _refusal(
        4,
        "`--injected-delay-ms 1e9`: every copy waits 11 days on average",
        ["run", "--enable-hierarchical-cache", "--latency", "real", "--injected-delay-ms", "1e9", *OUT],
        "keep it under 1/100 of --collective-timeout (600 ms for 60 s)",
    ),
    _refusal(
        4,
        "`exhaustive --copies 50 --max-delay 50`: 10**79 schedules",
        ["exhaustive", "--copies", "50", "--max-delay", "50"],
        "--stages 2 --copies 50 --max-delay 50 asks for at least",
    ),
    _refusal(
        4,
        "a `--trace-file` line of 2,000,000 hash ids (32 million tokens to draw)",
        ["run", "--trace-file", "long.jsonl", "--num-rounds", "2", *OUT],
        "--trace-file long.jsonl:2: its request holds 32000001 tokens of KV",
        files={"long.jsonl": _million_ids},
    ),
    _refusal(
        4,
        "`--enable-hierarchical-cache --hicache-size 1e6`: a petabyte of host pool",
        ["run", "--enable-hierarchical-cache", "--hicache-size", "1e6", *OUT],
        "for host KV pools: lower --hicache-size",
        slow=True,
    ),
    _refusal(
        4,
        "`--num-clients 1000000000`: a billion conversations",
        ["run", "--num-clients", "1000000000", *OUT],
        "for logits of every output: lower --vocab-size, --output-length, --num-clients x --num-rounds",
        slow=True,
    ),
    _refusal(
        4,
        "`--chunked-prefill-size -1` with 200,000-token prompts: one attention of 4 x 200k x 200k",
        ["run", "--chunked-prefill-size", "-1", "--request-length", "200000", "--max-total-tokens", "300000"]
        + ["--num-rounds", "1", *OUT],
        "for attention of one prefill: lower --chunked-prefill-size",
        slow=True,
    ),
    _refusal(
        4,
        "`--pp-async-batch-depth 10000000`: ten million micro-batch slots per step",
        ["run", "--pp-async-batch-depth", "10000000", *OUT],
        "--pp-async-batch-depth 10000000: every slot is one more turn of each stage's event loop per step",
        slow=True,
    ),
    _refusal(
        4,
        "`--collective-timeout 1e9`: a stuck collective would wait 31 years",
        ["run", "--collective-timeout", "1e9", *OUT],
        "--collective-timeout 1e+09 s: a stuck collective would hang that long; give at most 86400 s",
        slow=True,
    ),
    _refusal(
        4,
        "`exhaustive --copies 1000000000 --max-delay 1`: few timings, a billion steps each",
        ["exhaustive", "--copies", "1000000000", "--max-delay", "1"],
        "stage-steps, at most 150,000",
        slow=True,
    ),
]

USER_SYNC = '''\
"""A user's --sync-impl functions that misbehave (hostile_cases.py writes this file beside the run)."""
import socket
import sys
import time


def sleep(self, data):
    time.sleep(3600)


def spin(self, count):
    while True:
        pass


def deaf(self, data):
    mine, theirs = socket.socketpair()
    mine.recv(1)  # a receive no one sends


def leave(self, *args):
    sys.exit(0)


def leave_on_stage_1(self, data):
    if self.pp_rank == 1:
        sys.exit(0)
'''
USER_CODE = ("out", "user_sync.py", "user_sync_top.py")  # what a user-code case owns: its run and the modules


def _user_code(*args: str, top: str = ""):
    """A case that writes USER_SYNC as user_sync.py (and `top`, module-level code, as user_sync_top.py) beside the
    run, then runs `python -m hicache_lab ARGS --out out` (no bytecode cache: nothing else is written)."""

    def run(scratch: Path) -> Outcome:
        (scratch / "user_sync.py").write_text(USER_SYNC)
        (scratch / "user_sync_top.py").write_text(f"import sys\nimport time\n{top}\n\n\ndef f(self, data):\n    pass\n")
        return lab(scratch, *args, "--out", "out", env={"PYTHONDONTWRITEBYTECODE": "1"})

    return run


ONE_RANK = ["run", *WORLD.split(), "--num-rounds", "3", "--collective-timeout", "2"]  # user code bound: 4 s
SYNC_IMPL_BOUNDS = [
    Hostile(
        4,
        "`--sync-impl pp_sync=...` that sleeps for an hour, in a world of one rank (no peer times out)",
        _user_code(*ONE_RANK, "--sync-impl", "pp_sync=user_sync:sleep"),
        1,
        "--sync-impl pp_sync=user_sync:sleep did not return within 4 s (2 x --collective-timeout 2)",
        owns=USER_CODE,
    ),
    Hostile(
        4,
        "`--sync-impl writing_check=...` that loops forever (holding the GIL), one rank",
        _user_code(*ONE_RANK, "--sync-impl", "writing_check=user_sync:spin"),
        1,
        "--sync-impl writing_check=user_sync:spin did not return within 4 s",
        owns=USER_CODE,
    ),
    Hostile(
        4,
        "`--sync-impl pp_sync=...` that waits on a socket no one writes, one rank",
        _user_code(*ONE_RANK, "--sync-impl", "pp_sync=user_sync:deaf"),
        1,
        "--sync-impl pp_sync=user_sync:deaf did not return within 4 s",
        owns=USER_CODE,
    ),
    Hostile(
        4,
        "a `--sync-impl` module whose import never ends (a loop at its top level)",
        _user_code(*ONE_RANK, "--sync-impl", "pp_sync=user_sync_top:f", top="while True:\n    time.sleep(1)"),
        2,
        "cannot import 'user_sync_top': its import did not return within 60 s",
        owns=USER_CODE,
        slow=True,
    ),
]


def _special_files(make: Callable[[Path], None]):
    """A case that fills the store with R, puts a special file (`make(path)`) under every page's name, then runs
    R on it again: each must be a miss, never a read that blocks or never ends."""

    def change(files: list[Path]) -> None:
        for file in files:
            file.unlink()
            make(file)

    return _after_filling(change)


STORAGE_BOUNDS = [
    _refusal(
        4, "asks the soak for worlds of 0 ranks (`soak --max-ranks 0`)", ["soak", "--max-ranks", "0"], "1 to 16 ranks"
    ),
    _refusal(
        10, "asks the soak for no runs (`soak --runs 0`)", ["soak", "--runs", "0"], "--runs 0: must be at least 1"
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
]

# -- 5. Orphan processes --------------------------------------------------------------------------------------

WORLD2 = ["run", *WORLD.split(), "--pp", "2", "--num-rounds", "8"]  # two stages, long enough to signal mid-run
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def _started(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def _children(pid: int, word: str = "") -> list[int]:
    """The live children of `pid` whose command line holds `word`, first started first."""
    found = [p for p, command in processes(lambda f: int(f[1]) == pid).items() if word in command]
    with contextlib.suppress(OSError):
        return sorted(found, key=_started)
    return []


def _ranks(proc: subprocess.Popen, count: int = 2) -> list[int]:
    """The launcher's (or torchrun's) `count` rank processes, rank 0 first, once there; [] if it ended first."""
    while proc.poll() is None:
        if len(ranks := _children(proc.pid, "spawn_main") or _children(proc.pid, "hicache_lab")) >= count:
            return ranks
        time.sleep(0.05)
    return []


def _running(scratch: Path, proc: subprocess.Popen, rank: int = 1) -> None:
    """Wait until rank `rank` has traced a step of its loop (or the launcher ended)."""
    trace = scratch / "out" / f"trace_rank{rank}.jsonl"
    while proc.poll() is None and not (trace.is_file() and trace.stat().st_size):
        time.sleep(0.05)


def _signalled(*flags: str, stop: str = "", launcher: int = 0, group: bool = False, torchrun: bool = False):
    """The two-stage world with `flags`. Rank 1 gets SIGSTOP when it `starts` (before it joins the world) or is
    `running` its loop, if `stop` says so; then the launcher (its whole process group, as Ctrl-C, if `group`)
    gets signal `launcher`, once rank 1 runs."""

    def during(scratch: Path, proc: subprocess.Popen) -> None:
        if not (ranks := _ranks(proc)):
            return
        if stop == "running" or launcher:
            _running(scratch, proc)
        if stop:
            os.kill(ranks[1], signal.SIGSTOP)
        if launcher:
            time.sleep(0.5)
            (os.killpg if group else os.kill)(proc.pid, launcher)

    def run(scratch: Path) -> Outcome:
        args = (*WORLD2, *flags, "--out", "out")
        return (_torchrun if torchrun else lab)(scratch, *args, during=partial(during, scratch))

    return run


def _torchrun(scratch: Path, *args: str, during=None) -> Outcome:
    """`torchrun --nproc-per-node 2 -m hicache_lab ARGS` in `scratch`, as `lab` runs the launcher; torchrun
    starts each rank in a session of its own, so the ranks it started are looked for too once it has ended."""
    seen: set[int] = set()

    def watch(proc: subprocess.Popen) -> None:
        if during is not None:
            threading.Thread(target=during, args=(proc,), daemon=True).start()
        while proc.poll() is None:
            seen.update(_children(proc.pid))
            time.sleep(0.05)

    environ = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [*TORCHRUN, "-m", "hicache_lab", *args],
            cwd=scratch,
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        watcher = threading.Thread(target=watch, args=(proc,))
        watcher.start()
        try:
            code = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(proc.pid, signal.SIGKILL)
        watcher.join()
        leftover = [left for pid in {proc.pid, *seen} for left in reap_session(pid)]
        log.seek(0)
        return Outcome(code, log.read(), leftover)


def _master_killed(scratch: Path) -> Outcome:
    """A one-rank run on the Mooncake store whose mooncake_master the launcher started; SIGKILL of the launcher
    mid-run must take the master with it."""

    def during(proc: subprocess.Popen) -> None:
        while proc.poll() is None and not _children(proc.pid, "mooncake_master"):
            time.sleep(0.05)
        _running(scratch, proc, rank=0)
        proc.kill()

    mooncake = ("--hicache-storage-backend", "mooncake", "--num-rounds", "8")
    return lab(scratch, "run", *WORLD.split(), *mooncake, "--out", "out", during=during)


def _one_rank_interrupted(scratch: Path) -> Outcome:
    """Ctrl-C of a one-rank run (its rank runs in the launcher's own process) once it has run a second."""

    def during(proc: subprocess.Popen) -> None:
        _running(scratch, proc, rank=0)
        time.sleep(1)
        os.killpg(proc.pid, signal.SIGINT)

    long = ("--max-total-tokens", "4096", "--num-clients", "8", "--num-rounds", "40")  # 17 s, unless interrupted
    return lab(scratch, "run", *WORLD.split(), *long, "--out", "out", during=during)


ORPHANS = [
    Hostile(
        5, "SIGKILL of the launcher while rank 1 is stopped (SIGSTOP)", _signalled(stop="running", launcher=9), -9, ""
    ),
    Hostile(
        5,
        "SIGTERM of the launcher while rank 1 is stopped (SIGSTOP)",
        _signalled(stop="running", launcher=signal.SIGTERM),
        128 + signal.SIGTERM,
        "interrupted by SIGTERM",
    ),
    Hostile(
        5,
        "Ctrl-C mid-run (SIGINT to the launcher's whole process group)",
        _signalled(launcher=signal.SIGINT, group=True),
        128 + signal.SIGINT,
        "interrupted by SIGINT",
    ),
    Hostile(
        5,
        "SIGKILL of torchrun while rank 1 is stopped (its ranks run in sessions of their own)",
        _signalled(stop="running", launcher=signal.SIGKILL, torchrun=True),
        -9,
        "",
    ),
    Hostile(
        5,
        "Ctrl-C of a one-rank run (in the launcher's own process)",
        _one_rank_interrupted,
        130,
        "interrupted by SIGINT after",
    ),
    Hostile(
        5,
        "Ctrl-C of torchrun mid-run (it passes SIGINT on to its ranks; it exits 1 for ranks that did not complete)",
        _signalled(launcher=signal.SIGINT, group=True, torchrun=True),
        1,
        "interrupted by SIGINT after",
    ),
    Hostile(
        5,
        "SIGKILL of the launcher of a run whose mooncake_master it started",
        _master_killed,
        -9,
        "",
        needs=mooncake_missing,
    ),
]

# -- 6. Lost or mixed files -----------------------------------------------------------------------------------

SMALL = ["run", *WORLD.split()]  # presets.WORLD: one rank, 4 clients x 4 rounds, outputs checked


def _in_user_dir(scratch: Path) -> Outcome:
    (scratch / "mine").mkdir()
    (scratch / "mine" / "summary.json").write_text('{"my own": "summary"}\n')
    return lab(scratch, *SMALL, "--out", "mine")


def _two_at_once(scratch: Path) -> Outcome:
    """A second run on `out/` while a first holds it (held there: its rank 1 stopped until the second has
    ended): the second is refused, the first ends exact."""
    second = []

    def during(proc: subprocess.Popen) -> None:
        if ranks := _ranks(proc):
            os.kill(ranks[1], signal.SIGSTOP)
            second.append(lab(scratch, *SMALL, "--out", "out"))
            os.kill(ranks[1], signal.SIGCONT)

    first = lab(scratch, *WORLD2, "--out", "out", during=during)
    if first.code != 0 or not second:
        return first
    return Outcome(second[0].code, second[0].output + first.output, first.leftover + second[0].leftover)


def _rerun_beside_notes(scratch: Path) -> Outcome:
    """A run, a file of the user's put beside its files (named much like them), a second run on the same `out/`:
    the user's file is kept."""
    if (first := lab(scratch, *SMALL, "--num-rounds", "2", "--out", "out")).code != 0:
        return first
    (scratch / "out" / "rank0_notes.json").write_text("{}\n")
    again = lab(scratch, *SMALL, "--out", "out")
    kept = (scratch / "out" / "rank0_notes.json").is_file()
    return again if kept else Outcome(None, again.output + "\nout/rank0_notes.json was deleted", again.leftover)


def _torchrun_after_a_larger_run(scratch: Path) -> Outcome:
    """Three stages into `out/`, then two under torchrun on the same `out/`: rank 2's files are not this run's
    (merged, its trace makes the fixed run diverge)."""
    lab(scratch, *SMALL, "--pp", "3", "--num-rounds", "2", "--out", "out")
    outcome = _torchrun(scratch, *SMALL, "--pp", "2", "--out", "out")
    summary = json.loads((scratch / "out" / "summary.json").read_text())
    if summary["diverged"] or set(summary["per_rank_hit_rates"]) != {"0", "1"}:
        return Outcome(None, f"{outcome.output}\nmerged another run's files: {summary['first_divergence']}")
    return outcome


OWNED_OUTPUT = [
    Hostile(
        6,
        "--out '' (the working directory, with the user's rank0.json)",
        lambda s: lab(s, *SMALL, "--out", ""),
        2,
        "--out '' names no directory",
        owns=(),
    ),
    Hostile(
        6,
        "--out . (the working directory)",
        lambda s: lab(s, *SMALL, "--out", "."),
        2,
        "--out . holds files no run of the lab wrote (notes.txt, rank0.json)",
        owns=(),
    ),
    Hostile(
        6,
        "--out a directory of the user's (holding a summary.json)",
        _in_user_dir,
        2,
        "--out mine holds files no run of the lab wrote (summary.json)",
        owns=("mine",),
    ),
    Hostile(
        6,
        "a second run on the --out another run holds",
        _two_at_once,
        2,
        "--out out is in use by another run (pid",
        exact=True,
    ),
    Hostile(
        6,
        "a run again on its --out, a file of the user's (rank0_notes.json) beside its files",
        _rerun_beside_notes,
        0,
        "outputs_match_reference: True",
        exact=True,
    ),
    Hostile(
        6,
        "torchrun, 2 ranks, on the --out of a 3-rank run",
        _torchrun_after_a_larger_run,
        0,
        "outputs_match_reference: True",
        exact=True,
    ),
]

# -- 7. Ranks started with different flags --------------------------------------------------------------------

TWO_STAGES = ["run", *WORLD.split(), "--pp", "2", "--num-rounds", "3", "--collective-timeout", "20"]


def _by_hand(*per_rank: tuple[str, ...]):
    """A world whose ranks are started by hand, as torchrun would: each its own `python -m hicache_lab` with
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, TWO_STAGES and `--out out` plus flags of its own. The
    outcome's code is the one every rank gave (None where they differ); its output, every rank's in turn."""

    def run(scratch: Path) -> Outcome:
        (port,) = free_ports(1)
        outcomes: dict[int, Outcome] = {}

        def rank(r: int) -> None:
            env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(len(per_rank))}
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            outcomes[r] = lab(scratch, *TWO_STAGES, "--out", "out", *per_rank[r], env=env)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(per_rank))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        codes = {o.code for o in outcomes.values()}
        output = "".join(f"--- rank {r}, exit code {o.code}:\n{o.output}" for r, o in sorted(outcomes.items()))
        leftover = [p for o in outcomes.values() for p in o.leftover]
        return Outcome(codes.pop() if len(codes) == 1 else None, output, leftover)

    return run


DIFFERENT_FLAGS = [
    Hostile(
        7,
        "two ranks started by hand (RANK, WORLD_SIZE, MASTER_ADDR/PORT) with the same flags",
        _by_hand((), ()),
        0,
        "outputs_match_reference: True",
        exact=True,
    ),
    Hostile(
        7,
        "two ranks by hand, rank 1 given `--num-layers 2` beside rank 0's 3",
        _by_hand((), ("--num-layers", "2")),
        2,
        "ranks were started with different flags: --num-layers (num_layers: 3 on rank 0, 2 on rank 1)",
    ),
    Hostile(
        7,
        "two ranks by hand, rank 0 with `--no-round-barrier`, rank 1 with `--sync legacy`: each flag is named",
        _by_hand(("--no-round-barrier",), ("--sync", "legacy")),
        2,
        "--no-round-barrier (round_barrier: False on rank 0, True on rank 1); --sync (sync: 'fixed' on rank 0, "
        "'legacy' on rank 1)",
    ),
    Hostile(
        7,
        "two ranks by hand, rank 1 writing to another `--out`",
        _by_hand((), ("--out", "elsewhere")),
        2,
        "--out (out: ",
        owns=("out", "elsewhere"),
    ),
]

# -- 8. Failures that exit 0 ----------------------------------------------------------------------------------

NEVER_FIRES = ["run", *WORLD.split(), "--num-rounds", "3"]
L1_ONLY = ["run", *WORKLOAD.split(), "--num-rounds", "3", "--check-outputs"]  # no host tier: no host writes


def _lab(*args: str) -> Callable[[Path], Outcome]:
    return lambda scratch: lab(scratch, *args, "--out", "out")


EXITS_0 = [
    Hostile(
        8,
        "`--sync-impl writing_check=...` that calls sys.exit(0), one rank (it runs in the launcher's process)",
        _user_code(*ONE_RANK, "--sync-impl", "writing_check=user_sync:leave"),
        1,
        "--sync-impl writing_check=user_sync:leave called sys.exit(0): it must return, or raise an exception",
        owns=USER_CODE,
    ),
    Hostile(
        8,
        "`--sync-impl pp_sync=...` that calls sys.exit(0) on stage 1 of two",
        _user_code(*ONE_RANK, "--pp", "2", "--sync-impl", "pp_sync=user_sync:leave_on_stage_1"),
        1,
        "crashed (rank 1): SyncImplError: --sync-impl pp_sync=user_sync:leave_on_stage_1 called sys.exit(0)",
        owns=USER_CODE,
    ),
    Hostile(
        8,
        "a `--sync-impl` module that calls sys.exit(0) as it is imported",
        _user_code(*ONE_RANK, "--sync-impl", "pp_sync=user_sync_top:f", top="sys.exit(0)"),
        2,
        "cannot import 'user_sync_top': its import called sys.exit(0)",
        owns=USER_CODE,
    ),
    Hostile(
        8,
        "`--fault alloc-fail:0@100000`: far more allocations than the run makes",
        _lab(*NEVER_FIRES, "--fault", "alloc-fail:0@100000"),
        1,
        "--fault alloc-fail:0@100000 never fired: rank 0 made only ",
    ),
    Hostile(
        8,
        "`--fault kill-rank:1@99999` on two stages: the run ends before that iteration",
        _lab(*NEVER_FIRES, "--pp", "2", "--fault", "kill-rank:1@99999"),
        1,
        "--fault kill-rank:1@99999 never fired: rank 1 began only ",
    ),
    Hostile(
        8,
        "`--fault tear-copy:0@0` on a run without the host tier (it makes no host writes)",
        _lab(*L1_ONLY, "--fault", "tear-copy:0@0"),
        1,
        "--fault tear-copy:0@0 never fired: rank 0 made no host writes",
    ),
    Hostile(
        8,
        "`--skip-load-wait` on a device pool the conversations never overflow (nothing is loaded back)",
        _lab(*NEVER_FIRES, "--max-total-tokens", "4096", "--skip-load-wait"),
        1,
        "--skip-load-wait never fired: rank 0 ran no batches that read loaded KV",
    ),
]

# -- 9. Blame and summaries -----------------------------------------------------------------------------------

STOPPED = "rank 1 never reported: its process was stopped by a signal (state T)"


def _file_size_limit(limit: int, *args: str) -> Callable[[Path], Outcome]:
    """A full disk, without root: the run with RLIMIT_FSIZE at `limit` bytes (Python ignores SIGXFSZ, so a write
    past it fails with EFBIG), set on the launcher as it starts (before it writes) and inherited by its ranks."""

    def during(proc: subprocess.Popen) -> None:
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))

    return lambda scratch: lab(scratch, *args, "--out", "out", during=during)


BLAME = [
    Hostile(9, "SIGSTOP on rank 1 mid-run", _signalled("--collective-timeout", "5", stop="running"), 1, STOPPED),
    Hostile(
        9,
        "SIGSTOP on rank 1 before it joins the world",
        _signalled("--collective-timeout", "5", stop="starts"),
        1,
        STOPPED,
    ),
    Hostile(
        9,
        "torchrun, --fault kill-rank:1@10 (torchrun then SIGTERMs rank 0)",
        lambda s: _torchrun(s, *WORLD2, "--fault", "kill-rank:1@10", "--out", "out"),
        1,
        "crashed (rank 1): rank 1 died (its process is gone) without a result",
    ),
    Hostile(
        9,
        "a full disk (a file-size limit of 8 KiB) under one rank",
        _file_size_limit(8192, *SMALL),
        1,
        "cannot write out/trace_rank0.jsonl: File too large (EFBIG)",
    ),
    Hostile(
        9,
        "a full disk (a file-size limit of 8 KiB) under two ranks",
        _file_size_limit(8192, *WORLD2),
        1,
        "cannot write out/trace_rank",
    ),
    Hostile(
        9,
        "torchrun, SIGSTOP on rank 1 mid-run",
        _signalled("--collective-timeout", "5", stop="running", torchrun=True),
        1,
        "rank 1 never reported: its process is stopped by a signal (state T)",
        slow=True,
    ),
]

# -- 10. Values the preflight must refuse ---------------------------------------------------------------------

STALE = "to run on its own, unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT; or start it under torchrun"
RUN_LOG = {"tag": "sglang", "summary": {"cache_hit_rate": 0.4}}  # a valid bench_multiturn line
PREFLIGHT = [
    _refusal(
        10,
        "`--hicache-ratio inf`",
        ["run", "--enable-hierarchical-cache", "--hicache-ratio", "inf", *OUT],
        "argument --hicache-ratio: 'inf' is not a finite number",
    ),
    _refusal(
        10,
        "`--collective-timeout nan` (nan passes every >= check)",
        ["run", "--collective-timeout", "nan", *OUT],
        "argument --collective-timeout: 'nan' is not a finite number",
    ),
    _refusal(10, "`--num-heads 0`", ["run", "--num-heads", "0", *OUT], "--num-heads must be at least 1"),
    _refusal(10, "`--vocab-size 1`", ["run", "--vocab-size", "1", *OUT], "--vocab-size must be at least 2"),
    _refusal(
        10,
        "`--max-total-tokens -5 --page-size 3`",
        ["run", "--max-total-tokens", "-5", "--page-size", "3", *OUT],
        "--max-total-tokens -5 must hold at least one page (--page-size 3)",
    ),
    _refusal(10, "`--seed -1`", ["run", "--seed", "-1", *OUT], "--seed -1 must be in 0..2**63-1"),
    _refusal(
        10,
        "`--out` in a directory no one can create files in (/proc)",
        ["run", "--out", "/proc/hicache-out"],
        "--out /proc/hicache-out is not writable: cannot create a file in /proc",
    ),
    _refusal(
        10,
        "the default `--out runs/latest` from a read-only working directory (/proc)",
        ["run"],
        "--out runs/latest is not writable (relative to the working directory /proc)",
        cwd="/proc",
    ),
    _refusal(
        10,
        "stale `RANK=3 WORLD_SIZE=2` in the environment",
        ["run", *OUT],
        f"RANK is not an integer in 0..1 (WORLD_SIZE 2) (RANK='3', WORLD_SIZE='2'): {STALE}",
        env={"RANK": "3", "WORLD_SIZE": "2"},
    ),
    _refusal(
        10,
        "stale `WORLD_SIZE=2` alone in the environment",
        ["run", *OUT],
        f"RANK is missing (WORLD_SIZE='2'): {STALE}",
        env={"WORLD_SIZE": "2"},
    ),
    _refusal(
        10,
        "a `--trace-file` line whose `hash_ids` hold `true` (a bool is no id)",
        ["run", "--trace-file", "t.jsonl", *OUT],
        "--trace-file t.jsonl:2: 'hash_ids'[0] is True, not a non-negative integer",
        files={"t.jsonl": _lines(TRACE_LINE, {**TRACE_LINE, "hash_ids": [True]})},
    ),
    _refusal(
        10,
        "a `--trace-file` line whose `timestamp` is NaN",
        ["run", "--trace-file", "t.jsonl", *OUT],
        "--trace-file t.jsonl:2: not JSON (NaN is not a number JSON allows)",
        files={"t.jsonl": _lines(TRACE_LINE, '{"timestamp": NaN, "input_length": 100, "hash_ids": [1]}')},
    ),
    _refusal(
        10,
        'a `--trace-file` line whose `output_length` is "5"',
        ["run", "--trace-file", "t.jsonl", *OUT],
        "--trace-file t.jsonl:2: 'output_length' must be an integer of at least 1 (tokens), got '5'",
        files={"t.jsonl": _lines(TRACE_LINE, {**TRACE_LINE, "output_length": "5"})},
    ),
    _refusal(
        10,
        "a `--compare-sglang` log whose `cache_hit_rate` is 1.5",
        ["run", "--compare-sglang", "log.jsonl", *OUT],
        "bench_multiturn log log.jsonl:2: 'summary': 'cache_hit_rate' must be a number in 0..1, got 1.5",
        files={"log.jsonl": _lines(RUN_LOG, {"summary": {"cache_hit_rate": 1.5}})},
    ),
    _refusal(
        10,
        "a `--compare-sglang` log with a round named `round_x`",
        ["run", "--compare-sglang", "log.jsonl", *OUT],
        "bench_multiturn log log.jsonl:1: 'round' key 'round_x' is not round_N",
        files={"log.jsonl": _lines({**RUN_LOG, "round": {"round_x": {"cache_hit_rate": 0.5}}})},
    ),
    _refusal(
        10,
        'a `--compare-sglang` log whose round\'s `average_ttft` is "fast"',
        ["run", "--compare-sglang", "log.jsonl", *OUT],
        "log.jsonl:1: 'round.round_0': 'average_ttft' must be a number of seconds >= 0, got 'fast'",
        files={"log.jsonl": _lines({**RUN_LOG, "round": {"round_0": {"cache_hit_rate": 0.5, "average_ttft": "fast"}}})},
    ),
    _refusal(
        10,
        "`exhaustive --copies 0`",
        ["exhaustive", "--copies", "0"],
        "--stages 2 --copies 0 --max-delay 2: give 2 or 3 stages, at least 1 copy",
    ),
    _refusal(
        10, "`--tp 3` (the README's table)", ["run", "--tp", "3", *OUT], "--num-heads 4 must be divisible by --tp 3"
    ),
    _refusal(
        10,
        "`--out afile`, a regular file (the README's table)",
        ["run", "--out", "afile"],
        "--out afile is a file: give a directory",
        files={"afile": ""},
    ),
    # slow: the rest of the README's table and more of each kind
    _refusal(
        10,
        "`--prefetch-timeout-base=-inf`",
        ["run", "--prefetch-timeout-base=-inf", *OUT],
        "argument --prefetch-timeout-base: '-inf' is not a finite number",
        slow=True,
    ),
    _refusal(
        10, "`--hidden-size 0`", ["run", "--hidden-size", "0", *OUT], "--hidden-size must be at least 1", slow=True
    ),
    _refusal(10, "`--mlp-size 0`", ["run", "--mlp-size", "0", *OUT], "--mlp-size must be at least 1", slow=True),
    _refusal(
        10,
        "`--load-back-threshold -1`",
        ["run", "--load-back-threshold", "-1", *OUT],
        "--load-back-threshold must be >= 0",
        slow=True,
    ),
    _refusal(
        10,
        "`--storage-prefetch-timeout-steps -1`",
        ["run", "--storage-prefetch-timeout-steps", "-1", *OUT],
        "--storage-prefetch-timeout-steps must be >= 0",
        slow=True,
    ),
    _refusal(
        10,
        "`--model-seed` past 2**64",
        ["run", "--model-seed", str(2**70), *OUT],
        f"--model-seed {2**70} must be in 0..2**63-1",
        slow=True,
    ),
    _refusal(
        10,
        "`--mooncake-master nohost` (no port)",
        ["run", "--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake", "--mooncake-master", "nohost"]
        + ["--mooncake-metadata-url", "http://127.0.0.1:8080/metadata", *OUT],
        "--mooncake-master 'nohost': write HOST:PORT",
        slow=True,
    ),
    _refusal(
        10,
        "`--hicache-storage-dir` where no one can create files (/sys)",
        ["run", "--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-dir"]
        + ["/sys/hicache-store", *OUT],
        "--hicache-storage-dir /sys/hicache-store is not writable: cannot create a file in /sys",
        slow=True,
    ),
    _refusal(
        10,
        "stale `RANK=0 WORLD_SIZE=2` without MASTER_ADDR",
        ["run", *OUT],
        f"MASTER_ADDR is missing (RANK='0', WORLD_SIZE='2'): {STALE}",
        env={"RANK": "0", "WORLD_SIZE": "2"},
        slow=True,
    ),
    _refusal(
        10,
        "`WORLD_SIZE=two` in the environment",
        ["run", *OUT],
        f"WORLD_SIZE is not a positive integer (RANK='0', WORLD_SIZE='two'): {STALE}",
        env={"RANK": "0", "WORLD_SIZE": "two"},
        slow=True,
    ),
    _refusal(
        10,
        "a `--trace-file` line that is not UTF-8",
        ["run", "--trace-file", "t.jsonl", *OUT],
        "--trace-file t.jsonl:2: not UTF-8 text",
        files={"t.jsonl": _lines(TRACE_LINE).encode() + b'{"hash_ids": "\xff"}\n'},
        slow=True,
    ),
    _refusal(
        10,
        "a `--trace-file` line nested 100,000 deep",
        ["run", "--trace-file", "t.jsonl", *OUT],
        "--trace-file t.jsonl:1: nested too deeply to be a record",
        files={"t.jsonl": "[" * 100_000 + "]" * 100_000 + "\n"},
        slow=True,
    ),
    _refusal(
        10,
        "a `--trace-file` line whose `timestamp` is 1e999 (json reads inf)",
        ["run", "--trace-file", "t.jsonl", *OUT],
        "--trace-file t.jsonl:2: not JSON (1e999 is beyond a double)",
        files={"t.jsonl": _lines(TRACE_LINE, '{"timestamp": 1e999, "input_length": 100, "hash_ids": [1]}')},
        slow=True,
    ),
    _refusal(
        10,
        "a `--trace-file` line whose `input_length` is true",
        ["run", "--trace-file", "t.jsonl", *OUT],
        "--trace-file t.jsonl:2: 'input_length' must be an integer in 1..512 (1 hash ids of 512 tokens), got True",
        files={"t.jsonl": _lines(TRACE_LINE, {**TRACE_LINE, "input_length": True})},
        slow=True,
    ),
    _refusal(
        10,
        "a `--compare-sglang` log whose `request_count` is 2.5",
        ["run", "--compare-sglang", "log.jsonl", *OUT],
        "'round.round_0': 'request_count' must be an integer >= 0, got 2.5",
        files={"log.jsonl": _lines({**RUN_LOG, "round": {"round_0": {"cache_hit_rate": 0.5, "request_count": 2.5}}})},
        slow=True,
    ),
    _refusal(
        10,
        "`exhaustive --max-delay -1`",
        ["exhaustive", "--max-delay", "-1"],
        "--stages 2 --copies 3 --max-delay -1: give 2 or 3 stages, at least 1 copy, a delay of at least 0 steps",
        slow=True,
    ),
    *(
        _refusal(10, f"`{' '.join(args)}` (the README's table)", [*args, *OUT], says, slow=True)
        for args, says in [
            (["run", "--sync", "maybe"], "unknown --sync 'maybe': use one of off, legacy, fixed"),
            (["run", "--enable-fix", "nonsense"], "argument --enable-fix: invalid choice: 'nonsense'"),
            (["run", "--page-size", "3"], "--max-total-tokens 4096 is not a multiple of --page-size 3: use 4095"),
            (["run", "--hicache-size", "-1"], "--hicache-size must be >= 0 (GB; 0 means: use --hicache-ratio)"),
            (["run", "--pp", "5"], "--pp 5 needs at least as many layers (--num-layers 4)"),
            (["run", "--max-total-tokens", "100"], "--max-total-tokens 100 cannot hold one request of the workload"),
            (["run", "--fault", "explode:0@1"], "--fault 'explode:0@1': write KIND:RANK@N"),
            (["run", "--pp", "3", "--pp-layer-partition", "1,2"], "needs one layer count per stage (--pp 3)"),
            (["run", "--sync-impl", "bogus"], "--sync-impl 'bogus': write SLOT=MODULE:FUNCTION"),
            (["run", "--trace-file", "missing.jsonl"], "--trace-file missing.jsonl: no such file"),
            (["run", "--hicache-storage-backend", "file"], "needs the host tier: add --enable-hierarchical-cache"),
            (["run", "--device", "tpu"], "unknown --device 'tpu': use one of cpu, cuda"),
        ]
    ),
    _refusal(
        10,
        "`run --compare-sglang other.jsonl`, not a bench_multiturn log (the README's table)",
        ["run", "--compare-sglang", "other.jsonl", *OUT],
        "bench_multiturn log other.jsonl:1: no 'summary.cache_hit_rate'",
        files={"other.jsonl": _lines({"summary": {}})},
        slow=True,
    ),
    _refusal(
        10,
        "`exhaustive --stages 4` (the README's table)",
        ["exhaustive", "--stages", "4"],
        "argument --stages: invalid choice: 4 (choose from 2, 3)",
        slow=True,
    ),
]

CASES: list[Hostile] = [
    *STORAGE_IDENTITY,
    *PAGE_NAMES,
    *STAGE_DAMAGE,
    *STORAGE_BOUNDS,
    *PREFLIGHT_BOUNDS,
    *PREFLIGHT,
    *ORPHANS,
    *OWNED_OUTPUT,
    *BLAME,
    *SYNC_IMPL_BOUNDS,
    *DIFFERENT_FLAGS,
    *EXITS_0,
]
