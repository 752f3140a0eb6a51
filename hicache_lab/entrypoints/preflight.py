"""What the configuration alone cannot check, checked before any rank starts: the directories the run writes,
and whether the machine can hold the world it asks for. Each check raises a ConfigError that names the flag.
And the flags given that can do nothing in this configuration (`idle_flags`): warned of at the start and listed
in the summary, since a run that silently ignores a flag answers another question than the one asked."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import socket
import struct
import tempfile
from pathlib import Path

import torch

from ..args import FIELD_FLAGS
from ..config import LENGTHS, CacheConfig, RunConfig
from ..distributed.parallel_state import stage_layers
from ..errors import ConfigError
from ..mem_cache.memory_pool import PageAllocator, kv_bytes_per_token, torch_dtype
from ..mem_cache.mooncake_store import mooncake_missing
from ..mem_cache.staging_ring import ring_bytes
from ..model import TinyModel

RANK_PROCESS_BYTES = 300e6  # a rank's process before it allocates: Python, torch and the lab (measured)
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
MASTER_PROBE_S = 5.0  # how long a --mooncake-master may take to accept a connection


def check_listens(address: str) -> None:
    """Something accepts connections at `--mooncake-master` HOST:PORT (Mooncake's client would otherwise retry
    inside C++ for minutes, deaf to signals)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=MASTER_PROBE_S).close()
    except OSError as exc:
        raise ConfigError(
            f"--mooncake-master {address}: nothing accepts connections there ({exc.strerror or exc}): start "
            "mooncake_master at that address, or leave out --mooncake-master and --mooncake-metadata-url (the run "
            "then starts one)"
        ) from None


def preflight(cfg: RunConfig, out_dir: Path | None) -> None:
    """What the config alone cannot check, checked before any rank starts (ConfigError names the flag)."""
    c = cfg.cache
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this machine has no CUDA device: use --device cpu")
    if c.storage_backend == "mooncake" and (why := mooncake_missing()):
        raise ConfigError(f"--hicache-storage-backend mooncake: {why}; or use --hicache-storage-backend file")
    if c.storage_backend == "mooncake" and c.mooncake_master:
        check_listens(c.mooncake_master)
    check_gloo_interface(os.environ.get("GLOO_SOCKET_IFNAME", ""))
    if out_dir:
        check_writable_dir(out_dir, "--out")
    if c.storage_backend == "file" and c.storage_dir:
        try:
            check_writable_dir(c.storage_dir, "--hicache-storage-dir")
        except ConfigError:  # a pre-filled store shared read-only is read, never written (FileStorage.read_only)
            if not _holds_pages(Path(c.storage_dir)):
                raise
    check_memory(cfg)
    if c.enable_hierarchical_cache:
        check_host_pools(cfg)


def _holds_pages(directory: Path) -> bool:
    """Whether `directory` holds page files (False where it cannot be read, or its name is past the limits)."""
    try:
        return any(directory.glob("*.bin"))
    except OSError:
        return False


def check_memory(cfg: RunConfig) -> None:
    """The world fits this machine's memory (and GPU memory), roughly: else a ConfigError naming the flags that
    size its largest part."""
    p = cfg.parallel
    local = os.environ.get("LOCAL_WORLD_SIZE", "") if "TORCHELASTIC_RUN_ID" in os.environ else ""
    here = int(local) / p.world_size if local.isdigit() and 0 < int(local) < p.world_size else 1  # torchrun's share
    machine = {"memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    share = {"memory": here}  # of the world's need, what this machine (one GPU of it) holds
    if cfg.device == "cuda":  # pools, weights and activations there, on the GPU its rank shares; the rest in memory
        gpus, ranks = torch.cuda.device_count(), round(p.world_size * here)
        machine["GPU memory"] = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))
        share["GPU memory"] = -(-ranks // gpus) / p.world_size  # the busiest GPU's ranks (round-robin)
    for kind, have in machine.items():
        needed = sorted(
            (n * share[kind], what, flags)
            for what, (n, flags, on_device) in memory_needed(cfg).items()
            if kind == ("GPU memory" if on_device and cfg.device == "cuda" else "memory")
        )
        if (total := sum(n for n, _, _ in needed)) > have:
            n, what, flags = needed[-1]
            where = "this machine's" if kind == "memory" else "a GPU's (its ranks' share of the world)"
            raise ConfigError(
                f"this world would allocate about {total / 1e9:.3g} GB, more than {where} {have / 1e9:.3g} GB "
                f"of {kind}; the most, {n / 1e9:.3g} GB, for {what}: lower {flags}"
            )


def check_host_pools(cfg: RunConfig) -> None:
    """Every stage's host pool holds more than its device pool. Sized in bytes (`--hicache-size`, which the ratio
    then does not touch), a stage of more layers holds fewer tokens: the message names only the size."""
    m, c, p = cfg.model, cfg.cache, cfg.parallel
    for stage in range(p.pp):
        layers = len(stage_layers(m.num_layers, p.pp, stage, p.pp_layer_partition))
        per_token = kv_bytes_per_token(layers, m.num_heads // p.tp, m.head_dim, torch_dtype(m.dtype))
        tokens = int(c.hicache_size_gb * 1e9) // per_token // c.page_size * c.page_size
        if c.hicache_size_gb > 0 and tokens <= c.max_total_tokens:
            enough = (c.max_total_tokens + c.page_size) * per_token / 1e9
            ratio = c.hicache_ratio != CacheConfig().hicache_ratio
            beside = f" (--hicache-ratio {c.hicache_ratio:g} does nothing beside it)" if ratio else ""
            raise ConfigError(
                f"--hicache-size {c.hicache_size_gb:g} GB holds {tokens} tokens of stage {stage}'s KV ({per_token} "
                f"bytes each), no more than its device pool (--max-total-tokens {c.max_total_tokens}): raise "
                f"--hicache-size past {enough:.3g} GB{beside}, or lower --max-total-tokens"
            )
        c.host_tokens(per_token)  # sized by the ratio: its own check


def check_gloo_interface(names: str) -> None:
    """GLOO_SOCKET_IFNAME (comma-separated), where set, names network interfaces of this machine that have an
    address: gloo connects every rank's groups through them, a one-rank world's too."""
    if not names:
        return
    have = [name for _, name in socket.if_nameindex()]
    usable = [name for name in have if _has_address(name)]
    for name in names.split(","):
        if name not in usable:
            problem = "has no address" if name in have else "is not a network interface of this machine"
            raise ConfigError(
                f"GLOO_SOCKET_IFNAME={names}: {name!r} {problem}, and gloo connects the ranks through it: unset "
                f"GLOO_SOCKET_IFNAME, or name an interface with an address ({', '.join(usable) or 'none here'})"
            )


def _has_address(interface: str) -> bool:
    """Whether `interface` has an IPv4 address (SIOCGIFADDR) or an IPv6 one (/proc/net/if_inet6), as gloo needs."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        return True
    with contextlib.suppress(OSError):
        return any(line.split()[-1] == interface for line in Path("/proc/net/if_inet6").read_text().splitlines())
    return False


IDLE_UNLESS = (  # (fields, whether they can act, why they cannot: what follows "does nothing")
    (("cache.injected_delay_ms",), lambda c: c.cache.latency == "real", "without --latency real"),
    (("cache.max_copy_delay_steps",), lambda c: c.cache.latency == "virtual", "without --latency virtual"),
    (("cache.hicache_ratio", "cache.hicache_size_gb", "cache.write_policy", "cache.host_layout",
      "cache.load_back_threshold"), lambda c: c.cache.enable_hierarchical_cache, "without --enable-hierarchical-cache"),
    (("cache.hicache_ratio",), lambda c: c.cache.hicache_size_gb == 0,
     "beside --hicache-size, which sizes the host pool instead"),
    (("cache.storage_writers", "cache.prefetch_policy", "cache.prefetch_threshold", "cache.prefetch_timeout_steps",
      "cache.prefetch_timeout_base_s", "cache.prefetch_timeout_per_ki_token_s"),
     lambda c: c.cache.storage_backend != "none", "without --hicache-storage-backend"),
    (("cache.prefetch_timeout_steps", "cache.prefetch_timeout_base_s", "cache.prefetch_timeout_per_ki_token_s"),
     lambda c: c.cache.prefetch_policy == "timeout", "without --hicache-storage-prefetch-policy timeout"),
    (("cache.prefetch_timeout_steps",), lambda c: c.cache.latency == "virtual",
     "under --latency real, where the timeout policy waits seconds: --prefetch-timeout-base (+ per-ki-token)"),
    (("cache.prefetch_timeout_base_s", "cache.prefetch_timeout_per_ki_token_s"), lambda c: c.cache.latency == "real",
     "under --latency virtual, where the timeout policy counts steps: --storage-prefetch-timeout-steps"),
    (("cache.storage_writers",), lambda c: c.parallel.cp > 1,
     "without --cp 2 or more (at --cp 1 each rank writes its own keys either way)"),
    (("cache.storage_dir",), lambda c: c.cache.storage_backend == "file", "without --hicache-storage-backend file"),
    (("cache.mooncake_master", "cache.mooncake_metadata_url"), lambda c: c.cache.storage_backend == "mooncake",
     "without --hicache-storage-backend mooncake"),
    (("cache.dma_chunk_mib",), lambda c: uses_staging_ring(c),
     "without --device cuda, --enable-hierarchical-cache and --hicache-mem-layout page_first"),
    (("workload.trace_block_tokens",), lambda c: bool(c.workload.trace_file), "without --trace-file"),
    (tuple(f"workload.{n}_dist" for n in LENGTHS), lambda c: not c.workload.source, "beside a workload file"),
    (("workload.request_length", "workload.sub_question_input_length", "workload.output_length"),
     lambda c: not c.workload.requests_file, "beside --requests-file, which gives every request"),
    (("workload.request_length", "workload.sub_question_input_length"), lambda c: not c.workload.conversation_file,
     "beside --conversation-file, which gives every prompt"),
    (("parallel.pp_async_batch_depth",), lambda c: c.parallel.pp > 1, "without --pp 2 or more"),
    (("lab.dp_attention",), lambda c: c.lab.cache_impl != "lab",
     "with the lab's cache (it chooses the TP group SGLang's scheduler gives SGLang's cache: --cache-impl sglang*)"),
    (("parallel.sync", "parallel.enable_fixes", "parallel.disable_fixes", "parallel.consensus_check"),
     lambda c: c.parallel.world_size > 1, "without two ranks or more (one rank has no one to agree with)"),
    (("parallel.consensus_check",), lambda c: c.parallel.consensus_check <= (steps_bound(c) or math.inf),
     lambda c: f"past step 0 (where every rank agrees): unless it stalls, this run takes fewer than {steps_bound(c)} "
               "steps"),
)  # fmt: skip
FIX_NEEDS = {"pp_relay": 2, "multi_hop_relay": 3}  # --pp a fix needs to act (it relays down the pipeline)


def idle_flags(cfg: RunConfig) -> list[str]:
    """Each flag set away from its default that cannot act in `cfg`, with why, in words; each `--enable-fix` and
    `--disable-fix` is judged by the fix it names."""
    default, idle, said = RunConfig(), [], set()
    for fields, acts, why in IDLE_UNLESS:
        for field in fields:
            section, name = field.split(".")
            value = getattr(getattr(cfg, section), name)
            if value != getattr(getattr(default, section), name) and not acts(cfg) and field not in said:
                said.add(field)
                idle.append(f"{FIELD_FLAGS[field]} {_shown(value)} does nothing {why(cfg) if callable(why) else why}")
    p = cfg.parallel
    for verb, fixes in (("enable", p.enable_fixes), ("disable", p.disable_fixes)):
        for fix in fixes if f"parallel.{verb}_fixes" not in said else ():
            if p.pp < FIX_NEEDS.get(fix, 1) or (fix == "cp_groups" and p.cp < 2):
                needs = "--cp 2 or more" if fix == "cp_groups" else f"--pp {FIX_NEEDS[fix]} or more"
                idle.append(f"--{verb}-fix {fix} does nothing without {needs}")
    return idle


def _shown(value) -> str:
    """A flag's value as it would be typed: 0.5, not 0.50; a list as a,b."""
    return ",".join(value) if isinstance(value, tuple) else f"{value:g}" if isinstance(value, float) else str(value)


def steps_bound(cfg: RunConfig) -> int | None:
    """More steps than the run takes unless it stalls: every request alone, each of its prefill chunks and output
    tokens a turn of the whole pipeline, each copy at its longest delay and each prefetch at its timeout, doubled
    (runs of the zoo's world, with storage, 3 stages, TP x CP and chunked prefill, took a tenth of it or less).
    None where there is no such bound: real latency (idle steps count wall time), or answers that may stop early
    and be retracted (--disable-ignore-eos)."""
    c, w, p = cfg.cache, cfg.workload, cfg.parallel
    if c.latency != "virtual" or not w.ignore_eos:
        return None
    _, lengths, outputs = zip(*w.request_sizes(), strict=True)
    chunk = cfg.scheduler.chunk_size or max(lengths)
    waits = 2 * c.max_copy_delay_steps + c.prefetch_timeout_steps + p.micro_batches
    busy = sum((-(-n // chunk) + out) * p.micro_batches + waits for n, out in zip(lengths, outputs, strict=True))
    return 2 * (busy + w.num_rounds * waits)


def uses_staging_ring(cfg: RunConfig) -> bool:
    """Whether a rank's host pool may back up by DMA, staging through its ring on the GPU (staging_ring.py)."""
    c = cfg.cache
    return cfg.device == "cuda" and c.enable_hierarchical_cache and c.host_layout == "page_first"


def memory_needed(cfg: RunConfig) -> dict[str, tuple[float, str, bool]]:
    """What the whole world allocates, roughly: {what: (bytes, the flags that size it, on the device)}, summed
    from what each part says it holds where it can (the pools, their allocators, the model, the staging ring).
    Enough to refuse at start a world this machine cannot hold (entrypoints/launch.preflight); not a budget."""
    m, c, w, p = cfg.model, cfg.cache, cfg.workload, cfg.parallel
    ranks, stage = p.world_size, p.tp * p.cp  # ranks in all, ranks of one stage
    layers, heads = max(p.pp_layer_partition or [-(-m.num_layers // p.pp)]), m.num_heads // p.tp
    kv_only = kv_bytes_per_token(layers, heads, m.head_dim, torch_dtype(m.dtype))
    kv = kv_only + PageAllocator.BYTES_PER_PAGE / c.page_size  # per token
    staging = ring_bytes(c.dma_chunk_mib << 20, kv_only, c.max_total_tokens) if uses_staging_ring(cfg) else 0
    host = c.hicache_size_gb * 1e9 if c.hicache_size_gb > 0 else c.max_total_tokens * c.hicache_ratio * kv
    host = host if c.enable_hierarchical_cache else 0.0  # (inf x 0 would be nan, and nan fits anywhere)
    weights = ranks * TinyModel.weight_bytes(m, layers, p.tp)
    weights += stage * TinyModel.weight_bytes(m, m.num_layers) if cfg.check_outputs else 0  # the oracle's models
    v = m.vocab_size
    _, lengths, outputs = zip(*w.request_sizes(), strict=True)
    requests, longest, chunk = len(lengths), max(lengths), min(cfg.scheduler.chunk_size or max(lengths), max(lengths))
    token_bytes = 8 if v <= 256 else 36  # a list entry, and past the small-int cache an int object
    logits, tokens = stage * sum(outputs) * v * 4, stage * 2 * requests * longest * token_bytes
    host_flag = "--hicache-size" if c.hicache_size_gb > 0 else "--hicache-ratio (x --max-total-tokens) or --num-layers"
    requests_flag = f"the requests of {w.source}" if w.source else "--num-clients x --num-rounds"
    return {
        "device KV pools": (ranks * c.max_total_tokens * kv, "--max-total-tokens or --num-layers", True),
        "host KV pools": (ranks * host, host_flag, False),
        "DMA staging ring": (ranks * staging, "--hicache-dma-chunk-mib", True),
        "model weights": (weights, "--vocab-size, --hidden-size, --mlp-size, --num-layers", True),
        "logits of every output": (logits, f"--vocab-size, --output-length, {requests_flag}", False),
        "attention of one prefill": (ranks * 3 * heads * chunk * longest * 4, "--chunked-prefill-size", True),
        "the workload's tokens": (tokens, f"{requests_flag}, their lengths", False),
        "rank processes": ((ranks + (ranks > 1)) * RANK_PROCESS_BYTES, "--tp x --cp x --pp", False),
    }


def check_writable_dir(path: str | Path, flag: str) -> None:
    """`path` is a directory this process can create files in, or the nearest directory above it is (it will
    be created there). A ConfigError naming `flag` otherwise: a file, a read-only disk, another user's
    directory. A relative path starts at the working directory, which the message then names."""
    path = Path(path)
    whole = path.absolute()
    try:
        nearest = next(p for p in (whole, *whole.parents) if p.exists())
    except OSError as e:  # a name past the system's limits (ENAMETOOLONG)
        raise ConfigError(f"{flag} {str(path)[:80]}...: {e.strerror}: give a shorter path") from None
    where = "" if path.is_absolute() else f" (relative to the working directory {Path.cwd()})"
    elsewhere = "" if path.is_absolute() else ", or run from a writable working directory"
    if not nearest.is_dir():
        detail = "is a file: give a directory" if nearest == whole else f": {nearest} is a file, not a directory{where}"
        raise ConfigError(f"{flag} {path} {detail}" if nearest == whole else f"{flag} {path}{detail}")
    try:
        if os.statvfs(nearest).f_flag & os.ST_RDONLY:
            raise OSError(errno.EROFS, "it is on a read-only mount")
        if not os.access(nearest, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "this user may not")
        tempfile.TemporaryFile(dir=nearest).close()  # root passes os.access on a virtual file system
    except OSError as e:
        raise ConfigError(
            f"{flag} {path} is not writable{where}: cannot create a file in {nearest} ({e.strerror or e}); "
            f"give {flag} a directory you can write{elsewhere}"
        ) from e
