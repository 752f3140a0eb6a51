"""The contracts of the cache's parts: what each operation guarantees, and what its caller must do.

In the style of mini-sglang's `kvcache/base.py`. The copy and storage contracts are `Protocol`s (the engines
and backends are unrelated classes that all keep them; they are `runtime_checkable`, and
tests/mem_cache/test_contracts.py checks each with `isinstance`); the prefix cache is an abstract base class that
`RadixCache` (device only) and `HiRadixCache` (with the host tier) extend, and all that the scheduler calls.

Hook points: a binder (entrypoints/binders.py) may wrap these, per instance, and the core calls them through
`self` so that the wrapper is what runs: `HiRadixCache.allocate` (a copy's slots on this rank),
`HiRadixCache.writing_check` (`--sync-impl writing_check`), `HiCacheController.write_job` (a host write's
per-layer copies), `FileStorage.batch_get` (a storage read), `Scheduler.schedule` (one step's batch),
`StageLoop.on_iteration` (callables run as each iteration begins), `StageLoop.send_hidden` / `recv_hidden` (what
travels with the activations between stages), `CacheSync.agree_ack_counts` (the step's agreement),
`CacheSync.agree_prefetch_progress` (the prefetch votes) and `CacheSync._pp_sync` / `_attn_groups` (the relay and
the groups, `--sync-impl`). The faults (lab/check/faults.py), the `--sync-impl` slots (lab/teach/sync_impl.py) and
a `--plugin` (lab/plugins.py) bind nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class CopyEvent(Protocol):
    """The completion of one asynchronous copy, with SGLang's (CUDA events') API."""

    def query(self) -> bool:
        """Has the copy finished? Never blocks: what `writing_check` / `loading_check` poll."""

    def synchronize(self) -> None:
        """Block until the copy has finished (its bytes are in place)."""

    def wait_layer(self, layer: int) -> None:
        """Make the forward pass wait for layer `layer`'s bytes only (layer-wise load overlap)."""


@runtime_checkable
class CopyEngine(Protocol):
    """Runs copies on two FIFO streams, `write` (device -> host) and `load` (host -> device): on one stream a
    copy finishes no earlier than the one submitted before it."""

    def submit(self, stream: str, job) -> CopyEvent:
        """Start `job` (a `copy_engine.CopyJob`: one callable per layer) on `stream`; never blocks."""

    def advance(self, step: int) -> None:
        """The scheduler's step `step` begins (virtual latency: copies due by then finish)."""

    def close(self) -> None:
        """Finish every copy and stop the engine's threads or streams."""


@runtime_checkable
class StorageBackend(Protocol):
    """An L3 store of pages, keyed by page hash (SGLang's `HiCacheStorage`, batched). A prefix is useful only up to
    its first gap, so lookups count *leading* pages. Failures are misses, never exceptions or wrong data."""

    stats: Counter[str]

    def batch_exists(self, hashes: list[str]) -> int:
        """How many leading pages of `hashes` the store holds."""

    def batch_get(self, hashes: list[str], host, page_slots: list[torch.Tensor]) -> int:
        """Read leading pages into the host pool's `page_slots`; how many arrived intact."""

    def batch_set(self, hashes: list[str], host, page_slots: list[torch.Tensor]) -> int:
        """Write pages from the host pool's `page_slots`; how many leading pages were stored."""

    def clear(self) -> None:
        """Drop every page under this rank's keys."""

    def close(self) -> None: ...


class BasePrefixCache(ABC):
    """A prefix cache of one rank, as the scheduler uses it. Keys are page-aligned token tuples; values are device
    slot tensors; `cfg` is the cache's `CacheConfig`.

    Invariants every implementation keeps:

    * `lock_ref > 0` => not evictable; a lock on a node protects its whole path to the root;
    * a caller that uses the slots a match returned holds a lock on the match's last node until it is done
      (`lock_match` takes one over, `cache_unfinished_req` moves it, `cache_finished_req` releases it);
    * `evict(0)` is always safe; `evict(n)` frees at least `n` device slots when unlocked nodes allow;
    * identical calls in identical order give identical trees (`tree.digest()`) on every rank: no wall time,
      no randomness, no rank-local observation enters a decision without an agreement;
    * `check_hicache_events`, `prefetch_from_storage` and `check_prefetch_progress` may run collectives: every
      rank calls them the same number of times, in the same order, in every step.
    """

    @abstractmethod
    def match_prefix(self, key: tuple[int, ...]):
        """The longest cached prefix of `key`: device slots, the last device node, and (with a host tier) the
        host-only tail beyond it. Marks the matched nodes as used (LRU)."""

    @abstractmethod
    def insert(self, key: tuple[int, ...], value: torch.Tensor, inserted_len: int = 0) -> int:
        """Insert a page-aligned key with its device slots; returns how many leading tokens the tree already held
        on the device (the caller frees its own copies of those). Only nodes ending beyond `inserted_len` count a
        hit (a request's own earlier insert counted the rest, as SGLang 0.5.23)."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots from unlocked leaves, least recently used first; returns how
        many were freed."""

    @abstractmethod
    def inc_lock_ref(self, node) -> None:
        """Protect `node` and its ancestors from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node) -> None:
        """Release one lock taken by `inc_lock_ref`."""

    @abstractmethod
    def device_room(self) -> int:
        """Device slots a request may take now: free ones plus those eviction can free."""

    @abstractmethod
    def lock_match(self, match) -> tuple[torch.Tensor, object]:
        """The prefix a request may use, and the node ending it, locked for the request. The caller holds a lock
        on `match.last_device_node` (taken before its room check): this lock is handed over, or swapped for one
        on the node a load back ends at."""

    @abstractmethod
    def alloc_device(self, num_tokens: int, demand: int | None = None) -> torch.Tensor:
        """Device slots for `num_tokens` (whole pages). First evicts until `demand` tokens are free (default
        `num_tokens`; SGLang's paged allocator asks a page more per request), then allocates;
        PoolExhaustedError if impossible."""

    @abstractmethod
    def evict_to_free(self, num_tokens: int) -> bool:
        """Evict until `num_tokens` device slots are free, if unlocked nodes allow (SGLang's
        `evict_to_free_tokens`); whether they are."""

    @abstractmethod
    def free_request(self, slots: torch.Tensor, prefix_len: int, last_node) -> None:
        """A request leaves without inserting (a retraction): free its slots beyond the `prefix_len` the tree
        holds, release its lock on `last_node`."""

    @abstractmethod
    def cache_unfinished_req(
        self, tokens: tuple[int, ...], slots: torch.Tensor, prefix_len: int, last_node, inserted_len: int
    ) -> tuple[torch.Tensor, object]:
        """A running request's KV so far goes into the tree (after its prefill or a chunk: SGLang's
        `checkpoint_kv_cache`). `tokens` are its whole pages computed so far, `slots` its slots for them (its
        `prefix_len` cached ones first). The request's copies of tokens the tree already held are freed; its lock
        moves from `last_node` to the node the insert ended on. Returns the tree's slots for `tokens` (the
        request's row takes them over) and that node."""

    @abstractmethod
    def cache_finished_req(
        self,
        tokens: tuple[int, ...],
        slots: torch.Tensor,
        prefix_len: int,
        last_node,
        inserted_len: int = 0,
        prompt_len: int = 0,
    ) -> int:
        """A request is done: insert its whole pages, free the slots the tree already held and the unused tail,
        release its lock on `last_node`. With `prompt_len`, the leaf is also split at the prompt's last whole
        page (SGLang 0.5.23: eviction can then drop the answer and keep the prompt). Returns how many leading
        tokens the tree already held on either tier (SGLang's `InsertResult.prefix_len`: a host-only node on the
        path takes the request's slots)."""

    @abstractmethod
    def flush(self) -> None:
        """Drop every cached prefix (between rounds, nothing running)."""

    @abstractmethod
    def check_integrity(self, held_by_requests: int = 0) -> None:
        """Assert the invariants, and that every slot is free, cached, or one of `held_by_requests`."""

    @abstractmethod
    def observe(self) -> dict:
        """What a step record shows of this cache (the cache fields of `step_trace.StepRecord`)."""

    # -- where a host tier joins in: a device-only cache has nothing to do -----------------------------

    def advance(self, step: int) -> None:
        """Step `step` begins: copies due by now finish."""
        return None

    def check_hicache_events(self) -> tuple[int, int]:
        """Acks consumed at the start of the step: (write, load)."""
        return 0, 0

    def flush_pending_backups(self) -> None:
        """A batch's results are processed: start, as one copy, the host writes its inserts queued."""
        return None

    def prefetch_from_storage(self, rid: int, prompt: list[int]) -> None:
        """A request arrived: start fetching from storage what of its prompt the tree does not hold."""
        return None

    def check_prefetch_progress(self, rid: int) -> int | None:
        """None while request `rid` must wait for its prefetch; else the tokens it inserted (host-only)."""
        return 0

    def start_loading(self) -> CopyEvent | None:
        """Start the loads queued while a batch was built; their event, which the forward pass waits on."""
        return None

    def copies_in_flight(self) -> bool:
        """Whether unconsumed copies still hold locks or requests (a stalled schedule may still move)."""
        return False

    def waits_on_storage(self) -> bool:
        """Whether a storage operation (a query, a prefetch, a backup) is still in flight: it may take long."""
        return False

    def copy_check(self):
        """The record of consumed copies compared with their sources (`--check-outputs`), if any."""
        return None

    def summary(self) -> dict:
        """What a rank's result records of this cache beyond its hit rates."""
        return {}

    def close(self) -> None:
        """Finish every copy and stop the cache's workers."""
        return None


class BaseHiCache(BasePrefixCache):
    """A prefix cache with a host tier (HiCache). On top of `BasePrefixCache`:

    * an in-flight copy locks its node until its ack is consumed; acks are consumed in FIFO order, by a count
      every rank agreed on (`check_hicache_events`), never by what one rank's poll saw;
    * a host-only node stays in the tree and can be loaded back; host copies are contiguous from the root.
    """

    @abstractmethod
    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots from unprotected host-only leaves (they leave the tree)."""

    @abstractmethod
    def init_load_back(self, last_node) -> tuple[torch.Tensor, object]:
        """Load back the host-only tail of a match ending at `last_node`, all or nothing: the device slots it
        will fill and the node the usable prefix now ends at."""

    @abstractmethod
    def writing_check(self, count: int) -> None:
        """Consume exactly `count` write acks, oldest first: a node is unlocked only once its copy has finished here."""

    @abstractmethod
    def loading_check(self, count: int) -> None:
        """Consume exactly `count` load acks, likewise."""

    @abstractmethod
    def check_hicache_events(self) -> tuple[int, int]:
        """Start of every step, on every rank: agree how many acks of each queue every rank consumes, then consume
        them. Every rank enters the agreement every step. Returns (write, load) consumed."""
