"""The bug zoo: every known failure of this family, reproducible by name, next to its fix.

Each entry is a small world given as `run` flags. Its *broken* run is `--sync fixed` with the entry's fix(es)
switched off (`--disable-fix NAME`) and its `broken_flags` added, its *fixed* run the same flags with every
fix: same seed, same workload.
`symptom` (zoo_symptoms.py) reads a run's summary (and trace) and says what went wrong, or None; the broken run
must show it, the fixed run must not, must complete with identical decisions on every rank and exact outputs.

    python -m hicache_lab zoo                 # the table
    python -m hicache_lab zoo host_capacity   # run one pair and say what happened
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...config import RunConfig
from ...distributed.parallel_state import stage_layers
from ...entrypoints.launch import run
from ...errors import ConfigError
from ...mem_cache.hicache_storage import storage_suffix
from ...parallel_config import PROPOSALS
from ..presets import WORLD, config
from ..sglang.binder import SGLANG_CACHE, refusals
from .faults import FAULTS
from .zoo_symptoms import diverged, no_storage_hits, prefetches_revoked, relay_sends_only_grow

BASE_FLAGS = f"{WORLD} --collective-timeout 20"  # the small world (presets.py) every entry adds to
STORAGE_FLAGS = (
    "--hicache-storage-backend file --hicache-storage-prefetch-policy wait_complete --storage-prefetch-threshold 16"
)


def evict_half_of_the_last_stage(storage_dir: Path, flags: str) -> None:
    """Fill a store with one fixed run, then drop every other page of the last stage's shard, as an L3 that
    evicts keys independently would: stages then find different leading hits for the same prompt."""
    run(_config(f"{flags} --hicache-storage-dir {storage_dir}"), storage_dir.parent / "fill", False, (FAULTS,))
    cfg = _config(flags)
    m, p = cfg.model, cfg.parallel
    suffix = storage_suffix(m, 0, p.tp, range(m.num_heads // p.tp), stage_layers(m.num_layers, p.pp, p.pp - 1))
    for path in sorted(storage_dir.glob(f"*_{suffix}.bin"))[::2]:
        path.unlink()


@dataclass(frozen=True)
class Entry:
    name: str
    failure: str  # what goes wrong, in a line
    sglang: str  # where SGLang met it
    flags: str  # the world and anything beyond BASE_FLAGS
    fixes: tuple[str, ...]  # switched off in the broken run
    symptom: Callable[[dict, Path], str | None] = diverged
    expect: str = ""  # a phrase the broken run's symptom contains
    prepare: Callable[[Path, str], None] | None = None  # builds the store both runs start from (a copy each)
    broken_flags: str = ""  # what the broken run adds beyond its switched-off fixes (a setting, not a fix)

    def run_flags(self, broken: bool) -> str:
        return f"{self.flags} {self.broken_flags}".strip() if broken else self.flags

    def switches(self, broken: bool) -> str:
        """The fix flags of a run: the broken one turns the entry's released fixes off; the fixed one turns on the
        entry's proposals (no release has them: `fixed` alone is 0.5.23, which fails here as SGLang does)."""
        if broken:
            return "".join(f" --disable-fix {name}" for name in self.fixes if name not in PROPOSALS)
        return "".join(f" --enable-fix {name}" for name in self.fixes if name in PROPOSALS)

    def command(self, broken: bool) -> str:
        return f"python -m hicache_lab run {BASE_FLAGS} {self.run_flags(broken)}{self.switches(broken)}"


ENTRIES = {
    e.name: e
    for e in (
        Entry(
            "write_acks",
            "PP stages poll their own host-write events and consume different write acks",
            "#22607, #27285 (the seed's PP crash)",
            "--pp 2 --num-rounds 2",
            ("pp_relay",),
            expect="on acks_write",
        ),
        Entry(
            "load_acks",
            "load-back acks consumed as each rank sees them finish, not agreed",
            "loading_check before the fixes (no sync at all): the first link of #26921's chain",
            "--tp 2",
            ("agree_loads",),
            expect="on acks_load",
        ),
        Entry(
            "relay_two_stages_only",
            "ack counts taken on PP rank 0 but carried only to stage 1: stage 2 keeps its own polls",
            "#22878 (review: pp_rank == 0 alone breaks with more than 2 stages)",
            "--pp 3 --num-rounds 3",
            ("multi_hop_relay",),
            expect="on acks_write",
        ),
        Entry(
            "storage_hits_per_stage",
            "stages find different leading storage hits (an L3 that evicted one stage's pages) and agree on "
            "them only within the stage",
            "#25148, #27010 (PP + L3: hit counts agreed over the PP group too)",
            f"--pp 2 {STORAGE_FLAGS} --flush-cache-between-rounds --num-rounds 2",
            ("prefetch_groups",),
            expect="on extend_tokens",
            prepare=evict_half_of_the_last_stage,
        ),
        Entry(
            "host_capacity",
            "host pools sized in bytes: stages with fewer layers hold more tokens and evict from the host later",
            "#29258 (GLM-5.2 tp4 pp4: 8,023,168 vs 7,621,952 host tokens)",
            "--pp 2 --hicache-size 0.0004",
            ("host_capacity_min",),
            expect="is invalid for input of size",
        ),
        Entry(
            "early_return",
            "a rank with nothing in flight returns before the ack agreement (SGLang 0.5.10-0.5.13): harmless while "
            "ranks agree on what is in flight, a deadlock once a host write allocated on one rank only made that "
            "differ",
            "#26921, #28429 (writing_check TP deadlock, after hours), #28430; fixed by #27489",
            "--tp 2 --collective-timeout 5 --fault alloc-fail:1@15",
            ("always_agree", "alloc_agreement"),
            expect="in check_hicache_events > agree_ack_counts",
        ),
        Entry(
            "write_alloc",
            "a host write allocated on one rank only (its pool refused): every rank still enters the agreement, "
            "but the trees part, silently, until the ranks batch differently",
            "#28429 (agreeing on counts is necessary, not sufficient), the reserve/commit of #31425",
            "--tp 2 --fault alloc-fail:1@11",
            ("alloc_agreement",),
            expect="on digest",
        ),
        Entry(
            "load_alloc",
            "a load back allocated on one rank only: that rank recomputes what its peer loaded, and the two enter "
            "the model's TP collectives with different token counts",
            "#33442 (DeepSeek-V4-Flash TP2 all-reduce sizes one page apart)",
            "--tp 2 --fault alloc-fail:1@26",
            ("alloc_agreement",),
            expect="TP peers disagree on the batch",
        ),
        Entry(
            "pop_empty",
            "a host write that failed on stage 1 alone: PP rank 0 relays an ack count larger than stage 1's queue",
            "#29109 (pop from empty list)",
            "--pp 2 --fault alloc-fail:1@11",
            ("alloc_agreement",),
            expect="pop from empty list",
        ),
        Entry(
            "stage_damaged_page",
            "a page damaged in one stage's shard alone: the pages a prefetch read are agreed within each stage only, "
            "so the stages insert different prefixes and build different batches",
            "#27010 (PP + L3: prefetch progress agreed as acks on the storage sync groups, across stages)",
            f"--pp 2 {STORAGE_FLAGS} --flush-cache-between-rounds --num-rounds 2 --fault damage-page:1@3",
            ("prefetch_completion",),
            expect="on extend_tokens",
        ),
        Entry(
            "prefetch_early_return",
            "a rank without a request's prefetch returns before check_prefetch_progress's collective, where its "
            "peer waits alone (their prefetches differ after a host write that failed on one rank)",
            "#38273 / #38268 (gloo hang, TP=8, NIXL storage)",
            f"--tp 2 --collective-timeout 5 {STORAGE_FLAGS} --hicache-storage-prefetch-policy timeout "
            "--fault alloc-fail:1@4",
            ("prefetch_vote", "alloc_agreement"),
            expect="in check_prefetch_progress > prefetch_ready",
        ),
        Entry(
            "relay_send_growth",
            "relay send handles reaped by polling: gloo's is_completed() stays False until wait(), so none is "
            "ever freed and the list grows with every step",
            "#28902 (~12 GB/h on PP rank 0), fixed by #28916",
            "--pp 2 --num-rounds 3",
            ("bounded_drain",),
            symptom=relay_sends_only_grow,
            expect="never freed",
        ),
        Entry(
            "write_back_heads",
            "write_back writes to storage only what it evicts, leaves first: a conversation's head pages stay on the "
            "device and never reach storage, so after a flush every lookup misses its first page",
            "#26886 (file L3 written, never read under write_back; the answer there: write_through)",
            f"{STORAGE_FLAGS} --flush-cache-between-rounds",
            (),
            symptom=prefetches_revoked,
            expect="prefetches revoked though",
            broken_flags="--hicache-write-policy write_back",
        ),
        Entry(
            "cp_storage_keys",
            "one writer per CP group (replicated KV) and the CP rank in storage keys: CP rank 0 writes, its peers "
            "look under their own CP rank and find nothing, the MIN of hits is 0",
            "#20460 (the seed: Mooncake suffix); the same symptom by another route in #37149 (writer elected by "
            "the global TP rank while CP ranks hold different shards); #26670 puts the CP rank in file keys where "
            "CP ranks hold different bytes",
            f"--cp 2 {STORAGE_FLAGS} --hicache-storage-writers one --flush-cache-between-rounds --num-rounds 2",
            ("storage_keys",),
            symptom=no_storage_hits,
            expect="storage hit rate 0.0%",
        ),
        Entry(
            "cp_prefetch_termination",
            "CP peers agree alone how many pages a prefetch read (here a page damaged on CP rank 1 only): their "
            "prefixes part, one loads back what the other recomputes, and their batches differ",
            "#20460 (CP peers disagreed on prefetch completion and revocation)",
            f"--cp 2 --collective-timeout 5 {STORAGE_FLAGS} --flush-cache-between-rounds --num-rounds 2 "
            "--fault damage-page:1@3",
            ("prefetch_groups",),
            expect="CP peers disagree on the batch",
        ),
    )
}


def _config(flags: str) -> RunConfig:
    return config(BASE_FLAGS, flags)


@dataclass
class EntryRun:
    """One run of an entry, broken or fixed: its summary, the symptom it showed (None: none) and its directory."""

    summary: dict
    symptom: str | None
    out: Path = field(repr=False)


def not_on_sglang(entry: Entry) -> str | None:
    """Why an entry cannot run on SGLang's own cache (`--cache-impl sglang`: its broken run reverts the entry's
    fixes in SGLang's objects), or None."""
    if entry.prepare is not None:
        return "its store is prepared in the lab's key format"
    reasons = refusals(_config(f"{entry.run_flags(True)}{entry.switches(True)} --cache-impl sglang"))
    return "; ".join(reasons) or None


def reproduce(entry: Entry, out: Path, verbose: bool = False, cache_impl: str = "lab") -> tuple[EntryRun, EntryRun]:
    """The broken and the fixed run of an entry, on the lab's cache or SGLang's own: (broken, fixed)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    store = out / "store"
    if entry.prepare is not None:
        entry.prepare(store, entry.flags)
    runs = []
    for name in ("broken", "fixed"):
        flags = entry.run_flags(name == "broken") + entry.switches(name == "broken")
        if entry.prepare is not None:  # a copy each, beside the run's directory (which holds only what it wrote)
            shutil.copytree(store, out / f"{name}_store")
            flags += f" --hicache-storage-dir {out / f'{name}_store'}"
        summary = run(_config(f"{flags} --cache-impl {cache_impl}"), out / name, verbose, (FAULTS, SGLANG_CACHE))
        runs.append(EntryRun(summary, entry.symptom(summary, out / name), out / name))
    return runs[0], runs[1]


def consistent(entry_run: EntryRun) -> bool:
    s = entry_run.summary
    return s["completed"] and not s["diverged"] and s["outputs_match_reference"] is True and entry_run.symptom is None


def add_zoo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", choices=list(ENTRIES), help="reproduce one entry (default: list them)")
    parser.add_argument("--out", default="runs/zoo", help="run directories (default: runs/zoo/NAME)")
    parser.add_argument(
        "--cache-impl",
        choices=("lab", "sglang"),
        default="lab",
        help="sglang: both runs on SGLang 0.5.23's own cache, the broken one with the entry's fixes reverted in "
        "SGLang's objects (lab/sglang/reverts.py); the list says which entries can",
    )


def cmd_zoo(args: argparse.Namespace) -> int:
    sglang = args.cache_impl == "sglang"
    if args.name is None:
        for e in ENTRIES.values():
            fixes = ", ".join(e.fixes) or "-"
            print(f"{e.name:<24} fix {fixes:<18} {e.failure}\n{'':<24} SGLang {e.sglang}\n{'':<24} {e.command(True)}")
            if sglang:
                print(f"{'':<24} on SGLang's cache: {'not run: ' + why if (why := not_on_sglang(e)) else 'yes'}")
        return 0
    entry = ENTRIES[args.name]
    if sglang and (why := not_on_sglang(entry)):
        raise ConfigError(f"zoo {entry.name} --cache-impl sglang: {why}")
    print(f"{entry.name}: {entry.failure}\nSGLang: {entry.sglang}")
    broken, fixed = reproduce(entry, Path(args.out) / entry.name, cache_impl=args.cache_impl)
    impl = f" --cache-impl {args.cache_impl}" if sglang else ""
    print(f"\nbroken ({entry.command(True)}{impl}):\n  {broken.symptom or 'no symptom (unexpected)'}")
    verdict = "completed, every rank agrees, outputs exact" if consistent(fixed) else diverged(fixed.summary, fixed.out)
    print(f"fixed ({entry.command(False)}{impl}):\n  {verdict}")
    for name in (f for f in entry.fixes if f in PROPOSALS):
        print(f"  its fix {name} is in no release of SGLang ({PROPOSALS[name]}): 0.5.23 fails here as the broken run")
    return 0 if broken.symptom and consistent(fixed) else 1
