"""Randomized soak: many small random worlds, each run once per sync mode, counted by outcome.

Case i of seed S is drawn from its own generator (S, i), so any range of cases can run in any invocation and
the results add up: `--first K --runs N` runs cases K..K+N-1 and appends them to `DIR/soak_seed{S}_ranks{M}.csv`
(a case already there is skipped), and the Markdown table beside it counts every row the CSV holds.

Every case draws a world (tp 1-2, cp 1-2, pp 1-4, at most `--max-ranks` ranks), a write policy, a page size,
the storage tier on or off (with a prefetch policy, maybe flushing between rounds), virtual or real latency,
a chunked prefill size, an answer length (long answers run out of decode memory: retractions), a fault on one
rank in a third of the cases (`alloc-fail:R@N`, its Nth slot allocation for a copy fails; or, with the file
store, `damage-page:R@N`, the Nth page it reads is damaged on disk), in a quarter a pause of one rank
(SIGSTOP, then SIGCONT 1-4 s later: well inside the collective timeout), at PP > 1 an async batch depth of
0-2 micro-batches (`--pp-async-batch-depth`), in a quarter one of the lab's own functions loaded as a plug-in
(`--sync-impl`, `PLUGINS`: the plug-in's path, a process of its own even alone, every call audited), in an
eighth a Ctrl-C (SIGINT to the run's process group 0.2-2 s after its ranks started: it must end with its
summary, as any run interrupted; soak_signals.py), and a workload seed. The same case
then runs once in each mode (`fixed`, `legacy`), as its own `python -m hicache_lab run` process group with a
hard wall-clock limit. A `fixed` case with an allocation fault also turns on the proposals that answer it
(`parallel_config.PROPOSALS`: #31425, #38273), which no release has: released 0.5.23 fails there, as SGLang
did. A run is counted as

* a **hang** if it outlives the limit (its whole process group is killed),
* a **crash** if any rank raised or ended without a result,
* a **divergence** if ranks consumed different acks, ran different batches or hold different trees,
* an **output mismatch** if a served request's logits or tokens differ from a from-scratch computation.

`--plugin MODULE:OBJECT` binds your plug-in (lab/plugins.py) into every run instead of a drawn `--sync-impl`, its rows
in a CSV of their own. `--hostile` runs the hostile-input cases instead (a source checkout's tests/hostile/).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from ...args import finite_float
from ...config import PREFETCH_POLICIES, WRITE_POLICIES
from ...entrypoints.ending import Interrupted
from ...entrypoints.preflight import check_writable_dir
from ...errors import ConfigError
from ...parallel_config import PROPOSALS, SYNC_MODES
from ..plugins import answer_in_a_child, load_plugin
from ..presets import BENCH_RESULTS, WORLD
from .soak_hostile import add_hostile_flags, cmd_hostile
from .soak_results import OUTCOMES, is_true, read_rows, write_table
from .soak_signals import interrupt, pause

LIVE: set[subprocess.Popen] = set()  # the runs in flight: a soak that is stopped kills their process groups
MIN_LIMIT_S = 20  # seconds: below it, runs whose ranks are still starting would be counted as hangs
PLUGINS = (  # the lab's own functions as --sync-impl plug-ins: a plug-in's path (its own process, the audit)
    "pp_sync=hicache_lab.distributed.cache_sync:CacheSync._pp_sync",
    "writing_check=hicache_lab.mem_cache.hiradix_cache:HiRadixCache.writing_check",
    "attn_groups=hicache_lab.distributed.cache_sync:CacheSync._attn_groups",
)


@dataclass
class Case:
    case: int
    seed: int
    tp: int
    cp: int
    pp: int
    write_policy: str
    page_size: int
    storage: bool
    prefetch_policy: str
    flush: bool
    latency: str
    delay: int  # virtual: max copy delay in steps; real: mean injected delay in ms
    chunk: int  # --chunked-prefill-size (-1: off)
    output_length: int  # 8, or 32 (admitted as if they might stop early): decode memory runs short, retractions
    fault: str  # "alloc-fail:R@N" or "damage-page:R@N" (file store only); "" for none
    pause: str  # "R@T+D": rank R is stopped T s after the start, for D s; "" for none
    depth: int  # --pp-async-batch-depth (0-2 at pp > 1): micro-batch slots beyond pp
    plugin: str  # a --sync-impl of the lab's own functions (PLUGINS), or soak --plugin's "--plugin SPEC"; "" for none
    interrupt: str  # "T": SIGINT to the run's process group T s after its ranks started; "" for none

    @property
    def ranks(self) -> int:
        return self.tp * self.cp * self.pp

    def args(self, mode: str) -> list[str]:
        """The `run` flags of this case: the small world (presets.WORLD) on 4 layers for 3 rounds."""
        args = [
            *WORLD.split(), "--num-layers", "4", "--num-rounds", "3",
            "--tp", str(self.tp), "--cp", str(self.cp), "--pp", str(self.pp), "--sync", mode,
            "--page-size", str(self.page_size), "--hicache-write-policy", self.write_policy,
            "--latency", self.latency, "--seed", str(self.seed), "--collective-timeout", "30",
        ]  # fmt: skip
        args += ["--pp-async-batch-depth", str(self.depth)] if self.depth else []
        args += self.plugin.split(" ", 1) if self.plugin.startswith("--plugin ") else []  # soak --plugin's
        args += ["--sync-impl", self.plugin] if self.plugin and not self.plugin.startswith("--") else []
        delay_flag = "--max-copy-delay-steps" if self.latency == "virtual" else "--injected-delay-ms"
        args += [delay_flag, str(self.delay)]
        args += ["--chunked-prefill-size", str(self.chunk), "--output-length", str(self.output_length)]
        args += ["--disable-ignore-eos"] if self.output_length > 8 else []  # long answers outgrow the estimate
        if self.fault:
            args += ["--fault", self.fault]
            if mode == "fixed" and self.fault.startswith("alloc-fail"):  # 0.5.23 has no answer to it: the proposals
                args += [f for name in PROPOSALS for f in ("--enable-fix", name)]
        if self.storage:
            args += ["--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", self.prefetch_policy]
            args += ["--storage-prefetch-threshold", "16"]
            if self.flush:
                args.append("--flush-cache-between-rounds")
        return args


def draw_case(seed: int, index: int, max_ranks: int) -> Case:
    """Case `index` of `seed`: the same on every invocation, whatever else runs."""
    rng = np.random.default_rng([seed, index])
    while True:
        tp, cp, pp = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 5))
        if tp * cp * pp <= max_ranks:
            break
    ranks, latency, storage = tp * cp * pp, str(rng.choice(["virtual", "real"])), bool(rng.random() < 0.4)
    fault = ""
    if rng.random() < 1 / 3:
        kind = "damage-page" if storage and rng.random() < 0.5 else "alloc-fail"
        fault = f"{kind}:{rng.integers(0, ranks)}@{rng.integers(0, 30)}"
    pause = f"{rng.integers(0, ranks)}@{rng.uniform(0.5, 4):.1f}+{rng.uniform(1, 4):.1f}" if rng.random() < 0.25 else ""
    case = Case(
        case=index,
        seed=int(rng.integers(0, 2**31)),
        tp=tp,
        cp=cp,
        pp=pp,
        write_policy=str(rng.choice(WRITE_POLICIES)),
        page_size=int(rng.choice([1, 2, 4])),
        storage=storage,
        prefetch_policy=str(rng.choice(PREFETCH_POLICIES)),
        flush=bool(rng.random() < 0.5),
        latency=latency,
        delay=int(rng.integers(1, 4)) if latency == "virtual" else int(rng.integers(0, 3)),
        chunk=int(rng.choice([-1, 16, 48, 4096])),
        output_length=int(rng.choice([8, 32])),
        fault=fault,
        pause=pause,
        depth=0,
        plugin="",
        interrupt="",
    )
    case.depth = int(rng.integers(0, 3)) if pp > 1 else 0  # drawn late: the earlier fields are as they were
    case.plugin = str(rng.choice(PLUGINS)) if rng.random() < 0.25 else ""
    case.interrupt = f"{rng.uniform(0.2, 2):.1f}" if rng.random() < 0.125 else ""
    return case


def _collect(futures: list, writer: csv.DictWriter, f) -> list[dict]:
    """Each run's row as it ends, appended to the CSV at once (a soak cut short keeps what it ran)."""
    rows = []
    for done, future in enumerate(futures, 1):
        rows.append(row := future.result())
        writer.writerow(row)
        f.flush()
        flags = [k for k in OUTCOMES if row[k]]
        world = f"tp{row['tp']} cp{row['cp']} pp{row['pp']}"
        print(f"[{done}/{len(futures)}] case {row['case']} {row['mode']:<6} {world} {','.join(flags) or 'ok'}")
    return rows


def _interrupted(signum, frame) -> None:
    raise Interrupted(signum)


def run_case(case: Case, mode: str, out_dir: Path, limit_s: float) -> dict:
    """One run in its own process group; killed as a whole past `limit_s`."""
    run_dir = out_dir / f"case{case.case:04d}_{mode}"
    command = [sys.executable, "-m", "hicache_lab", "run", *case.args(mode), "--out", str(run_dir)]
    started, paused = time.monotonic(), ""
    with open(out_dir / f"case{case.case:04d}_{mode}.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        LIVE.add(proc)
        done = threading.Event()
        with ThreadPoolExecutor(2) as signaller:
            pausing = signaller.submit(pause, proc, case, done) if case.pause else None
            interrupting = signaller.submit(interrupt, proc, case, done) if case.interrupt else None
            try:
                proc.wait(timeout=limit_s)
                hung = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it spawned
                proc.wait()
                hung = True
            done.set()
            LIVE.discard(proc)
            paused = pausing.result() if pausing else ""
            interrupted = interrupting.result() if interrupting else ""
    row = {**asdict(case), "ranks": case.ranks, "mode": mode, "elapsed_s": round(time.monotonic() - started, 1)}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() and not hung else None
    crashed = not hung and (summary is None or summary["crashed"])
    divergence = summary["first_divergence"] if summary else None
    row.update(
        hung=hung,
        crashed=crashed,
        diverged=bool(divergence),
        mismatched=bool(summary) and summary["outputs_match_reference"] is False,
        first_divergence=f"step {divergence['step']} {divergence['quantity']}" if divergence else "",
        fault_fired=any(f["fired"] for f in (summary or {}).get("faults", []) if f["asked"].startswith("--fault")),
        paused=paused,
        interrupted=interrupted,
        chunks=(summary or {}).get("scheduling", {}).get("chunked_prefills", 0),
        retractions=(summary or {}).get("scheduling", {}).get("retractions", 0),
        error=(summary or {}).get("error") or ("" if summary or hung else f"no summary (exit {proc.returncode})"),
    )
    return row


def add_soak_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=200, help="cases to run; each runs once per mode (default 200)")
    parser.add_argument("--first", type=int, default=0, help="index of the first case (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the case draw (default 0)")
    parser.add_argument("--jobs", type=int, default=1, help="worlds run at once (default 1)")
    parser.add_argument("--modes", nargs="+", default=["fixed", "legacy"], choices=SYNC_MODES)
    parser.add_argument("--max-ranks", type=int, default=8, help="largest world drawn, 1-16 (default 8)")
    parser.add_argument("--limit-s", type=finite_float, default=240, help="wall-clock limit of one run (default 240)")
    parser.add_argument("--out", default="runs/soak", help="run directories and logs (default runs/soak)")
    parser.add_argument(
        "--results",
        default="runs/soak",
        help=f"where the CSV and table go (default runs/soak; the committed ones: {BENCH_RESULTS})",
    )
    parser.add_argument("--plugin", default="", metavar="MODULE:OBJECT", help="bind this plug-in into every run")
    add_hostile_flags(parser)  # --hostile, --table


def check_soak_args(args: argparse.Namespace) -> None:
    """Every soak argument in range, before anything runs (a ConfigError naming the flag: exit 2)."""
    for flag, value, low in (("--runs", args.runs, 1), ("--first", args.first, 0), ("--jobs", args.jobs, 1)):
        if value < low:
            raise ConfigError(f"soak {flag} {value}: must be at least {low}")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"soak --seed {args.seed}: give a seed in 0..2**63-1")
    if not 1 <= args.max_ranks <= 16:
        raise ConfigError(f"soak --max-ranks {args.max_ranks}: worlds have 1 to 16 ranks (tp, cp <= 2, pp <= 4)")
    if args.limit_s < MIN_LIMIT_S:
        raise ConfigError(
            f"soak --limit-s {args.limit_s:g}: a run takes a few seconds to start its ranks alone, so a shorter "
            f"limit counts healthy runs as hangs; give at least {MIN_LIMIT_S}"
        )
    if args.plugin:  # one that cannot be loaded is refused before any run, not counted as 200 crashes
        answer_in_a_child(f"soak --plugin {args.plugin}", load_plugin, args.plugin)
    check_writable_dir(args.out, "soak --out")
    check_writable_dir(args.results, "soak --results")


def cmd_soak(args: argparse.Namespace) -> int:
    check_soak_args(args)
    if args.hostile:
        return cmd_hostile(args)
    out_dir, results = Path(args.out), Path(args.results)
    out_dir.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    plugin = f"_{Path(args.plugin.rpartition(':')[0]).stem}" if args.plugin else ""  # its own CSV
    csv_path = results / f"soak_seed{args.seed}_ranks{args.max_ranks}{plugin}.csv"
    columns = [f.name for f in fields(Case)] + ["ranks", "mode", "elapsed_s", *OUTCOMES]
    columns += ["first_divergence", "fault_fired", "paused", "interrupted", "chunks", "retractions", "error"]
    rows = read_rows(csv_path, columns)
    have = {(int(r["case"]), r["mode"]) for r in rows}
    cases = [draw_case(args.seed, i, args.max_ranks) for i in range(args.first, args.first + args.runs)]
    cases = [replace(c, plugin=f"--plugin {args.plugin}") for c in cases] if args.plugin else cases  # not drawn
    jobs = [(c, m) for m in args.modes for c in cases if (c.case, m) not in have]  # mode by mode
    print(f"{len(jobs)} runs to go ({len(cases) * len(args.modes) - len(jobs)} already in {csv_path})")
    with ThreadPoolExecutor(args.jobs) as pool, open(csv_path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if not rows:
            writer.writeheader()
        futures = [pool.submit(run_case, case, mode, out_dir, args.limit_s) for case, mode in jobs]
        stop = signal.signal(signal.SIGTERM, _interrupted)  # as Ctrl-C: the runs in flight end with the soak
        try:
            rows += _collect(futures, writer, f)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in list(LIVE):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            signal.signal(signal.SIGTERM, stop)
    modes = [m for m in SYNC_MODES if any(r["mode"] == m for r in rows)]

    invocation = f"`python -m hicache_lab soak --seed {args.seed} --max-ranks {args.max_ranks} ...`"
    print(write_table(csv_path.with_suffix(".md"), rows, modes, invocation))
    fixed = [r for r in rows if r["mode"] == "fixed"]
    return 1 if any(is_true(r[k]) for r in fixed for k in OUTCOMES) else 0
