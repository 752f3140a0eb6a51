"""Command line: `python -m hicache_lab run ...` (one configuration), `demo`, and the lab's tools (`figures`,
`soak`, `zoo`, `exhaustive`, `conform`, `compare`, `releases`, `exercise`, `student-edition`).

How it ends, whatever the command: 0 done; 1 failed, saying why in one line (a file that cannot be written, a
process limit such as `ulimit -n` reached); 2 refused at start (`configuration error: ...`); 128 + the signal
when interrupted (130 for Ctrl-C, also while it is still loading torch); 141 when its standard output is a pipe
whose reader has gone (`... | head -1`), as a Unix tool killed by SIGPIPE, silently: what the run wrote into
its directory is whole."""

# ruff: noqa: E402 - the handler of Ctrl-C is in place before the imports that load torch (seconds)
from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import resource
import select
import signal
import sys
import threading
from pathlib import Path


def _interrupted_while_loading(signum: int, frame) -> None:
    print(f"interrupted by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # nothing started yet: nothing to end


if (
    __name__ == "__main__"
    and threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not where Ctrl-C is ignored (a job)
):
    signal.signal(signal.SIGINT, _interrupted_while_loading)  # until main() starts

from .args import add_run_flags, config_from_args
from .entrypoints.ending import Interrupted
from .entrypoints.launch import exit_code, run_world
from .entrypoints.outdir import OutputError
from .entrypoints.report import divergence_words, mean_hit_rate, passed
from .entrypoints.torchrun import TORCHRUN_VARIABLES, run_under_torchrun, started_by_torchrun
from .errors import ConfigError
from .lab.binders import LAB
from .lab.check.compare_cli import add_compare_flags, cmd_compare
from .lab.check.exhaustive import add_exhaustive_flags, cmd_exhaustive
from .lab.check.soak import add_soak_flags, cmd_soak
from .lab.check.zoo import add_zoo_flags, cmd_zoo
from .lab.figures.against_sglang import compare_with_sglang
from .lab.figures.hit_rates import plot_hit_rates
from .lab.figures.pipeline import plot_queue_divergence
from .lab.figures.regenerate import add_figures_flags, cmd_figures
from .lab.figures.releases import add_releases_flags, cmd_releases
from .lab.sglang.bench_log import read_bench_multiturn
from .lab.sglang.conform_cli import add_conform_flags, cmd_conform
from .lab.teach.edition import add_edition_flags, cmd_edition
from .lab.teach.exercise_cli import add_exercise_flags, cmd_exercise


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    sglang = read_bench_multiturn(args.compare_sglang) if args.compare_sglang else None  # a bad log fails first
    if started_by_torchrun(os.environ):
        summary = run_under_torchrun(cfg, Path(args.out), args.binders)
        if summary is None:
            return 0
    else:
        summary = run_world(cfg, Path(args.out), binders=args.binders)
    print(f"wrote {args.out}/summary.json, requests.jsonl and trace_rank*.jsonl ({summary['elapsed_s']:.1f} s)")
    if sglang is not None:
        compare_with_sglang(summary, sglang, args.compare_sglang, Path(args.out) / "hit_rate_vs_sglang.png")
    return exit_code(None if summary["crashed"] else summary["interrupted"], passed(summary))


def _run_flags(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser)
    parser.add_argument("--out", default="runs/latest", help="output directory (default: runs/latest)")
    parser.add_argument(
        "--compare-sglang",
        metavar="LOG",
        help="SGLang bench_multiturn --log-file (JSONL): print and plot its per-round hit rates beside this run's",
    )


DEMO_RUNS = (  # (directory, label, hierarchical cache, sync)
    ("l1_only", "L1 only", False, "fixed"),
    ("legacy", "L1 + L2, legacy sync", True, "legacy"),
    ("fixed", "L1 + L2, fixed sync", True, "fixed"),
)


def cmd_demo(args: argparse.Namespace) -> int:
    """PP=2 on the default workload: L1 only, then L1 + L2 with legacy sync, then with fixed sync."""
    base, out = config_from_args(args), Path(args.out)
    rounds = base.workload.num_rounds
    if rounds < 2:
        raise ConfigError(f"demo --num-rounds {rounds}: the demo compares rounds after the first; give at least 2")
    first, last = (4, 7) if rounds >= 8 else (rounds // 2, rounds - 1)  # the seed's rounds 4-7, or the later half
    summaries = {}
    for name, label, hicache, sync in DEMO_RUNS:
        cfg = dataclasses.replace(
            base,
            cache=dataclasses.replace(base.cache, enable_hierarchical_cache=hicache),
            parallel=dataclasses.replace(base.parallel, sync=sync),
        )
        print(f"\n=== {label}  (--pp {cfg.parallel.pp} --sync {sync}) ===")
        summaries[name] = run_world(cfg, out / name, binders=args.binders)
    bound = mean_hit_rate(summaries["l1_only"]["rounds"], first, last, key="upper_bound_hit_rate")
    print(f"\nmean hit rate, rounds {first}-{last} (infinite cache: {bound:.1%}):")
    for name, label, _, _ in DEMO_RUNS:
        summary = summaries[name]
        verdict = divergence_words(summary) or "completed, ranks agree"
        if summary["crashed"]:
            verdict += f"; crashed on rank {summary['failing_rank']}: {summary['error']}"
        hit = "   n/a" if summary["crashed"] else f"{mean_hit_rate(summary['rounds'], first, last):6.1%}"
        print(f"  {label:<22} {hit}   {verdict}")
    figures = Path(args.figures) if args.figures else out / "figures"  # the committed figures/: `figures`
    pp = base.parallel.pp
    panels = {f"--pp {pp} --sync {name}": (out / name, summaries[name]) for name in ("legacy", "fixed")}
    plot_queue_divergence(panels, figures / "pp_queue_divergence.png")
    plot_hit_rates({label: summaries[name] for name, label, _, _ in DEMO_RUNS}, figures / "hit_rate_by_round.png")
    print(f"\nfigures: {figures}/pp_queue_divergence.png, {figures}/hit_rate_by_round.png")
    return 0 if summaries["fixed"]["completed"] and not summaries["fixed"]["diverged"] else 1


def _demo_flags(parser: argparse.ArgumentParser) -> None:
    add_run_flags(parser, pp=2)
    parser.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    parser.add_argument(
        "--figures", help="where its two figures go (default: OUT/figures; `figures` regenerates the committed ones)"
    )


# fmt: off
COMMANDS = (  # name, help, flags, handler: one configuration, the demo, then the lab's tools (hicache_lab/lab/)
    ("run", "run one configuration and write DIR/summary.json", _run_flags, cmd_run),
    ("demo", "PP=2: L1 only, then L1 + L2 with legacy and with fixed sync; two figures beside its runs",
     _demo_flags, cmd_demo),
    ("figures", "regenerate every figure in figures/ from live runs", add_figures_flags, cmd_figures),
    ("soak", "random small worlds in each sync mode, counted by outcome", add_soak_flags, cmd_soak),
    ("zoo", "the bug zoo: list the known failures, or reproduce one with its fix", add_zoo_flags, cmd_zoo),
    ("exhaustive", "every completion timing of a few host writes on 2-3 stages, in each sync mode",
     add_exhaustive_flags, cmd_exhaustive),
    ("conform", "replay a run's recorded cache operations through SGLang 0.5.23's cache and compare",
     add_conform_flags, cmd_conform),
    ("compare", "run one world with the lab's cache and with SGLang's own (0.5.23 or a release), and compare",
     add_compare_flags, cmd_compare),
    ("releases", "SGLang's releases, each as every rank's cache, over a set of worlds: a table and a figure",
     add_releases_flags, cmd_releases),
    ("exercise", "check your own pp_sync / writing_check / attn_groups on several worlds (notebook 06)",
     add_exercise_flags, cmd_exercise),
    ("student-edition", "copy the repository without teaching/ (the answers) for students", add_edition_flags,
     cmd_edition),
)
# fmt: on
UNDESCRIBED = ("run", "demo")  # --help: usage and flags; a lab tool's also says what it does (docstring, or help)
LAUNCH_WORLDS = ("demo", "figures", "soak", "zoo", "compare", "exercise", "releases")  # never one rank of torchrun's


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hicache_lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_flags, func in COMMANDS:
        described = None if name in UNDESCRIBED else func.__doc__ or help_text
        sub = commands.add_parser(name, help=help_text, description=described)
        add_flags(sub)
        sub.set_defaults(func=func, binders=LAB)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command `argv` asks for, run; its exit status (the module's docstring)."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_loading:  # loaded: Ctrl-C is the commands' to handle
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "out", None) is not None and not args.out.strip():
            raise ConfigError("--out '' names no directory (it would be the working directory): give one")
        if (name := args.command) in LAUNCH_WORLDS and ("RANK" in os.environ or "WORLD_SIZE" in os.environ):
            raise ConfigError(
                f"{name} launches worlds of its own, and RANK/WORLD_SIZE say this process is one rank of another "
                f"(torchrun): run `python -m hicache_lab {name}` alone (unset {' '.join(TORCHRUN_VARIABLES)}); "
                "under torchrun, `run` is the command"
            )
        return args.func(args)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    except OutputError as exc:  # a file of the run could not be written (a full disk)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (Interrupted, KeyboardInterrupt) as exc:  # before a world started, or after it ended
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(f"interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere
        return 128 + signal.SIGPIPE
    except OSError as exc:
        if exc.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        print(f"error: {_out_of_files(exc)}", file=sys.stderr)
        return 1


def _stdout_gone() -> bool:
    """Whether standard output is a pipe no one reads any more (its reader ended: `| head -1`)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # not a file (captured), or closed
        return False


def _out_of_files(exc: OSError) -> str:
    """What to do when this process (EMFILE) or the system (ENFILE) can open no more files."""
    if exc.errno == errno.ENFILE:
        return (
            f"the system's table of open files is full ({exc.strerror}, ENFILE): close what other programs hold "
            "open, or raise fs.file-max, and run again"
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    enough = 4096 if hard == resource.RLIM_INFINITY or hard >= 4096 else hard
    fix = f"raise it, e.g. ulimit -n {enough}, and run again"
    if enough <= soft:  # the hard limit is no higher
        fix = f"its hard limit is {hard} too: run again from a shell with a higher one (as root: ulimit -n 4096)"
    return (
        f"this process may open only {soft} files (ulimit -n {soft}), too few for the run's ranks and their "
        f"connections ({exc.strerror}, EMFILE): {fix}"
    )


if __name__ == "__main__":
    status = main()
    for late in (signal.SIGINT, signal.SIGTERM):  # the command has ended: one more Ctrl-C changes nothing
        signal.signal(late, signal.SIG_IGN)
    sys.exit(status)
