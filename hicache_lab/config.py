"""Run configuration: plain dataclasses validated on construction.

Every check raises `ConfigError` with a message that says which flag to change, so a bad run fails at
start instead of corrupting a pool later.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import require, require_choice, require_numbers, require_seed
from .mooncake_trace import trace_lengths
from .parallel_config import ParallelConfig
from .workload_files import LengthDist, parse_length_dist, read_conversations, read_recorded_requests

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HOST_LAYOUTS = ("layer_first", "page_first")
LATENCY_MODELS = ("virtual", "real")
STORAGE_BACKENDS = ("none", "file", "mooncake")
# Who writes a page to L3 (SGLang: MHA keys carry the global TP rank; rank-replicated KV elects one writer).
STORAGE_WRITERS = ("every-rank", "one")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")  # of the weights, activations and every KV pool (SGLang serves bf16)
PRICED_MODELS = ("run", "bench")  # what the modelled latency prices: the run's model, or BENCHMARKS.md's
DELAY_TIMEOUT_RATIO = 100  # --injected-delay-ms stays under this fraction of --collective-timeout
# A DMA staging chunk (mem_cache/staging_ring.py): K and V of several runs of 4 MiB or more, so that few runs are
# cut in two; each rank keeps 4 chunks per direction on the device (256 MiB in all).
DMA_CHUNK_MIB = 32
LENGTHS = ("request_length", "sub_question_input_length", "output_length")  # each with a distribution (`_dist`)


@dataclass(slots=True)
class ModelConfig:
    """A tiny transformer; the same seed gives the same weights on every process. `dtype` is that of the weights,
    activations and KV pools (the weights are drawn in fp32 and rounded, so a bf16 model is the fp32 one rounded)."""

    num_layers: int = 4
    hidden_size: int = 64
    num_heads: int = 4
    mlp_size: int = 128
    vocab_size: int = 256
    rope_theta: float = 10000.0
    logit_scale: float = 8.0  # widens the top-1 margin so cached and recomputed runs pick the same tokens
    seed: int = 0
    dtype: str = "float32"
    priced_as: str = "run"  # the model whose cost the modelled latency prices (latency_model.py)

    def __post_init__(self) -> None:
        require_numbers(self)
        require_choice(self.dtype, DTYPES, "--dtype")
        require_choice(self.priced_as, PRICED_MODELS, "--priced-as")
        for name in ("num_layers", "hidden_size", "num_heads", "mlp_size"):
            require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
        require(self.vocab_size >= 2, "--vocab-size must be at least 2 (greedy sampling needs a choice)")
        require(self.rope_theta > 0, "ModelConfig.rope_theta must be > 0")
        require(self.logit_scale > 0, "ModelConfig.logit_scale must be > 0")
        require_seed(self.seed, "--model-seed")
        require(
            self.hidden_size % self.num_heads == 0 and (self.hidden_size // self.num_heads) % 2 == 0,
            f"--hidden-size {self.hidden_size} must split into --num-heads {self.num_heads} heads of even size",
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(slots=True)
class CacheConfig:
    """The KV cache tiers. Sizes are in tokens; `hicache_size_gb` sizes the host pool in bytes instead."""

    max_total_tokens: int = 4608  # device (L1) pool size, SGLang's --max-total-tokens
    page_size: int = 1
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pool = ratio x device pool
    hicache_size_gb: float = 0.0  # when > 0, overrides the ratio
    write_policy: str = "write_through"
    host_layout: str = "page_first"  # SGLang's default
    load_back_threshold: int = 10
    latency: str = "virtual"
    max_copy_delay_steps: int = 3  # virtual latency: completion drawn from [0, this] steps after issue
    injected_delay_ms: float = 0.0  # real latency: mean of an extra per-copy delay, same distribution on all ranks
    copy_checksum: bool = False  # every host copy's destination is checked against its source's sha256 when consumed
    dma_chunk_mib: int = DMA_CHUNK_MIB  # CUDA, page_first: a chunk of the ring a backup by DMA stages through
    storage_backend: str = "none"  # L3
    storage_writers: str = "every-rank"  # every-rank: each rank its own copy; one: CP rank 0 writes for its CP group
    storage_dir: str = ""  # file backend directory; empty: DIR/storage of the run
    mooncake_master: str = ""  # HOST:PORT of a running mooncake_master; empty: the run starts one on 127.0.0.1
    mooncake_metadata_url: str = ""  # its HTTP metadata server, e.g. http://127.0.0.1:8080/metadata
    prefetch_policy: str = "timeout"  # SGLang's default
    prefetch_threshold: int = 64  # tokens: shorter storage hits are not worth a prefetch (SGLang: 256)
    prefetch_timeout_steps: int = 4  # `timeout` policy, virtual latency: stop waiting this many steps after issue
    prefetch_timeout_base_s: float = 1.0  # `timeout` policy, real latency: SGLang 0.5.23's prefetch_timeout_base
    prefetch_timeout_per_ki_token_s: float = (
        0.25  # ... plus this per 1,024 tokens asked (prefetch_timeout_per_ki_token)
    )
    prefetch_capacity_fraction: float = 0.5  # prefetches in flight ask for at most this share of the host pool
    flush_between_rounds: bool = False  # drop device and host caches between rounds: hits must come from L3

    def __post_init__(self) -> None:
        require_numbers(self)
        require(self.page_size >= 1, "--page-size must be at least 1")
        require(
            self.max_total_tokens >= self.page_size,
            f"--max-total-tokens {self.max_total_tokens} must hold at least one page (--page-size {self.page_size})",
        )
        require(
            self.max_total_tokens % self.page_size == 0,
            f"--max-total-tokens {self.max_total_tokens} is not a multiple of --page-size {self.page_size}: "
            f"use {self.max_total_tokens // self.page_size * self.page_size}",
        )
        require(self.hicache_ratio > 0, f"--hicache-ratio {self.hicache_ratio} must be > 0")
        require(self.load_back_threshold >= 0, "--load-back-threshold must be >= 0 (tokens)")
        require(self.prefetch_timeout_steps >= 0, "--storage-prefetch-timeout-steps must be >= 0")
        require_choice(self.write_policy, WRITE_POLICIES, "--hicache-write-policy")
        require_choice(self.host_layout, HOST_LAYOUTS, "--hicache-mem-layout")
        require_choice(self.latency, LATENCY_MODELS, "--latency")
        require(self.max_copy_delay_steps >= 0, "--max-copy-delay-steps must be >= 0")
        require(self.injected_delay_ms >= 0, "--injected-delay-ms must be >= 0")
        require(self.dma_chunk_mib >= 1, "--hicache-dma-chunk-mib must be at least 1 (MiB)")
        require(self.hicache_size_gb >= 0, "--hicache-size must be >= 0 (GB; 0 means: use --hicache-ratio)")
        require_choice(self.storage_backend, STORAGE_BACKENDS, "--hicache-storage-backend")
        require_choice(self.storage_writers, STORAGE_WRITERS, "--hicache-storage-writers")
        require_choice(self.prefetch_policy, PREFETCH_POLICIES, "--hicache-storage-prefetch-policy")
        require(
            self.storage_backend == "none" or self.enable_hierarchical_cache,
            "--hicache-storage-backend needs the host tier: add --enable-hierarchical-cache",
        )
        require(self.prefetch_threshold >= self.page_size, "--storage-prefetch-threshold must be at least a page")
        require(
            self.prefetch_timeout_base_s >= 0 and self.prefetch_timeout_per_ki_token_s >= 0,
            "--prefetch-timeout-base and --prefetch-timeout-per-ki-token must be >= 0 seconds",
        )
        require(
            0 < self.prefetch_capacity_fraction <= 1,
            f"CacheConfig.prefetch_capacity_fraction {self.prefetch_capacity_fraction} must be in (0, 1] "
            "(the share of the host pool that prefetches in flight may ask for)",
        )
        require(
            bool(self.mooncake_master) == bool(self.mooncake_metadata_url),
            "give --mooncake-master and --mooncake-metadata-url together (or neither, to start a master)",
        )
        host, _, port = self.mooncake_master.rpartition(":")
        require(
            not self.mooncake_master or (bool(host) and port.isdigit() and 1 <= int(port) <= 65535),
            f"--mooncake-master {self.mooncake_master!r}: write HOST:PORT, e.g. 127.0.0.1:50051",
        )
        if self.enable_hierarchical_cache and self.hicache_size_gb == 0:
            require(
                self.hicache_ratio > 1,
                f"--hicache-ratio {self.hicache_ratio} gives a host pool no larger than the device pool: "
                "use a ratio > 1 (SGLang's default is 2)",
            )

    def host_tokens(self, bytes_per_token: int) -> int:
        """Host pool size in tokens (page-aligned down); validated against the device pool."""
        if self.hicache_size_gb > 0:
            tokens = int(self.hicache_size_gb * 1e9) // bytes_per_token
        else:
            tokens = int(self.max_total_tokens * self.hicache_ratio)
        tokens = tokens // self.page_size * self.page_size
        require(
            tokens > self.max_total_tokens,
            f"host pool ({tokens} tokens) is not larger than the device pool ({self.max_total_tokens} tokens): "
            "raise --hicache-size or --hicache-ratio, or lower --max-total-tokens",
        )
        return tokens


@dataclass(slots=True)
class SchedulerConfig:
    """What one rank's scheduler admits at once (SGLang's scheduler flags)."""

    max_running_requests: int = 16  # requests past admission at once
    chunked_prefill_size: int = 4096  # SGLang's default where it knows no GPU memory; -1: no chunked prefill
    max_prefill_tokens: int = 16384  # SGLang's default

    def __post_init__(self) -> None:
        require_numbers(self)
        for name in ("max_running_requests", "max_prefill_tokens"):
            require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
        require(
            self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
            f"--chunked-prefill-size {self.chunked_prefill_size}: give a token count, or -1 to turn chunking off",
        )

    @property
    def chunk_size(self) -> int | None:
        """`--chunked-prefill-size` as the scheduler takes it: None for no chunking."""
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size


@dataclass(slots=True)
class WorkloadConfig:
    """Multi-turn conversations shaped like SGLang's bench_multiturn."""

    num_clients: int = 16
    num_rounds: int = 8
    request_length: int = 256
    sub_question_input_length: int = 32
    output_length: int = 16
    round_barrier: bool = True
    ignore_eos: bool = True  # answers run to --output-length and admission knows it (bench_multiturn's ignore_eos)
    seed: int = 0
    trace_file: str = ""  # a Mooncake JSONL trace to replay instead of the conversations (mooncake_trace.py)
    trace_block_tokens: int = 16  # lab tokens per trace hash id (Mooncake's blocks are 512 tokens)
    use_trace_timestamps: bool = False  # arrivals at the trace's own times on the modelled clock (bench_serving's)
    mooncake_slowdown_factor: float = 1.0  # x the trace's times: 0.5 replays it at twice its rate (bench_serving's)
    request_length_dist: str = "constant"  # or a distribution, e.g. uniform:64:256 (workload_files.py)
    sub_question_input_length_dist: str = "constant"
    output_length_dist: str = "constant"
    conversation_file: str = ""  # ShareGPT-style JSON conversations instead (workload_files.py)
    requests_file: str = ""  # a run's requests.jsonl, replayed (workload_files.py)

    def __post_init__(self) -> None:
        require_numbers(self)
        require_seed(self.seed, "--seed")
        for name in ("num_clients", "num_rounds", "request_length", "output_length"):
            require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")
        require(self.sub_question_input_length >= 1, "--sub-question-input-length must be at least 1")
        require(self.trace_block_tokens >= 1, "--trace-block-tokens must be at least 1")
        require(self.mooncake_slowdown_factor > 0, "--mooncake-slowdown-factor must be > 0 (0.5: twice the rate)")
        require(
            self.trace_file or not self.use_trace_timestamps,
            "--use-trace-timestamps replays a trace at its own arrival times: give it --trace-file FILE",
        )
        require(
            self.use_trace_timestamps or self.mooncake_slowdown_factor == 1,
            "--mooncake-slowdown-factor scales the arrival times that only --use-trace-timestamps follows: add it",
        )
        self.lengths()  # each distribution's grammar
        require(" and " not in self.source, f"{self.source}: give one workload file")
        if self.trace_file:
            windows, requests = self.trace_windows(), len(self._trace_lengths())
            require(requests >= windows, f"--trace-file holds {requests} requests, fewer than --num-rounds {windows}")
        held = len(read_conversations(self.conversation_file)) if self.conversation_file else self.num_clients
        require(
            held >= self.num_clients,
            f"{self.source} holds {held} conversations, fewer than --num-clients {self.num_clients}: give "
            f"--num-clients {held} or fewer",
        )
        last = max(r.round for r in read_recorded_requests(self.requests_file)) if self.requests_file else -1
        require(
            not self.round_barrier or last < self.num_rounds,
            f"{self.source} holds round {last}: give --num-rounds {last + 1} (or --no-round-barrier)",
        )

    @property
    def source(self) -> str:
        """The workload's file, as its flag and path (`--trace-file FILE`, ...); empty for the synthetic one."""
        files = ("trace_file", "conversation_file", "requests_file")
        return " and ".join(
            f"--{name.replace('_', '-')} {getattr(self, name)}" for name in files if getattr(self, name)
        )

    def trace_windows(self) -> int:
        """Windows of equal count a trace splits into: rounds with the barrier or timed replay; else one."""
        return self.num_rounds if self.round_barrier or self.use_trace_timestamps else 1

    def _trace_lengths(self) -> tuple[tuple[int, int], ...]:
        """(line, tokens of KV) of every request of the trace."""
        return trace_lengths(self.trace_file, self.trace_block_tokens, self.output_length)

    def lengths(self) -> tuple[LengthDist, LengthDist, LengthDist]:
        """The synthetic conversations' distributions of opening, sub-question and answer lengths."""
        return tuple(
            parse_length_dist(getattr(self, f"{n}_dist"), f"--{n.replace('_', '-')}-dist", getattr(self, n))
            for n in LENGTHS
        )

    def request_sizes(self) -> list[tuple[str, int, int]]:
        """(where in `source`: line or record, tokens of KV, answer tokens) of every request, at most, known before
        a token is drawn."""
        if self.trace_file:
            return [(f":{n}", tokens, self.output_length) for n, tokens in self._trace_lengths()]
        if self.conversation_file:
            played = enumerate(read_conversations(self.conversation_file)[: self.num_clients])
            return [(f" [{i}]", *size) for i, c in played for size in c.sizes(self.num_rounds, self.output_length)]
        if self.requests_file:
            recorded = read_recorded_requests(self.requests_file)
            return [(f":{r.number}", len(r.prompt) + r.max_new_tokens, r.max_new_tokens) for r in recorded]
        opening, question, answer = (d.most for d in self.lengths())
        longest = opening + (self.num_rounds - 1) * (answer + question) + answer
        return [("", longest, answer)] * (self.num_clients * self.num_rounds)

    def longest_sequence(self) -> int:
        """Tokens of KV held by the longest request: with conversations, the last round's prompt plus output."""
        return max(tokens for _, tokens, _ in self.request_sizes())


# The words of the lab's fields, which their binders parse and check before any rank starts.
# `--fault KIND:RANK@N`: what each kind does (lab/check/faults.py binds them; the `--fault` help is made of these).
FAULT_KINDS = {
    "kill-rank": "kill-rank:R@N (rank R dies at step N)",
    "slow-rank": "slow-rank:R@MS (rank R sleeps MS ms as each iteration begins: a slower stage)",
    "tear-copy": "tear-copy:R@N (rank R's Nth host write, from 0, leaves out its first layer)",
    "misplace-copy": "misplace-copy:R@N (rank R's Nth host write lands every token one slot over)",
    "alloc-fail": (
        "alloc-fail:R@N (rank R's Nth slot allocation for a copy fails, as a full pool would: a write to the host, "
        "a load back, a prefetch's host slots)"
    ),
    "damage-page": "damage-page:R@N (the Nth page rank R reads from the file store is damaged on disk first: a miss)",
}
# What `--sync-impl SLOT=MODULE:FUNCTION` may replace with your own function (lab/teach/sync_impl.py binds it).
SYNC_IMPL_SLOTS = ("pp_sync", "writing_check", "attn_groups")


@dataclass(slots=True)
class LabConfig:
    """What only lab tooling serves: the core never reads this section. Each field is served by a binder
    (entrypoints/binders.py), which checks its grammar before any rank starts; a field set with no binder to
    serve it is refused (`refuse_unserved`). `flag` in each field's metadata is its command-line spelling."""

    cache_impl: str = field(default="lab", metadata={"flag": "--cache-impl"})  # lab, sglang, or sglang==X
    sync_impls: tuple[str, ...] = field(default=(), metadata={"flag": "--sync-impl"})  # SLOT=MODULE:FUNCTION
    fault: str = field(default="", metadata={"flag": "--fault"})  # KIND:RANK@N (lab/check/faults.py)
    skip_load_wait: bool = field(default=False, metadata={"flag": "--skip-load-wait"})
    record_cache_ops: bool = field(default=False, metadata={"flag": "--record-cache-ops"})  # for `conform`
    dp_attention: bool = field(default=False, metadata={"flag": "--enable-dp-attention"})  # SGLang's cache only
    plugins: tuple[str, ...] = field(default=(), metadata={"flag": "--plugin"})  # MODULE:OBJECT (lab/plugins.py)


@dataclass(slots=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lab: LabConfig = field(default_factory=LabConfig)
    device: str = "cpu"
    check_outputs: bool = False

    def __post_init__(self) -> None:
        require_choice(self.device, DEVICES, "--device")
        self._check_fits()

    def with_lab(self, **changes) -> RunConfig:
        """This configuration with these `LabConfig` fields changed, e.g. `cfg.with_lab(cache_impl="sglang")`."""
        return replace(self, lab=replace(self.lab, **changes))

    def _check_fits(self) -> None:
        """The sections against each other: the workload fits the pools, the layers the stages, and so on."""
        w = self.workload
        where, longest, _ = max(w.request_sizes(), key=lambda size: size[1])  # named before a rank draws a token
        m = self.cache.max_total_tokens
        says = f"--max-total-tokens {m} cannot hold one request of the workload ({longest} tokens plus a page)"
        if w.source:
            says = f"{w.source}{where}: its request holds {longest} tokens of KV (prompt and output), more than "
            says += f"--max-total-tokens {m} holds with a page to spare"
        shorten = "--trace-block-tokens" if w.trace_file else "--num-rounds" if w.conversation_file else ""
        fix = f", or lower {shorten}" if shorten else "" if w.requests_file else ", or shorten the conversation"
        require(m > longest + self.cache.page_size, f"{says}: raise it{fix}")
        if w.requests_file:
            high = max(read_recorded_requests(w.requests_file), key=lambda r: max(r.prompt))
            require(
                max(high.prompt) < self.model.vocab_size,
                f"{w.source}:{high.number}: token {max(high.prompt)} is past --vocab-size {self.model.vocab_size}: "
                "replay with the --vocab-size of the run that wrote it",
            )
        require(
            self.model.num_layers >= self.parallel.pp,
            f"--pp {self.parallel.pp} needs at least as many layers (--num-layers {self.model.num_layers})",
        )
        partition = self.parallel.pp_layer_partition
        require(
            not partition or sum(partition) == self.model.num_layers,
            f"--pp-layer-partition {','.join(map(str, partition))} must add up to --num-layers {self.model.num_layers}",
        )
        chunk = self.scheduler.chunked_prefill_size
        require(
            chunk == -1 or chunk >= self.cache.page_size,
            f"--chunked-prefill-size {chunk} is smaller than a page (--page-size "
            f"{self.cache.page_size}): a chunk ends at a page boundary, so it must hold a page; raise it, or -1",
        )
        require(
            (w.round_barrier and not w.use_trace_timestamps) or not self.cache.flush_between_rounds,
            "--flush-cache-between-rounds flushes at the barrier between rounds: drop --no-round-barrier (or "
            "--use-trace-timestamps, whose arrivals have no barrier), or the flush",
        )
        most_ms = self.parallel.collective_timeout_s * 1e3 / DELAY_TIMEOUT_RATIO
        require(
            self.cache.injected_delay_ms <= most_ms,
            f"--injected-delay-ms {self.cache.injected_delay_ms:g} is the mean delay of every copy, and a rank waiting "
            f"on a queue of them sits outside the collectives its peers wait in: keep it under 1/{DELAY_TIMEOUT_RATIO} "
            f"of --collective-timeout ({most_ms:g} ms for {self.parallel.collective_timeout_s:g} s), or raise that",
        )
        require(
            self.model.num_heads % self.parallel.tp == 0,
            f"--num-heads {self.model.num_heads} must be divisible by --tp {self.parallel.tp}",
        )
        require(
            not (self.check_outputs and self.model.dtype == "bfloat16" and self.parallel.tp > 1),
            f"--check-outputs compares with an unsharded reference, and in bfloat16 the partial sums of --tp "
            f"{self.parallel.tp} shards alone move logits past its tolerance (0.34 measured at --tp 2, and a token "
            "changed): check outputs with --dtype float32, or without --tp",
        )
