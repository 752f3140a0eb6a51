"""The world's layout and how its ranks agree: `ParallelConfig`, validated on construction (a `ConfigError`
names the flag to change), and its lists of choices (sync modes and fixes)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import require, require_choice, require_numbers

SYNC_MODES = ("off", "legacy", "fixed")
# Every fix `legacy` lacks; each can be switched alone (cache_sync.py says what each does).
SYNC_FIXES = (
    "pp_relay",
    "cp_groups",
    "agree_loads",
    "host_capacity_min",
    "bounded_drain",
    "prefetch_groups",
    "storage_keys",
    "multi_hop_relay",
    "always_agree",
    "alloc_agreement",
    "prefetch_vote",
    "prefetch_completion",
)
# Fixes no release contains: proposals, each opt-in by name (`--enable-fix NAME`), with its PR. `fixed` is
# released SGLang 0.5.23: every other fix, and none of these.
PROPOSALS = {
    "alloc_agreement": "#31425, open: every rank allocates a copy's slots or none (reserve/commit)",
    "prefetch_vote": "#38273, closed without merging: a rank without a request's prefetch votes anyway",
}
# Fixes `legacy` keeps (none: the code it stands for, SGLang 0.5.10 with DP attention, has none of them).
LEGACY_FIXES: tuple[str, ...] = ()
MAX_COLLECTIVE_TIMEOUT_S = 86_400  # a bound, not a wish: no rank waits longer than this for a peer
MAX_ASYNC_BATCH_DEPTH = 64  # micro-batch slots beyond --pp; each one costs every stage a loop turn per step


@dataclass(slots=True)
class ParallelConfig:
    """World layout: tp x cp x pp ranks (lab --tp T --cp C = SGLang --tp-size T*C --attn-cp-size C)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    sync: str = "fixed"
    collective_timeout_s: float = 60.0
    consensus_check: int = 0  # every K steps, all ranks check they agree (0: never); fails fast on the first gap
    enable_fixes: tuple[str, ...] = ()  # added to what --sync implies
    disable_fixes: tuple[str, ...] = ()  # removed from what --sync implies
    pp_layer_partition: tuple[int, ...] = ()  # layers per stage (SGLang's SGLANG_PP_LAYER_PARTITION); () = even
    pp_async_batch_depth: int = 0  # micro-batch slots beyond pp (SGLang's --pp-async-batch-depth)

    def __post_init__(self) -> None:
        require_numbers(self)
        for name in ("tp", "cp", "pp"):
            require(getattr(self, name) >= 1, f"--{name} must be at least 1")
        require_choice(self.sync, SYNC_MODES, "--sync")
        require(self.collective_timeout_s > 0, "--collective-timeout must be > 0 seconds")
        require(
            self.collective_timeout_s <= MAX_COLLECTIVE_TIMEOUT_S,
            f"--collective-timeout {self.collective_timeout_s:g} s: a stuck collective would hang that long; "
            f"give at most {MAX_COLLECTIVE_TIMEOUT_S} s (a day)",
        )
        require(self.consensus_check >= 0, "--consensus-check must be >= 0 (0 turns it off)")
        require(self.pp_async_batch_depth >= 0, "--pp-async-batch-depth must be >= 0")
        require(
            self.pp_async_batch_depth <= MAX_ASYNC_BATCH_DEPTH,
            f"--pp-async-batch-depth {self.pp_async_batch_depth}: every slot is one more turn of each stage's event "
            f"loop per step; give at most {MAX_ASYNC_BATCH_DEPTH} (SGLang's default is 0)",
        )
        for name in (*self.enable_fixes, *self.disable_fixes):
            require_choice(name, SYNC_FIXES, "fix")
        require(self.sync != "off" or not self.enable_fixes, "--sync off agrees on nothing: drop --enable-fix")
        both = sorted(set(self.enable_fixes) & set(self.disable_fixes))
        require(not both, f"--enable-fix and --disable-fix {', '.join(both)}: both at once; keep the one you mean")
        require(
            not self.pp_layer_partition or len(self.pp_layer_partition) == self.pp,
            f"--pp-layer-partition {','.join(map(str, self.pp_layer_partition))} needs one layer count per stage "
            f"(--pp {self.pp})",
        )
        require(all(n >= 1 for n in self.pp_layer_partition), "--pp-layer-partition: every stage needs a layer")

    @property
    def fixes(self) -> frozenset[str]:
        released = set(SYNC_FIXES) - set(PROPOSALS)
        implied = released if self.sync == "fixed" else set(LEGACY_FIXES) if self.sync == "legacy" else set()
        return frozenset((implied | set(self.enable_fixes)) - set(self.disable_fixes))

    @property
    def micro_batches(self) -> int:
        """Micro-batch slots of the event loop (SGLang's pp_loop_size)."""
        return self.pp + self.pp_async_batch_depth

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp
