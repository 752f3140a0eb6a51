"""The bug zoo's entries (zoo.py runs them): every known failure of this family as a small world in `run` flags,
the fixes whose absence shows it, the symptom its broken run must show, and, where the bug lives in SGLang's
releases, the last release that has it and the first that has its fix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...config import RunConfig
from ...distributed.parallel_state import stage_layers
from ...entrypoints.launch import run_world
from ...mem_cache.hicache_storage import storage_suffix
from ...parallel_config import PROPOSALS
from ..presets import WORLD, config
from .faults import FAULTS
from .zoo_symptoms import diverged, no_storage_hits, prefetches_revoked, relay_sends_only_grow

BASE_FLAGS = f"{WORLD} --collective-timeout 20"  # the small world (presets.py) every entry adds to
STORAGE_FLAGS = (
    "--hicache-storage-backend file --hicache-storage-prefetch-policy wait_complete --storage-prefetch-threshold 16"
)


def evict_half_of_the_last_stage(storage_dir: Path, flags: str) -> None:
    """Fill a store with one fixed run, then drop every other page of the last stage's shard, as an L3 that
    evicts keys independently would: stages then find different leading hits for the same prompt."""
    run_world(
        entry_config(f"{flags} --hicache-storage-dir {storage_dir}"), storage_dir.parent / "fill", False, (FAULTS,)
    )
    cfg = entry_config(flags)
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
    releases: tuple[str, str] | None = None  # the last SGLang release whose code has the bug, the first with its fix

    def run_flags(self, broken: bool) -> str:
        return f"{self.flags} {self.broken_flags}".strip() if broken else self.flags

    def switches(self, broken: bool) -> str:
        """The fix flags of a run: the broken one turns the entry's released fixes off; the fixed one turns on the
        entry's proposals (no release has them: `fixed` alone is 0.5.23, which fails here as SGLang does)."""
        if broken:
            return "".join(f" --disable-fix {name}" for name in self.fixes if name not in PROPOSALS)
        return "".join(f" --enable-fix {name}" for name in self.fixes if name in PROPOSALS)

    def command(self, broken: bool, switched: bool = True) -> str:
        """The `run` command of the broken or fixed run (`switched`: with its fix switches; a release has none)."""
        switches = self.switches(broken) if switched else ""
        return f"python -m hicache_lab run {BASE_FLAGS} {self.run_flags(broken)}{switches}"


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
            releases=("0.5.12", "0.5.13"),
        ),
        Entry(
            "load_acks",
            "load-back acks consumed as each rank sees them finish, not agreed",
            "loading_check before the fixes (no sync at all): the first link of #26921's chain",
            "--tp 2",
            ("agree_loads",),
            expect="on acks_load",
            releases=("0.5.12", "0.5.13"),
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
            releases=("0.5.14", "0.5.15"),
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


def entry_config(flags: str) -> RunConfig:
    """The RunConfig of an entry's run flags, on the zoo's small world."""
    return config(BASE_FLAGS, flags)
