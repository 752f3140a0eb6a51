"""The `run` flags (SGLang's `server_args.py`): one table from flag to config field, defaults taken from the
config dataclasses.

`add_run_flags` puts them on a parser; `config_from_args` turns parsed flags into a validated `RunConfig`;
`sglang_flags` says which SGLang server flags a configuration corresponds to. The CLI, the bug zoo, the presets and
the benchmarks all read flags through here.
"""

from __future__ import annotations

import argparse
import math
import operator

from .config import (
    DTYPES,
    FAULT_KINDS,
    HOST_LAYOUTS,
    LATENCY_MODELS,
    PREFETCH_POLICIES,
    STORAGE_BACKENDS,
    SYNC_IMPL_SLOTS,
    WRITE_POLICIES,
    CacheConfig,
    LabConfig,
    ModelConfig,
    RunConfig,
    SchedulerConfig,
    WorkloadConfig,
)
from .parallel_config import PROPOSALS, SYNC_FIXES, SYNC_MODES, ParallelConfig
from .workload_files import DISTRIBUTIONS


def finite_float(text: str) -> float:
    """A float flag's value: a finite number (argparse's `float` takes inf and nan, and nan passes every check)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number: give one, e.g. 2.5") from None
    return value


def layer_counts(text: str) -> tuple[int, ...]:
    """`--pp-layer-partition 1,2` -> (1, 2)."""
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer counts, e.g. 1,2") from None


def _switch(help_text: str) -> dict:
    return {"action": "store_true", "help": help_text}


DIST_HELP = "constant (the length flag), or drawn from --seed, each draw at most MAX: " + ", ".join(
    f"{kind}:{first}:MAX" for kind, (first, _, _) in DISTRIBUTIONS.items()
)
# (flag, config section, field, type, help); defaults come from the dataclasses.
FLAGS = [
    ("--num-layers", "model", "num_layers", int, "transformer layers"),
    ("--hidden-size", "model", "hidden_size", int, "model width"),
    ("--num-heads", "model", "num_heads", int, "attention heads (also KV heads)"),
    ("--mlp-size", "model", "mlp_size", int, "MLP width"),
    ("--vocab-size", "model", "vocab_size", int, "vocabulary size"),
    ("--model-seed", "model", "seed", int, "seed of the model weights"),
    (
        "--dtype",
        "model",
        "dtype",
        str,
        f"number format of the weights, activations and KV pools: {', '.join(DTYPES)}. SGLang serves bfloat16: "
        "half the bytes of KV per token, so the pools take half the memory, --hicache-size holds twice the tokens "
        "and every copy moves half the bytes. Norms, RoPE, softmax and the logits stay float32; --check-outputs "
        "then allows a logit error of 0.25 (float32: 1e-3) and is refused at --tp above 1",
    ),
    (
        "--priced-as",
        "model",
        "priced_as",
        str,
        "the model whose cost the modelled latency (model_ttft, model_step) prices: run, this run's model; or "
        "bench, the 0.9B fp32 model of BENCHMARKS.md's GPU rows (16 layers, hidden 2048), its share of layers per "
        "stage, where a hit saves what recomputing it would cost a server (docs/latency.md)",
    ),
    ("--max-total-tokens", "cache", "max_total_tokens", int, "device (L1) KV pool size in tokens"),
    ("--page-size", "cache", "page_size", int, "tokens per page; cache keys and slots are page-aligned"),
    ("--hicache-ratio", "cache", "hicache_ratio", finite_float, "host pool size as a multiple of the device pool"),
    ("--hicache-size", "cache", "hicache_size_gb", finite_float, "host pool size in GB (overrides the ratio when > 0)"),
    ("--hicache-write-policy", "cache", "write_policy", str, f"one of {', '.join(WRITE_POLICIES)}"),
    ("--hicache-mem-layout", "cache", "host_layout", str, f"host pool layout: {', '.join(HOST_LAYOUTS)}"),
    ("--hicache-dma-chunk-mib", "cache", "dma_chunk_mib", int, "CUDA: a chunk of the DMA backups' staging ring (of 4)"),
    ("--load-back-threshold", "cache", "load_back_threshold", int, "smallest host hit (tokens) worth loading"),
    ("--latency", "cache", "latency", str, f"copy latency model: {', '.join(LATENCY_MODELS)}"),
    ("--max-copy-delay-steps", "cache", "max_copy_delay_steps", int, "virtual: copies finish 0..N steps late"),
    (
        "--injected-delay-ms",
        "cache",
        "injected_delay_ms",
        finite_float,
        "real: mean extra delay per copy (exponential)",
    ),
    ("--hicache-storage-backend", "cache", "storage_backend", str, f"L3 tier: {', '.join(STORAGE_BACKENDS)}"),
    (
        "--hicache-storage-writers",
        "cache",
        "storage_writers",
        str,
        "who writes L3 pages: every-rank (SGLang's MHA path: each rank its own copy, keyed by its global TP rank, so "
        "CP peers keep separate copies) or one (SGLang's rank-replicated path, is_storage_writer: CP rank 0 writes "
        "for its CP group, whose peers read its keys)",
    ),
    ("--hicache-storage-dir", "cache", "storage_dir", str, "file backend directory (empty: DIR/storage, cleared)"),
    ("--hicache-storage-prefetch-policy", "cache", "prefetch_policy", str, f"{', '.join(PREFETCH_POLICIES)}"),
    ("--mooncake-master", "cache", "mooncake_master", str, "HOST:PORT of a mooncake_master (empty: start one)"),
    ("--mooncake-metadata-url", "cache", "mooncake_metadata_url", str, "its HTTP metadata URL"),
    ("--storage-prefetch-threshold", "cache", "prefetch_threshold", int, "smallest storage hit (tokens) to fetch"),
    (
        "--storage-prefetch-timeout-steps",
        "cache",
        "prefetch_timeout_steps",
        int,
        "timeout policy, virtual latency: steps to wait",
    ),
    (
        "--prefetch-timeout-base",
        "cache",
        "prefetch_timeout_base_s",
        finite_float,
        "timeout policy, real latency: seconds to wait (SGLang's prefetch_timeout_base)",
    ),
    (
        "--prefetch-timeout-per-ki-token",
        "cache",
        "prefetch_timeout_per_ki_token_s",
        finite_float,
        "timeout policy, real latency: more seconds per 1,024 tokens asked",
    ),
    ("--num-clients", "workload", "num_clients", int, "concurrent conversations"),
    ("--num-rounds", "workload", "num_rounds", int, "turns per conversation"),
    ("--request-length", "workload", "request_length", int, "tokens of each conversation's first prompt"),
    ("--sub-question-input-length", "workload", "sub_question_input_length", int, "new tokens per later turn"),
    ("--output-length", "workload", "output_length", int, "tokens generated per turn"),
    ("--max-running-requests", "scheduler", "max_running_requests", int, "requests running at once"),
    (
        "--chunked-prefill-size",
        "scheduler",
        "chunked_prefill_size",
        int,
        "tokens of a prefill batch before the request crossing it runs in chunks (-1: never chunk)",
    ),
    ("--max-prefill-tokens", "scheduler", "max_prefill_tokens", int, "tokens of a prefill batch (without chunking)"),
    ("--seed", "workload", "seed", int, "seed of the workload and of the copy latencies"),
    ("--trace-file", "workload", "trace_file", str, "replay a Mooncake JSONL trace instead (see mooncake_trace.py)"),
    ("--trace-block-tokens", "workload", "trace_block_tokens", int, "lab tokens per trace hash id (Mooncake: 512)"),
    ("--request-length-dist", "workload", "request_length_dist", str, f"an opening's length (per client): {DIST_HELP}"),
    ("--sub-question-input-length-dist", "workload", "sub_question_input_length_dist", str, f"per turn: {DIST_HELP}"),
    ("--output-length-dist", "workload", "output_length_dist", str, f"an answer's length (per turn): {DIST_HELP}"),
    ("--conversation-file", "workload", "conversation_file", str, "play ShareGPT-style JSON conversations instead"),
    ("--requests-file", "workload", "requests_file", str, "replay a run's requests.jsonl instead"),
    ("--mooncake-slowdown-factor", "workload", "mooncake_slowdown_factor", finite_float, "x arrival times (0.5: 2x)"),
    ("--tp", "parallel", "tp", int, "attention tensor-parallel ranks (SGLang: --tp-size T*C)"),
    ("--cp", "parallel", "cp", int, "attention context-parallel ranks (SGLang: --attn-cp-size C)"),
    ("--pp", "parallel", "pp", int, "pipeline stages (SGLang: --pp-size)"),
    ("--sync", "parallel", "sync", str, f"cross-rank agreement: {', '.join(SYNC_MODES)}"),
    ("--pp-async-batch-depth", "parallel", "pp_async_batch_depth", int, "micro-batches beyond --pp (SGLang's)"),
    ("--consensus-check", "parallel", "consensus_check", int, "every K steps all ranks compare state (0: off)"),
    ("--collective-timeout", "parallel", "collective_timeout_s", finite_float, "seconds before a collective fails"),
]
SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "workload": WorkloadConfig,
    "parallel": ParallelConfig,
    "lab": LabConfig,
}
FAULT_HELP = "inject a fault: " + ", ".join(FAULT_KINDS.values())
IGNORE_EOS_HELP = (
    "admit as if answers might stop early (bench_serving's flag): a running request's remaining answer is "
    "reserved times new_token_ratio, not in full; answers still run to the end (retractions)"
)
DP_ATTENTION_HELP = (
    "with --cache-impl sglang*: SGLang's scheduler gives its cache the attention-TP group as the TP group, as under "
    "DP attention (which DSA's round-robin CP forces): 0.5.10 then leaves CP peers out"
)
# The other flags: (flag, RunConfig field, parsed value -> field value, argparse options).
SWITCHES = [
    ("--enable-hierarchical-cache", "cache.enable_hierarchical_cache", bool, _switch("add the host tier (L2)")),
    ("--no-round-barrier", "workload.round_barrier", operator.not_, _switch("let each client run ahead of others")),
    ("--use-trace-timestamps", "workload.use_trace_timestamps", bool, _switch("replay --trace-file at its times")),
    ("--disable-ignore-eos", "workload.ignore_eos", operator.not_, _switch(IGNORE_EOS_HELP)),
    ("--check-outputs", "check_outputs", bool, _switch("compare every output with a from-scratch run")),
    ("--device", "device", str, {"default": "cpu", "help": "cpu (gloo) or cuda (NCCL, CUDA streams) (default: cpu)"}),
    ("--enable-dp-attention", "lab.dp_attention", bool, _switch(DP_ATTENTION_HELP)),
    (
        "--record-cache-ops",
        "lab.record_cache_ops",
        bool,
        _switch("write every cache operation and its answer to DIR/rank{R}.cache_ops.jsonl, for `conform DIR`"),
    ),
    (
        "--cache-impl",
        "lab.cache_impl",
        str,
        {
            "default": "lab",
            "metavar": "{lab,sglang,sglang==X}",
            "help": "every rank's cache: the lab's; sglang 0.5.23's own (--sync legacy reverts its fixes); or "
            "release X's own, sglang==0.5.12 say (`make releases` installs them)",
        },
    ),
    ("--skip-load-wait", "lab.skip_load_wait", bool, _switch("fault: read loaded KV without waiting")),
    ("--fault", "lab.fault", str, {"default": "", "metavar": "KIND:RANK@N", "help": FAULT_HELP}),
    (
        "--copy-checksum",
        "cache.copy_checksum",
        bool,
        _switch("check every host copy against its source's sha256 (fails at once)"),
    ),
    (
        "--pp-layer-partition",
        "parallel.pp_layer_partition",
        tuple,
        {
            "type": layer_counts,
            "default": (),
            "metavar": "N,N,...",
            "help": "layers per stage (SGLang's SGLANG_PP_LAYER_PARTITION; default: even, the last stages take the "
            "rest, as SGLang's get_pp_indices)",
        },
    ),
    (
        "--flush-cache-between-rounds",
        "cache.flush_between_rounds",
        bool,
        _switch("drop device and host caches between rounds"),
    ),
    *(
        (
            f"--{verb}-fix",
            f"parallel.{verb}_fixes",
            tuple,
            {
                "action": "append",
                "default": [],
                "choices": SYNC_FIXES,
                "help": f"{verb} one sync fix on top of --sync (repeatable); see SYNC.md. Not in any release, so "
                "off in --sync fixed (SGLang 0.5.23) and only ever on by name: "
                + ", ".join(f"{name} ({pr.split(':')[0]})" for name, pr in PROPOSALS.items()),
            },
        )
        for verb in ("enable", "disable")
    ),
    (
        "--plugin",
        "lab.plugins",
        tuple,
        {
            "action": "append",
            "default": [],
            "metavar": "MODULE:OBJECT",
            "help": "bind your own protocol or policy, a Binder, into every rank (repeatable); MODULE: a module name "
            "or a .py file (see hicache_lab/lab/plugins.py and examples/)",
        },
    ),
    (
        "--sync-impl",
        "lab.sync_impls",
        tuple,
        {
            "action": "append",
            "default": [],
            "metavar": "SLOT=MODULE:FUNCTION",
            "help": f"use your own function in every rank (repeatable); SLOT: {', '.join(SYNC_IMPL_SLOTS)}; "
            "e.g. pp_sync=my_sync:pp_sync (see hicache_lab/lab/teach/sync_impl.py)",
        },
    ),
]
# Every RunConfig field a flag sets -> that flag (the messages that name a field name its flag).
FIELD_FLAGS = {f"{section}.{name}": flag for flag, section, name, _, _ in FLAGS} | {
    field: flag for flag, field, _, _ in SWITCHES
}


def add_run_flags(parser: argparse.ArgumentParser, **overrides) -> None:
    """Every run flag, defaults from the config dataclasses unless overridden (by field name)."""
    defaults = {name: cls() for name, cls in SECTIONS.items()}
    for flag, section, name, kind, help_text in FLAGS:
        default = overrides.get(name, getattr(defaults[section], name))
        parser.add_argument(flag, type=kind, default=default, help=f"{help_text} (default: {default})")
    for flag, _, _, options in SWITCHES:
        parser.add_argument(flag, **options)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The validated RunConfig the parsed flags ask for (a ConfigError names the flag of a bad value)."""
    values = {section: {} for section in SECTIONS} | {"run": {}}
    for flag, section, name, _, _ in FLAGS:
        values[section][name] = getattr(args, _dest(flag))
    for flag, field, to_field, _ in SWITCHES:
        section, _, name = field.rpartition(".")
        values[section or "run"][name] = to_field(getattr(args, _dest(flag)))
    run = values.pop("run")
    return RunConfig(**{name: SECTIONS[name](**v) for name, v in values.items()}, **run)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def sglang_flags(cfg: RunConfig) -> str:
    """The SGLang server flags this run corresponds to."""
    p, c = cfg.parallel, cfg.cache
    flags = [f"--tp-size {p.tp * p.cp}", f"--pp-size {p.pp}", f"--page-size {c.page_size}"]
    flags.append(f"--max-total-tokens {c.max_total_tokens}")
    if p.cp > 1:
        flags.append(f"--attn-cp-size {p.cp}")
    if c.enable_hierarchical_cache:
        flags.append("--enable-hierarchical-cache")
        size = f"--hicache-size {c.hicache_size_gb:g}" if c.hicache_size_gb else f"--hicache-ratio {c.hicache_ratio:g}"
        flags += [size, f"--hicache-write-policy {c.write_policy}", f"--hicache-mem-layout {c.host_layout}"]
    return " ".join(flags)
