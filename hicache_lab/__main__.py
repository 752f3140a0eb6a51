"""Command line: `python -m hicache_lab run ...` (one configuration) and `python -m hicache_lab demo`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from .config import (
    HOST_LAYOUTS,
    LATENCY_MODELS,
    PREFETCH_POLICIES,
    STORAGE_BACKENDS,
    SYNC_FIXES,
    SYNC_IMPL_SLOTS,
    SYNC_MODES,
    WRITE_POLICIES,
    CacheConfig,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    WorkloadConfig,
)
from .exhaustive import add_exhaustive_flags, cmd_exhaustive
from .figures import add_figures_flags, cmd_figures
from .launch import run, run_under_torchrun
from .plots import plot_against_sglang, plot_hit_rates, plot_queue_divergence
from .report import mean_hit_rate
from .soak import add_soak_flags, cmd_soak
from .traces import read_bench_multiturn
from .zoo import add_zoo_flags, cmd_zoo

# (flag, config section, field, type, help); defaults come from the dataclasses.
FLAGS = [
    ("--num-layers", "model", "num_layers", int, "transformer layers"),
    ("--hidden-size", "model", "hidden_size", int, "model width"),
    ("--num-heads", "model", "num_heads", int, "attention heads (also KV heads)"),
    ("--mlp-size", "model", "mlp_size", int, "MLP width"),
    ("--vocab-size", "model", "vocab_size", int, "vocabulary size"),
    ("--model-seed", "model", "seed", int, "seed of the model weights"),
    ("--max-total-tokens", "cache", "max_total_tokens", int, "device (L1) KV pool size in tokens"),
    ("--page-size", "cache", "page_size", int, "tokens per page; cache keys and slots are page-aligned"),
    ("--hicache-ratio", "cache", "hicache_ratio", float, "host pool size as a multiple of the device pool"),
    (
        "--hicache-size",
        "cache",
        "hicache_size_gb",
        float,
        "host pool size in GB (overrides the ratio when > 0)",
    ),
    ("--hicache-write-policy", "cache", "write_policy", str, f"one of {', '.join(WRITE_POLICIES)}"),
    ("--hicache-mem-layout", "cache", "host_layout", str, f"host pool layout: {', '.join(HOST_LAYOUTS)}"),
    (
        "--load-back-threshold",
        "cache",
        "load_back_threshold",
        int,
        "smallest host hit (tokens) worth loading",
    ),
    ("--latency", "cache", "latency", str, f"copy latency model: {', '.join(LATENCY_MODELS)}"),
    (
        "--max-copy-delay-steps",
        "cache",
        "max_copy_delay_steps",
        int,
        "virtual: copies finish 0..N steps late",
    ),
    (
        "--injected-delay-ms",
        "cache",
        "injected_delay_ms",
        float,
        "real: mean extra delay per copy (exponential)",
    ),
    ("--hicache-storage-backend", "cache", "storage_backend", str, f"L3 tier: {', '.join(STORAGE_BACKENDS)}"),
    ("--hicache-storage-dir", "cache", "storage_dir", str, "file backend directory (empty: DIR/storage, cleared)"),
    ("--hicache-storage-prefetch-policy", "cache", "prefetch_policy", str, f"{', '.join(PREFETCH_POLICIES)}"),
    ("--mooncake-master", "cache", "mooncake_master", str, "HOST:PORT of a mooncake_master (empty: start one)"),
    ("--mooncake-metadata-url", "cache", "mooncake_metadata_url", str, "its HTTP metadata URL"),
    ("--storage-prefetch-threshold", "cache", "prefetch_threshold", int, "smallest storage hit (tokens) to fetch"),
    ("--storage-prefetch-timeout-steps", "cache", "prefetch_timeout_steps", int, "timeout policy: steps to wait"),
    ("--num-clients", "workload", "num_clients", int, "concurrent conversations"),
    ("--num-rounds", "workload", "num_rounds", int, "turns per conversation"),
    ("--request-length", "workload", "request_length", int, "tokens of each conversation's first prompt"),
    (
        "--sub-question-input-length",
        "workload",
        "sub_question_input_length",
        int,
        "new tokens per later turn",
    ),
    ("--output-length", "workload", "output_length", int, "tokens generated per turn"),
    ("--max-running-requests", "workload", "max_running_requests", int, "admission limit of a batch"),
    ("--seed", "workload", "seed", int, "seed of the workload and of the copy latencies"),
    ("--trace-file", "workload", "trace_file", str, "replay a Mooncake JSONL trace instead (see traces.py)"),
    ("--trace-block-tokens", "workload", "trace_block_tokens", int, "lab tokens per trace hash id (Mooncake: 512)"),
    ("--tp", "parallel", "tp", int, "attention tensor-parallel ranks (SGLang: --tp-size T*C)"),
    ("--cp", "parallel", "cp", int, "attention context-parallel ranks (SGLang: --attn-cp-size C)"),
    ("--pp", "parallel", "pp", int, "pipeline stages (SGLang: --pp-size)"),
    ("--sync", "parallel", "sync", str, f"cross-rank agreement: {', '.join(SYNC_MODES)}"),
    ("--consensus-check", "parallel", "consensus_check", int, "every K steps all ranks compare state (0: off)"),
    ("--device", "parallel", "device", str, "cpu (gloo) or cuda (NCCL, CUDA streams)"),
    ("--collective-timeout", "parallel", "collective_timeout_s", float, "seconds before a collective fails"),
]
SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "workload": WorkloadConfig,
    "parallel": ParallelConfig,
}


def add_run_flags(parser: argparse.ArgumentParser, **overrides) -> None:
    """Every run flag, defaults from the config dataclasses unless overridden (by field name)."""
    defaults = {name: cls() for name, cls in SECTIONS.items()}
    for flag, section, name, kind, help_text in FLAGS:
        default = overrides.get(name, getattr(defaults[section], name))
        parser.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {default})")
    parser.add_argument("--enable-hierarchical-cache", action="store_true", help="add the host tier (L2)")
    parser.add_argument("--no-round-barrier", action="store_true", help="let each client run ahead of others")
    parser.add_argument("--check-outputs", action="store_true", help="compare every output with a from-scratch run")
    parser.add_argument("--skip-load-wait", action="store_true", help="fault: read loaded KV without waiting")
    parser.add_argument(
        "--fault",
        default="",
        metavar="KIND:RANK@N",
        help="inject a fault: kill-rank:R@N (rank R dies at step N), tear-copy:R@N or misplace-copy:R@N (rank R's "
        "Nth host write is torn or lands in the wrong slots)",
    )
    parser.add_argument(
        "--copy-checksum", action="store_true", help="check every host copy against its source's sha256 (fails at once)"
    )
    parser.add_argument(
        "--pp-layer-partition",
        type=layer_counts,
        default=(),
        metavar="N,N,...",
        help="layers per stage (SGLang's SGLANG_PP_LAYER_PARTITION; default: even, earlier stages take the rest)",
    )
    parser.add_argument(
        "--flush-cache-between-rounds", action="store_true", help="drop device and host caches between rounds"
    )
    for verb in ("enable", "disable"):
        parser.add_argument(
            f"--{verb}-fix",
            action="append",
            default=[],
            choices=SYNC_FIXES,
            help=f"{verb} one sync fix on top of --sync (repeatable); see SYNC.md",
        )
    parser.add_argument(
        "--sync-impl",
        action="append",
        default=[],
        metavar="SLOT=MODULE:FUNCTION",
        help=f"use your own function in every rank (repeatable); SLOT: {', '.join(SYNC_IMPL_SLOTS)}; "
        "e.g. pp_sync=my_sync:pp_sync (see hicache_lab/sync_impl.py)",
    )


def layer_counts(text: str) -> tuple[int, ...]:
    """`--pp-layer-partition 1,2` -> (1, 2)."""
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer counts, e.g. 1,2") from None


def config_from_args(args: argparse.Namespace) -> RunConfig:
    values = {section: {} for section in SECTIONS}
    for flag, section, name, _, _ in FLAGS:
        values[section][name] = getattr(args, flag.lstrip("-").replace("-", "_"))
    values["cache"]["enable_hierarchical_cache"] = args.enable_hierarchical_cache
    values["cache"]["skip_load_wait"] = args.skip_load_wait
    values["cache"]["copy_checksum"] = args.copy_checksum
    values["parallel"]["fault"] = args.fault
    values["parallel"]["pp_layer_partition"] = args.pp_layer_partition
    values["cache"]["flush_between_rounds"] = args.flush_cache_between_rounds
    values["workload"]["round_barrier"] = not args.no_round_barrier
    values["parallel"]["enable_fixes"] = tuple(args.enable_fix)
    values["parallel"]["disable_fixes"] = tuple(args.disable_fix)
    values["parallel"]["sync_impls"] = tuple(args.sync_impl)
    sections = {name: SECTIONS[name](**v) for name, v in values.items()}
    return RunConfig(**sections, check_outputs=args.check_outputs)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    sglang = read_bench_multiturn(args.compare_sglang) if args.compare_sglang else None  # a bad log fails first
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:  # started by torchrun
        summary = run_under_torchrun(cfg, Path(args.out))
        if summary is None:
            return 0
    else:
        summary = run(cfg, Path(args.out))
    print(f"wrote {args.out}/summary.json, requests.jsonl and trace_rank*.jsonl ({summary['elapsed_s']:.1f} s)")
    if sglang is not None:
        compare_with_sglang(summary, sglang, args.compare_sglang, Path(args.out) / "hit_rate_vs_sglang.png")
    return 0 if summary["completed"] and summary["outputs_match_reference"] is not False else 1


def compare_with_sglang(summary: dict, sglang: list[dict], log: str, figure: Path) -> None:
    """Print this run's hit rate per round beside a bench_multiturn log's rows, and plot them."""
    print(f"\nhit rate per round: this run vs {log}")
    tags = list(dict.fromkeys(r["tag"] for r in sglang))
    print("round    lab  " + "  ".join(f"{t[:14]:>14}" for t in tags))
    for row in summary["rounds"]:
        theirs = {r["tag"]: r["hit_rate"] for r in sglang if r["round"] == row["round"]}
        cells = "  ".join(f"{theirs[t]:14.1%}" if t in theirs else f"{'-':>14}" for t in tags)
        print(f"{row['round']:5} {row['hit_rate']:6.1%}  {cells}")
    plot_against_sglang(summary, sglang, figure)
    print(f"figure: {figure}")


DEMO_RUNS = (  # (directory, label, hierarchical cache, sync)
    ("l1_only", "L1 only", False, "fixed"),
    ("legacy", "L1 + L2, legacy sync", True, "legacy"),
    ("fixed", "L1 + L2, fixed sync", True, "fixed"),
)


def cmd_demo(args: argparse.Namespace) -> int:
    """PP=2 on the default workload: L1 only, then L1 + L2 with legacy sync, then with fixed sync."""
    base, out = config_from_args(args), Path(args.out)
    summaries = {}
    for name, label, hicache, sync in DEMO_RUNS:
        cfg = dataclasses.replace(
            base,
            cache=dataclasses.replace(base.cache, enable_hierarchical_cache=hicache),
            parallel=dataclasses.replace(base.parallel, sync=sync),
        )
        print(f"\n=== {label}  (--pp {cfg.parallel.pp} --sync {sync}) ===")
        summaries[name] = run(cfg, out / name)
    bound = mean_hit_rate(summaries["l1_only"]["rounds"], 4, 7, key="upper_bound_hit_rate")
    print(f"\nmean hit rate, rounds 4-7 (infinite cache: {bound:.1%}):")
    for name, label, _, _ in DEMO_RUNS:
        summary = summaries[name]
        verdict = "completed, ranks agree" if not summary["diverged"] else ""
        if summary["diverged"]:
            d = summary["first_divergence"]
            verdict = f"ranks diverged at step {d['step']} on {d['quantity']} {d['values']}"
        if summary["crashed"]:
            verdict += f"; crashed on rank {summary['failing_rank']}: {summary['error']}"
        hit = "   n/a" if summary["crashed"] else f"{mean_hit_rate(summary['rounds'], 4, 7):6.1%}"
        print(f"  {label:<22} {hit}   {verdict}")
    figures = Path(args.figures)
    pp = base.parallel.pp
    panels = {f"--pp {pp} --sync {name}": (out / name, summaries[name]) for name in ("legacy", "fixed")}
    plot_queue_divergence(panels, figures / "pp_queue_divergence.png")
    plot_hit_rates({label: summaries[name] for name, label, _, _ in DEMO_RUNS}, figures / "hit_rate_by_round.png")
    print(f"\nfigures: {figures}/pp_queue_divergence.png, {figures}/hit_rate_by_round.png")
    return 0 if summaries["fixed"]["completed"] and not summaries["fixed"]["diverged"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hicache_lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run one configuration and write DIR/summary.json")
    demo_parser = commands.add_parser(
        "demo", help="PP=2: L1 only, then L1 + L2 with legacy and with fixed sync; writes the figures"
    )
    for p, default_out, overrides in ((run_parser, "runs/latest", {}), (demo_parser, "runs/demo", {"pp": 2})):
        add_run_flags(p, **overrides)
        p.add_argument("--out", default=default_out, help=f"output directory (default: {default_out})")
    run_parser.add_argument(
        "--compare-sglang",
        metavar="LOG",
        help="SGLang bench_multiturn --log-file (JSONL): print and plot its per-round hit rates beside this run's",
    )
    run_parser.set_defaults(func=cmd_run)
    demo_parser.add_argument("--figures", default="figures", help="where the figures go (default: figures)")
    demo_parser.set_defaults(func=cmd_demo)
    figures_parser = commands.add_parser("figures", help="regenerate every figure in figures/ from live runs")
    add_figures_flags(figures_parser)
    figures_parser.set_defaults(func=cmd_figures)
    soak_parser = commands.add_parser("soak", help="random small worlds in each sync mode, counted by outcome")
    add_soak_flags(soak_parser)
    soak_parser.set_defaults(func=cmd_soak)
    zoo_parser = commands.add_parser("zoo", help="the bug zoo: list the known failures, or reproduce one with its fix")
    add_zoo_flags(zoo_parser)
    zoo_parser.set_defaults(func=cmd_zoo)
    exhaustive_parser = commands.add_parser(
        "exhaustive", help="every completion timing of a few host writes on 2-3 stages, in each sync mode"
    )
    add_exhaustive_flags(exhaustive_parser)
    exhaustive_parser.set_defaults(func=cmd_exhaustive)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
