"""Class 10, values the preflight must refuse: every one exits 2 before any rank starts, naming the flag, the
variable or the file and line, and writes nothing. Each runs the CLI in this process (judge.run_in_process) but
one, in a process of its own, which pins the interpreter's exit status and the judge of processes left."""

from __future__ import annotations

from pathlib import Path

from .common import TRACE_LINE, lines, refusal
from .judge import Hostile, Outcome, run_in_process

STALE = "to run on its own, unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT; or start it under torchrun"
RUN_LOG = {"tag": "sglang", "summary": {"cache_hit_rate": 0.4}}  # a valid bench_multiturn line


def _trace(*rows: object) -> dict:
    """A `--trace-file t.jsonl` beside the run: a valid line, then `rows` (refusal's options)."""
    return {"files": {"t.jsonl": lines(TRACE_LINE, *rows)}}


def _log(*rows: object) -> dict:
    """A `--compare-sglang log.jsonl` beside the run holding `rows` (refusal's options)."""
    return {"files": {"log.jsonl": lines(*rows)}}


def _environ(**variables: str) -> dict:
    return {"env": variables}


# fmt: off
FAST = [  # (what the adversary does, `python -m hicache_lab` ARGS, what the lab says[, refusal's options])
    ("asks the soak for no runs (`soak --runs 0`)", "soak --runs 0", "--runs 0: must be at least 1"),
    ("`--hicache-ratio inf`", "run --enable-hierarchical-cache --hicache-ratio inf --out out",
     "argument --hicache-ratio: 'inf' is not a finite number"),
    ("`--collective-timeout nan` (nan passes every >= check)", "run --collective-timeout nan --out out",
     "argument --collective-timeout: 'nan' is not a finite number"),
    ("`--num-heads 0`", "run --num-heads 0 --out out", "--num-heads must be at least 1"),
    ("`--vocab-size 1`", "run --vocab-size 1 --out out", "--vocab-size must be at least 2"),
    ("`--max-total-tokens -5 --page-size 3`", "run --max-total-tokens -5 --page-size 3 --out out",
     "--max-total-tokens -5 must hold at least one page (--page-size 3)"),
    ("`--seed -1`", "run --seed -1 --out out", "--seed -1 must be in 0..2**63-1"),
    ("`--out` in a directory no one can create files in (/proc)", "run --out /proc/hicache-out",
     "--out /proc/hicache-out is not writable: cannot create a file in /proc"),
    ("the default `--out runs/latest` from a read-only working directory (/proc)", "run",
     "--out runs/latest is not writable (relative to the working directory /proc)", {"cwd": "/proc"}),
    ("stale `RANK=3 WORLD_SIZE=2` in the environment", "run --out out",
     f"RANK is not an integer in 0..1 (WORLD_SIZE 2) (RANK='3', WORLD_SIZE='2'): {STALE}",
     _environ(RANK="3", WORLD_SIZE="2") | {"in_process": False}),  # the one in a process of its own
    ("`torchrun --nproc-per-node 2 -m hicache_lab compare`: a command that launches its own worlds, in every rank",
     "compare --pp 2 --enable-hierarchical-cache --out out",
     "compare launches worlds of its own, and RANK/WORLD_SIZE say this process is one rank of another",
     _environ(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")),
    ("a `--hicache-storage-dir` whose name is past the system's limit (300 bytes)",
     f"run --enable-hierarchical-cache --hicache-storage-backend file --hicache-storage-dir {'x' * 300} --out out",
     f"--hicache-storage-dir {'x' * 80}...: File name too long: give a shorter path"),
    ("stale `WORLD_SIZE=2` alone in the environment", "run --out out",
     f"RANK is missing (WORLD_SIZE='2'): {STALE}", _environ(WORLD_SIZE="2")),
    ("a `--trace-file` line whose `hash_ids` hold `true` (a bool is no id)", "run --trace-file t.jsonl --out out",
     "--trace-file t.jsonl:2: 'hash_ids'[0] is True, not a non-negative integer",
     _trace({**TRACE_LINE, "hash_ids": [True]})),
    ("a `--trace-file` line whose `timestamp` is NaN", "run --trace-file t.jsonl --out out",
     "--trace-file t.jsonl:2: not JSON (NaN is not a number JSON allows)",
     _trace('{"timestamp": NaN, "input_length": 100, "hash_ids": [1]}')),
    ('a `--trace-file` line whose `output_length` is "5"', "run --trace-file t.jsonl --out out",
     "--trace-file t.jsonl:2: 'output_length' must be an integer of at least 1 (tokens), got '5'",
     _trace({**TRACE_LINE, "output_length": "5"})),
    ("a `--compare-sglang` log whose `cache_hit_rate` is 1.5", "run --compare-sglang log.jsonl --out out",
     "bench_multiturn log log.jsonl:2: 'summary': 'cache_hit_rate' must be a number in 0..1, got 1.5",
     _log(RUN_LOG, {"summary": {"cache_hit_rate": 1.5}})),
    ("a `--compare-sglang` log with a round named `round_x`", "run --compare-sglang log.jsonl --out out",
     "bench_multiturn log log.jsonl:1: 'round' key 'round_x' is not round_N",
     _log({**RUN_LOG, "round": {"round_x": {"cache_hit_rate": 0.5}}})),
    ('a `--compare-sglang` log whose round\'s `average_ttft` is "fast"', "run --compare-sglang log.jsonl --out out",
     "log.jsonl:1: 'round.round_0': 'average_ttft' must be a number of seconds >= 0, got 'fast'",
     _log({**RUN_LOG, "round": {"round_0": {"cache_hit_rate": 0.5, "average_ttft": "fast"}}})),
    ("`exhaustive --copies 0`", "exhaustive --copies 0",
     "--stages 2 --copies 0 --max-delay 2: give 2 or 3 stages, at least 1 copy"),
    ("`--tp 3` (the README's table)", "run --tp 3 --out out", "--num-heads 4 must be divisible by --tp 3"),
    ("`--out afile`, a regular file (the README's table)", "run --out afile",
     "--out afile is a file: give a directory", {"files": {"afile": ""}}),
    ("`--enable-fix pp_relay --disable-fix pp_relay`",
     "run --pp 2 --enable-fix pp_relay --disable-fix pp_relay --out out",
     "--enable-fix and --disable-fix pp_relay: both at once"),
    ("`--flush-cache-between-rounds --no-round-barrier` (no barrier to flush at)",
     "run --enable-hierarchical-cache --flush-cache-between-rounds --no-round-barrier --out out",
     "--flush-cache-between-rounds flushes at the barrier between rounds: drop --no-round-barrier"),
    ("`--chunked-prefill-size 3 --page-size 4`: a chunk shorter than a page", "run --page-size 4 "
     "--chunked-prefill-size 3 --out out", "--chunked-prefill-size 3 is smaller than a page (--page-size 4)"),
    ("`--out` whose name is 300 characters, past the file system's limit", f"run --out {'o' * 300}",
     "File name too long: give a shorter path"),
    ("`demo --num-rounds 1`: no round after the first to compare", "demo --num-rounds 1 --out out",
     "demo --num-rounds 1: the demo compares rounds after the first; give at least 2"),
    ("`GLOO_SOCKET_IFNAME` naming an interface this machine lacks", "run --out out",
     "GLOO_SOCKET_IFNAME=nonexistent0: 'nonexistent0' is not a network interface of this machine",
     _environ(GLOO_SOCKET_IFNAME="nonexistent0")),
    ("`--hicache-size 0.001 --hicache-ratio 5`: too small a size, beside a ratio that sizes nothing",
     "run --enable-hierarchical-cache --hicache-size 0.001 --hicache-ratio 5 --out out",
     "raise --hicache-size past 0.00944 GB (--hicache-ratio 5 does nothing beside it), or lower --max-total-tokens"),
    ("`--num-layers 10000000`: KV pools no machine holds", "run --num-layers 10000000 --out out",
     "for device KV pools: lower --max-total-tokens or --num-layers"),
    ("`student-edition` with no `git` on PATH", "student-edition out",
     "student-edition cuts the edition with git, and there is no git on PATH", _environ(PATH="/nonexistent")),
    ("`student-edition` of a checkout another user owns (git's GIT_TEST_ASSUME_DIFFERENT_OWNER)",
     "student-edition out", "(git said: \"fatal: detected dubious ownership in repository at",
     _environ(GIT_TEST_ASSUME_DIFFERENT_OWNER="1")),
    ("`student-edition` where no one can create files (/proc)", "student-edition /proc/hicache-edition",
     "student-edition /proc/hicache-edition is not writable: cannot create a file in /proc"),
    ("`--cache-impl sglang==0.5.99`, a release the lab has no adapter for", "run --cache-impl sglang==0.5.99 --out out",
     "--cache-impl sglang==0.5.99: choose lab, sglang (sglang 0.5.23), or sglang==X for a release the lab runs"),
    ("`--cache-impl sglang==0.5.12` where no release is installed",
     "run --pp 2 --enable-hierarchical-cache --cache-impl sglang==0.5.12 --out out",
     "sglang 0.5.12 is not installed in /nonexistent/sglang-0.5.12: make releases RELEASES=0.5.12 installs it",
     _environ(HICACHE_LAB_RELEASES="/nonexistent")),
    ("`releases --worlds pp9`, a world the matrix does not have", "releases --worlds pp9 --out out",
     "--worlds pp9: choose among pp2, pp3"),
]
SLOW = [  # only in soak --hostile: the rest of the README's table and more of each kind
    ("`--prefetch-timeout-base=-inf`", "run --prefetch-timeout-base=-inf --out out",
     "argument --prefetch-timeout-base: '-inf' is not a finite number"),
    ("`--hidden-size 0`", "run --hidden-size 0 --out out", "--hidden-size must be at least 1"),
    ("`--mlp-size 0`", "run --mlp-size 0 --out out", "--mlp-size must be at least 1"),
    ("`--load-back-threshold -1`", "run --load-back-threshold -1 --out out", "--load-back-threshold must be >= 0"),
    ("`--storage-prefetch-timeout-steps -1`", "run --storage-prefetch-timeout-steps -1 --out out",
     "--storage-prefetch-timeout-steps must be >= 0"),
    ("`--model-seed` past 2**64", f"run --model-seed {2**70} --out out", f"--model-seed {2**70} must be in 0..2**63-1"),
    ("`--mooncake-master nohost` (no port)",
     "run --enable-hierarchical-cache --hicache-storage-backend mooncake --mooncake-master nohost"
     " --mooncake-metadata-url http://127.0.0.1:8080/metadata --out out",
     "--mooncake-master 'nohost': write HOST:PORT"),
    ("`--hicache-storage-dir` where no one can create files (/sys)",
     "run --enable-hierarchical-cache --hicache-storage-backend file --hicache-storage-dir /sys/hicache-store"
     " --out out",
     "--hicache-storage-dir /sys/hicache-store is not writable: cannot create a file in /sys"),
    ("stale `RANK=0 WORLD_SIZE=2` without MASTER_ADDR", "run --out out",
     f"MASTER_ADDR is missing (RANK='0', WORLD_SIZE='2'): {STALE}", _environ(RANK="0", WORLD_SIZE="2")),
    ("`WORLD_SIZE=two` in the environment", "run --out out",
     f"WORLD_SIZE is not a positive integer (RANK='0', WORLD_SIZE='two'): {STALE}",
     _environ(RANK="0", WORLD_SIZE="two")),
    ("a `--trace-file` line that is not UTF-8", "run --trace-file t.jsonl --out out",
     "--trace-file t.jsonl:2: not UTF-8 text",
     {"files": {"t.jsonl": lines(TRACE_LINE).encode() + b'{"hash_ids": "\xff"}\n'}}),
    ("a `--trace-file` line nested 100,000 deep", "run --trace-file t.jsonl --out out",
     "--trace-file t.jsonl:1: nested too deeply to be a record",
     {"files": {"t.jsonl": "[" * 100_000 + "]" * 100_000 + "\n"}}),
    ("a `--trace-file` line whose `timestamp` is 1e999 (json reads inf)", "run --trace-file t.jsonl --out out",
     "--trace-file t.jsonl:2: not JSON (1e999 is beyond a double)",
     _trace('{"timestamp": 1e999, "input_length": 100, "hash_ids": [1]}')),
    ("a `--trace-file` line whose `input_length` is true", "run --trace-file t.jsonl --out out",
     "--trace-file t.jsonl:2: 'input_length' must be an integer in 1..512 (1 hash ids of 512 tokens), got True",
     _trace({**TRACE_LINE, "input_length": True})),
    ("a `--compare-sglang` log whose `request_count` is 2.5", "run --compare-sglang log.jsonl --out out",
     "'round.round_0': 'request_count' must be an integer >= 0, got 2.5",
     _log({**RUN_LOG, "round": {"round_0": {"cache_hit_rate": 0.5, "request_count": 2.5}}})),
    ("`exhaustive --max-delay -1`", "exhaustive --max-delay -1",
     "--stages 2 --copies 3 --max-delay -1: give 2 or 3 stages, at least 1 copy, a delay of at least 0 steps"),
    *((f"`{args}` (the README's table)", f"{args} --out out", says) for args, says in [
        ("run --sync maybe", "unknown --sync 'maybe': use one of off, legacy, fixed"),
        ("run --enable-fix nonsense", "argument --enable-fix: invalid choice: 'nonsense'"),
        ("run --page-size 5", "--max-total-tokens 4608 is not a multiple of --page-size 5: use 4605"),
        ("run --hicache-size -1", "--hicache-size must be >= 0 (GB; 0 means: use --hicache-ratio)"),
        ("run --pp 5", "--pp 5 needs at least as many layers (--num-layers 4)"),
        ("run --max-total-tokens 100", "--max-total-tokens 100 cannot hold one request of the workload"),
        ("run --fault explode:0@1", "--fault 'explode:0@1': write KIND:RANK@N"),
        ("run --pp 3 --pp-layer-partition 1,2", "needs one layer count per stage (--pp 3)"),
        ("run --sync-impl bogus", "--sync-impl 'bogus': write SLOT=MODULE:FUNCTION"),
        ("run --trace-file missing.jsonl", "--trace-file missing.jsonl: no such file"),
        ("run --hicache-storage-backend file", "needs the host tier: add --enable-hierarchical-cache"),
        ("run --device tpu", "unknown --device 'tpu': use one of cpu, cuda"),
    ]),
    ("`run --compare-sglang other.jsonl`, not a bench_multiturn log (the README's table)",
     "run --compare-sglang other.jsonl --out out", "bench_multiturn log other.jsonl:1: no 'summary.cache_hit_rate'",
     {"files": {"other.jsonl": lines({"summary": {}})}}),
    ("`exhaustive --stages 4` (the README's table)", "exhaustive --stages 4",
     "argument --stages: invalid choice: 4 (choose from 2, 3)"),
]
# fmt: on


def _dangling_link(scratch: Path) -> Outcome:
    (scratch / "out").symlink_to("nowhere")
    return run_in_process(scratch, "student-edition", "out")


CASES = [
    *(
        refusal(10, name, args.split(), says, slow=slow, **({"in_process": True} | (options[0] if options else {})))
        for table, slow in ((FAST, False), (SLOW, True))
        for name, args, says, *options in table
    ),
    Hostile(
        10,
        "`student-edition` into a link to nothing",
        _dangling_link,
        2,
        "out is a symbolic link to nowhere, which does not exist: remove the link, or give a new directory",
        in_process=True,
    ),
]
