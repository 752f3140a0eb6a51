"""A `Harness` builds one rank's cache with `mem_cache.build.one_rank_cache` (`build_cache`, as every run does),
and plays request-like operations on it the way the scheduler does, checking after each what
`test_radix_properties.py` says."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from radix_oracle import (
    DEVICE_TOKENS,
    EMPTY,
    MAX_OPEN,
    MAX_SEQ,
    NUM_LAYERS,
    Checks,
    aligned_prefixes,
    depth,
    expected_codes,
    in_tree,
    longest_prefix,
    signature,
    tree_paths,
    tree_prefixes,
    write_kv,
)

from hicache_lab.config import CacheConfig
from hicache_lab.mem_cache.build import one_rank_cache
from hicache_lab.mem_cache.tree_node import TreeNode

# -- the harness ----------------------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    key: tuple[int, ...]
    prefix: torch.Tensor  # device slots of the cached prefix (the loaded part included)
    own: torch.Tensor  # slots allocated for the rest of the key
    last_node: TreeNode  # locked while the request runs


class Harness(Checks):
    def __init__(
        self,
        groups,
        page_size: int,
        policy: str,
        max_delay: int = 0,
        seed: int = 0,
        layout: str = "layer_first",
        load_back_threshold: int = 1,
        checks: bool = True,
        device_tokens: int = DEVICE_TOKENS,
        host_ratio: float = 2.0,
    ):
        self.ps, self.checks = page_size, checks
        self.cfg = CacheConfig(
            max_total_tokens=device_tokens,
            hicache_ratio=host_ratio,
            page_size=page_size,
            enable_hierarchical_cache=True,
            write_policy=policy,
            host_layout=layout,
            load_back_threshold=load_back_threshold,
            max_copy_delay_steps=max_delay,
        )
        self.pool, self.cache = one_rank_cache(self.cfg, groups, num_layers=NUM_LAYERS, check_copies=True, seed=seed)
        self.controller, self.device_alloc, self.host_alloc = (
            self.cache.controller,
            self.cache.device_alloc,
            self.cache.host_alloc,
        )
        self.engine, self.host_pool = self.controller.engine, self.controller.host_pool
        self.tree = self.cache.tree
        self.open: list[Request] = []
        self.pinned: list[TreeNode] = []  # nodes a test locked by hand
        self.history: list[tuple[int, ...]] = []  # keys requests used, to extend
        self.naive: set = set()  # every page-aligned prefix ever inserted
        self.digest, self.signature = self.tree.digest(), signature(self.tree)
        self.stats = {"inserted": 0, "refused": 0, "loaded": 0, "duplicates_freed": 0, "adopted": 0}

    # -- building keys ----------------------------------------------------------------------------

    def key_from(self, base: int, ext: list[int]) -> tuple[int, ...]:
        """Mostly an extension of a recent key (shared prefixes), sometimes a fresh one."""
        start = self.history[-1 - base % len(self.history)] if self.history and base < 6 else ()
        return (start + tuple(ext))[:MAX_SEQ]

    def pin(self, node: TreeNode) -> None:
        self.tree.inc_lock_ref(node)
        self.pinned.append(node)

    def unpin(self, node: TreeNode) -> None:
        self.tree.dec_lock_ref(node)
        self.pinned.remove(node)

    def held(self) -> int:
        return sum(len(r.own) for r in self.open)

    # -- requests ---------------------------------------------------------------------------------

    def drain(self) -> None:
        """Finish every copy in flight and consume every ack (what waiting steps would do)."""
        self.cache.flush_pending_backups()
        for ack in self.controller.ack_write_queue + self.controller.ack_load_queue:
            ack.finish_event.synchronize()
        self.cache.check_hicache_events()
        assert not self.controller.ack_write_queue and not self.controller.ack_load_queue

    def begin(self, key: tuple[int, ...], load_back: bool) -> Request | None:
        """Admit a request as `Scheduler._admit` does; None (nothing held) when it does not fit."""
        key = key[: len(key) // self.ps * self.ps]
        self.history.append(key)
        for attempt in range(2):
            match = self.cache.match_prefix(key)
            self.cache.inc_lock_ref(match.last_device_node)
            if self.cache.device_room() >= len(key) - len(match.device_indices):
                break
            self.cache.dec_lock_ref(match.last_device_node)
            if attempt == 0:
                self.drain()
        else:
            assert self.open, "an idle cache without copies in flight must fit a request of half the pool"
            self.stats["refused"] += 1
            return None
        prefix, last = match.device_indices, match.last_device_node
        if load_back and match.host_hit_length > 0:
            matched = len(prefix) + match.host_hit_length
            prefix, last = self.cache.lock_match(match)
            self.cache.start_loading()
            if len(prefix) > len(match.device_indices):
                assert len(prefix) == matched, "a load back brings back the whole host hit"
                self.stats["loaded"] += 1
        need = len(key) - len(prefix)
        own = self.cache.alloc_device(need) if need else EMPTY  # admission said it fits: no PoolExhaustedError
        write_kv(self.pool, own, expected_codes(key, len(prefix), len(key)))
        req = Request(key, prefix, own, last)
        self.open.append(req)
        return req

    def finish(self, req: Request) -> None:
        """Insert, free duplicates, unlock: `Scheduler._cache_finished_req`."""
        self.open.remove(req)
        slots = torch.cat([req.prefix, req.own])
        anywhere, device = tree_prefixes(self.tree)
        on_device, held = longest_prefix(req.key, device, self.ps), longest_prefix(req.key, anywhere, self.ps)
        if held > on_device:
            self.stats["adopted"] += 1  # host-only nodes on the path take the request's slots
        prefix_len = self.cache.cache_finished_req(req.key, slots, len(req.prefix), req.last_node)
        self.cache.flush_pending_backups()  # as the scheduler does once a batch's results are processed
        assert prefix_len == held, "insert counts exactly the tokens the tree held, on either tier"
        assert on_device >= len(req.prefix), "the request's locked prefix must still be on the device"
        assert req.key in tree_prefixes(self.tree)[1] or not req.key, "an inserted key is on the device"
        if on_device > len(req.prefix):
            self.stats["duplicates_freed"] += 1
        self.naive |= aligned_prefixes(req.key, self.ps)
        self.stats["inserted"] += 1

    # -- operations -------------------------------------------------------------------------------

    def apply(self, op: tuple) -> None:
        kind, *args = op
        getattr(self, f"op_{kind}")(*args)
        if self.checks:
            self.check()

    def op_insert(self, base: int, ext: list[int], load_back: bool) -> None:
        req = self.begin(self.key_from(base, ext), load_back)
        if req is not None:
            self.finish(req)

    def op_begin(self, base: int, ext: list[int], load_back: bool) -> None:
        if len(self.open) < MAX_OPEN:
            self.begin(self.key_from(base, ext), load_back)

    def op_finish(self, which: int) -> None:
        if self.open:
            self.finish(self.open[which % len(self.open)])

    def op_match(self, base: int, ext: list[int], cut: int) -> None:
        self.checked_match(self.key_from(base, ext)[:cut])

    def op_load(self, base: int, ext: list[int]) -> None:
        """Load back a host hit; once the load is done a fresh match holds it all on the device."""
        query = self.key_from(base, ext)
        match = self.checked_match(query)
        if match.host_hit_length == 0:
            return
        matched = len(match.device_indices) + match.host_hit_length
        loaded, last = self.cache.init_load_back(match.last_host_node)
        load_event = self.controller.start_loading()
        if len(loaded) == 0:
            assert load_event is None, "nothing loaded, nothing started"
            assert not last.evicted and depth(last) == len(match.device_indices)
            return
        assert last is match.last_host_node and len(loaded) == match.host_hit_length
        self.stats["loaded"] += 1
        load_event.synchronize()
        fresh = self.checked_match(query)
        assert len(fresh.device_indices) == matched, (
            f"loaded back {len(loaded)} tokens, but a fresh match holds {len(fresh.device_indices)} of the "
            f"{matched} matched before on the device"
        )

    def op_evict(self, num_tokens: int) -> None:
        locked = [n for _, n in tree_paths(self.tree) if n.lock_ref > 0]
        evictable, available = self.tree.evictable_size(), self.device_alloc.available_size()
        freed = self.cache.evict(num_tokens)
        assert min(num_tokens, evictable) <= freed <= evictable
        assert self.device_alloc.available_size() == available + freed
        for node in locked:
            assert in_tree(self.tree, node) and not node.evicted, f"locked node {node.id} was evicted"

    def op_evict_host(self, num_tokens: int) -> None:
        device = {path for path, n in tree_paths(self.tree) if not n.evicted}
        host_only = sum(len(n.host_value) for _, n in tree_paths(self.tree) if n.evicted)
        # write_back also takes the host copies of nodes on both tiers (SGLang's duplicate reclaim)
        both = sum(len(n.host_value) for _, n in tree_paths(self.tree) if not n.evicted and n.backuped)
        reclaimable = host_only + (both if self.cfg.write_policy == "write_back" else 0)
        available = self.host_alloc.available_size()
        freed = self.cache.evict_host(num_tokens)
        assert min(num_tokens, host_only) <= freed <= reclaimable
        assert self.host_alloc.available_size() == available + freed
        assert {path for path, n in tree_paths(self.tree) if not n.evicted} == device, "evict_host touched the device"

    def op_step(self) -> None:
        self.engine.advance(self.engine.step + 1)
        self.cache.check_hicache_events()

    def op_sync(self) -> None:
        """Force every copy done, consume every ack: then every slot in the tree holds its KV, no exceptions."""
        self.drain()
        self.check_kv(in_flight=False)
        assert not self.controller.copy_check.mismatched, self.controller.copy_check.mismatched

    def close(self) -> None:
        """End of a run: finish every request, drain, check everything once more."""
        while self.open:
            self.finish(self.open[0])
        self.op_sync()
        self.check()
