"""SGLang's own cache as the lab's reference: sglang 0.5.23's `UnifiedRadixCache` (with its
`HybridCacheController` and `MHATokenToKVPoolHost` for the host tier), built on CPU in this process (the
`direct` io backend, the run's host layout), answering the questions the lab's scheduler asks its cache
(`mem_cache/base.BasePrefixCache`), in the lab's terms: token tuples in, lengths and slot tensors out.

Nothing here decides anything: each method calls SGLang's own entry point, the one SGLang's scheduler calls
(`match_prefix`, `inc_lock_ref` / `dec_lock_ref`, `init_load_back`, `evict`, `insert`, `check_hicache_events`,
`ready_to_load_host_cache`, `evict_host`, `reset`). What the lab supplies is the world around the cache:

* its place: without a `world` (the conformance replay) there is no torch.distributed world, and SGLang's
  agreements (`_all_reduce`, `_pp_sync`) are no-ops without a cache group and with `pp_size = 1`; with one
  (world.py, `run --cache-impl sglang`: rank_cache.py) they run over the rank's real process groups;
* the copies' completion: on CPU SGLang's copies finish as they are issued, so each copy's finish event is
  replaced by one from `clock`, a `CopyEngine` that says when the copy is done: the lab's own latency model
  (the same steps the lab's copies finish at) or, for a recorded run, `AgreedCompletion` (completion.py: each
  copy finishes at the step the recorded rank consumed it).

`replay.py` drives this and the lab's cache with the same operations and compares their answers.
"""

from __future__ import annotations

import types
from array import array
from typing import NamedTuple

import torch

from ...config import CacheConfig
from ...errors import PoolExhaustedError
from ...mem_cache.build import KVShape
from ...mem_cache.copy_engine import CopyJob
from ...mem_cache.utils import page_floor
from .modules import sglang_modules
from .releases import REFERENCE
from .world import host_pool_args

NO_LAYERS = CopyJob(layers=[], poison=lambda: None)  # SGLang has moved the bytes already; the event only times


class SGLangMatch(NamedTuple):
    """`match_prefix`'s answer with the lab's field names (nodes are SGLang's node ids)."""

    device_indices: torch.Tensor
    last_device_node: int
    last_host_node: int
    host_hit_length: int


class SGLangCache:
    """One rank's SGLang cache on CPU, sized like the lab's: `cfg.max_total_tokens` device slots, and with
    `cfg.enable_hierarchical_cache` a host pool of exactly `host_tokens` slots. Its device pool holds `shape`
    (default: 2 layers of one head of 2 dimensions, the conformance replay's). `world` places it in a lab world
    (world.py: the rank's process groups, its stage, its storage backend); without one it is a world of one."""

    version = REFERENCE  # the release whose modules it builds from (`for_release`)

    def __init__(self, cfg: CacheConfig, host_tokens: int, clock, shape: KVShape | None = None, world=None):
        sg = self.sg = self.modules()
        self.cfg, self.clock = cfg, clock
        shape = shape or KVShape(num_layers=2, num_heads=1, head_dim=2)
        ps, size = cfg.page_size, cfg.max_total_tokens
        server_args = sg.ServerArgs(
            model_path="dummy",  # any other path makes SGLang's resolution read that model's config
            device="cpu",
            page_size=ps,
            enable_hierarchical_cache=cfg.enable_hierarchical_cache,
            hicache_io_backend="direct",
            hicache_mem_layout=cfg.host_layout,
            hicache_write_policy=cfg.write_policy,
            **host_pool_args(cfg, host_tokens, shape, world),
            **(world.server_args() if world is not None else {}),
        )
        self.resolve(server_args, world)
        self.kv = sg.MHATokenToKVPool(
            size,
            ps,
            shape.dtype,
            head_num=shape.num_heads,
            head_dim=shape.head_dim,
            layer_num=shape.num_layers,
            device="cpu",
            enable_memory_saver=False,
        )
        if ps == 1:
            self.allocator = sg.TokenAllocator(size, shape.dtype, "cpu", self.kv, need_sort=False)
        else:
            self.allocator = sg.PagedAllocator(size, ps, shape.dtype, "cpu", self.kv, need_sort=False)
        params = sg.CacheInitParams(
            disable=False,
            req_to_token_pool=sg.ReqToTokenPool(8, 8, "cpu", False),
            token_to_kv_pool_allocator=self.allocator,
            page_size=ps,
            **self.placed(world),
        )
        self.cache = self.build(params, server_args)
        self.controller, self.host_tokens = getattr(self.cache, "cache_controller", None), 0
        if self.controller is not None:
            self._time_copies_by(clock)
            host = self.controller.mem_pool_host.available_size()
            if host != host_tokens:
                raise RuntimeError(f"SGLang's host pool holds {host} tokens, the lab's {host_tokens}")
            self.host_tokens = host
        self.locks: dict[int, list] = {}  # node id -> receipts of the locks the lab's caller holds on it

    # -- what differs between SGLang's releases (hiradix.py: the HiRadixCache ones) -------------------------

    @classmethod
    def for_release(cls, version: str) -> type:
        """This adapter for release `version` (its modules imported from its own directory)."""
        return type(f"{cls.__name__}_{version.replace('.', '_')}", (cls,), {"version": version})

    def modules(self):
        return sglang_modules(self.version)

    def resolve(self, server_args, world) -> None:
        """SGLang's own resolution of the host tier's flags (with the direct io backend, page_first becomes
        page_first_direct; the rest of its resolution stops at a dummy model), then what its launcher records
        for the process."""
        self.sg.run_hook(self.sg.handle_hicache, server_args)
        self.sg.publish(server_args)
        if world is not None:
            world.publish()

    def placed(self, world) -> dict:
        """CacheInitParams' fields of the rank's place, and the tree's components (full attention only)."""
        return {"tree_components": (self.sg.FULL,), **(world.cache_params() if world is not None else {})}

    def build(self, params, server_args):
        cache = self.sg.UnifiedRadixCache(params)
        if server_args.enable_hierarchical_cache:
            cache.init_hicache(server_args, params)
        return cache

    def _time_copies_by(self, clock) -> None:
        """Every copy SGLang's transfer engine issues gets its finish event from `clock` (per stream)."""
        engine = self.controller.l2_transfer_engine
        for method, stream in (("submit_device_to_host", "write"), ("submit_host_to_device", "load")):
            issue = getattr(engine, method)

            def timed(*args, _issue=issue, _stream=stream, **kwargs):
                completion = _issue(*args, **kwargs)
                return completion._replace(finish_event=clock.submit(_stream, NO_LAYERS))

            setattr(engine, method, timed)

    # -- the questions ------------------------------------------------------------------------------

    def key(self, tokens) -> object:
        return self.sg.RadixKey(array("q", tokens))

    def match_prefix(self, tokens: tuple[int, ...]) -> SGLangMatch:
        result = self.cache.match_prefix(self.sg.params.MatchPrefixParams(key=self.key(tokens)))
        device = self.cache.path_device_indices(result.last_device_node)
        assert len(device) == result.device_prefix_len
        return SGLangMatch(device, result.last_device_node, result.best_match_node, result.host_hit_length)

    def inc_lock_ref(self, node: int) -> None:
        self.locks.setdefault(node, []).append(self.cache.inc_lock_ref(node).to_dec_params())

    def dec_lock_ref(self, node: int) -> None:
        self.cache.dec_lock_ref(node, self.locks[node].pop())

    def device_room(self) -> int:
        return self.allocator.available_size() + self.cache.evictable_size()

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(self.sg.params.EvictParams(num_tokens=num_tokens)).num_tokens_evicted

    def evict_host(self, num_tokens: int) -> int:
        return self.cache.evict_host(num_tokens)

    def evict_to_free(self, num_tokens: int) -> bool:
        self.allocator.evict_to_free_tokens(self.cache, num_tokens)
        return self.allocator.available_size() >= num_tokens

    def alloc_device(self, num_tokens: int, demand: int | None = None) -> torch.Tensor:
        """As SGLang's scheduler allocates (`alloc_token_slots`, `alloc_paged_token_slots_*`): evict until
        `demand` tokens are free, then allocate."""
        self.evict_to_free(max(num_tokens, demand or 0))
        slots = self.allocator.alloc(num_tokens)
        if slots is None:
            raise PoolExhaustedError(f"SGLang's device pool: {num_tokens} tokens asked")
        return slots

    def free_request(self, slots: torch.Tensor, prefix_len: int, last_node: int) -> None:
        """SGLang's `release_kv_cache(checkpoint=False)`: free the row past the protected prefix, unlock."""
        if len(slots) > prefix_len:
            self.allocator.free(slots[prefix_len:])
        self.dec_lock_ref(last_node)

    def init_load_back(self, match: SGLangMatch) -> tuple[int, int]:
        """Load back a match's host-only tail (SGLang decides, from its threshold): (tokens loaded, the node the
        usable prefix now ends at)."""
        req = types.SimpleNamespace(  # the fields of SGLang's Req that a full-attention load back reads
            rid="lab",
            last_node=match.last_device_node,
            swa_host_hit_length=0,
            mamba_host_hit_length=0,
            kv=types.SimpleNamespace(mamba_pool_idx=None),
        )
        params = self.sg.params.InitLoadBackParams(match.last_host_node, match.host_hit_length, req=req)
        return self.cache.init_load_back(params)

    def lock_match(self, match: SGLangMatch) -> tuple[torch.Tensor, int]:
        """The lab's `lock_match`: the caller holds a lock on the match's device node; with a host hit, load back
        and move the lock to the node the prefix ends at."""
        if match.host_hit_length == 0:
            return match.device_indices, match.last_device_node
        _, last = self.init_load_back(match)
        self.inc_lock_ref(last)
        self.dec_lock_ref(match.last_device_node)
        return self.cache.path_device_indices(last), last

    def insert(self, tokens: tuple[int, ...], value: torch.Tensor, prev_prefix_len: int = 0, inserted_len: int = 0):
        """SGLang's insert: frees the caller's duplicates of slots the tree held, past `prev_prefix_len`; counts
        hits only on nodes ending past `inserted_len`. Its `InsertResult`."""
        params = self.sg.params.InsertParams(
            key=self.key(tokens), value=value, prev_prefix_len=prev_prefix_len, inserted_len=inserted_len
        )
        return self.cache.insert(params)

    def cache_unfinished_req(self, tokens, slots: torch.Tensor, prefix_len: int, last_node: int, inserted_len: int):
        """SGLang's `checkpoint_into_tree` for a full-attention request: insert what is computed, then move the
        request's lock to the node the insert ended on; the tree's slots for the tokens, and that node."""
        result = self.insert(tokens, slots[: len(tokens)], prefix_len, inserted_len)
        self.dec_lock_ref(last_node)
        self.inc_lock_ref(result.last_device_node)
        return self.cache.path_device_indices(result.last_device_node), result.last_device_node

    def cache_finished_req(
        self, tokens, slots: torch.Tensor, prefix_len: int, last_node: int, inserted_len: int = 0, prompt_len: int = 0
    ) -> int:
        """SGLang's `release_kv_cache(checkpoint=True)`: the insert, the split at the prompt's last page, then
        the row's unaligned tail freed and the lock released."""
        aligned = len(tokens)
        matched = self.insert(tokens, slots[:aligned], prefix_len, inserted_len).prefix_len
        prompt = page_floor(prompt_len, self.cfg.page_size)
        if 0 < prompt < aligned:
            self.insert(tokens[:prompt], slots[:prompt], prompt, prompt)
        if len(slots) > aligned:
            self.allocator.free(slots[aligned:])
        self.dec_lock_ref(last_node)
        return matched

    def flush_pending_backups(self) -> None:
        """A batch's results are processed: its queued host writes start as one copy."""
        self.cache.flush_pending_backups()

    def check_hicache_events(self) -> tuple[int, int]:
        """SGLang's step-start check; returns how many write and load acks it consumed."""
        if self.controller is None:
            return 0, 0
        c = self.controller
        before = len(c.ack_write_queue) + bool(c.write_queue), len(c.ack_load_queue)  # queued writes start first
        self.cache.check_hicache_events()
        return before[0] - len(c.ack_write_queue), before[1] - len(c.ack_load_queue)

    def start_loading(self) -> bool:
        """SGLang's `ready_to_load_host_cache`: whether a load started."""
        return self.controller is not None and self.cache.ready_to_load_host_cache() >= 0

    def copies_in_flight(self) -> bool:
        return self.controller is not None and self.controller.has_inflight_device_transfers()

    def flush(self) -> None:
        """As SGLang's `Scheduler.flush_cache`: the tree (with the host tier) and the device allocator."""
        self.cache.reset()
        self.allocator.clear()

    # -- what both caches can be compared on ------------------------------------------------------------

    def device_free(self) -> int:
        return self.allocator.available_size()

    def host_free(self) -> int:
        return self.controller.mem_pool_host.available_size() if self.controller is not None else 0

    def evictable(self) -> int:
        return self.cache.evictable_size()
