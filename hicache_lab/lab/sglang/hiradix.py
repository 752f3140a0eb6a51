"""`--cache-impl sglang==X` for the releases whose HiCache is `HiRadixCache(params, server_args)` (0.5.10 to 0.5.18):
the adapter of that API generation. Every rank builds release X's own `HiRadixCache` (with its
`HiCacheController` and host pool) with its real process groups, and the lab's scheduler drives it through the
cache contract, as rank_cache.py drives 0.5.23's.

Where the generation differs from 0.5.23, the adapter follows the release: tree nodes are SGLang's `TreeNode`
objects; a lock is `inc_lock_ref(node)` with no receipt; a match ends at `last_host_node`, which `init_load_back`
takes (`last_host_node=` in 0.5.10, `best_match_node=` later: whichever field the release has); a write starts its
copy as it is queued; the scheduler-side steps (`cache_unfinished_req`, `cache_finished_req`, eviction before an
allocation) are composed as that release's `RadixCache` and `mem_cache/common.py` compose them. Nothing of the
release's agreement (`writing_check`, `loading_check`, `_all_reduce`, the relay) is touched: each copy's finish
event is the lab's clock's, so ranks see their copies finish at different steps, as on GPUs.
"""

from __future__ import annotations

import dataclasses

import torch

from .cache import NO_LAYERS, SGLangMatch
from .modules import hiradix_modules
from .rank_cache import SGLangRankCache


def _leading_done(queue) -> int:
    """How many acks at the head of a queue have finished copies (the count a rank polls before agreeing)."""
    done = 0
    for ack in queue:
        if not ack.finish_event.query():
            break
        done += 1
    return done


class HiRadixRankCache(SGLangRankCache):
    """One rank's `HiRadixCache` of release `version` in a lab world, answering the whole cache contract."""

    # -- built as the release builds it ---------------------------------------------------------------------

    def modules(self):
        return hiradix_modules(self.version)

    def resolve(self, server_args, world) -> None:
        """The release's own resolution of the host tier's flags (page_first with the direct io backend becomes
        page_first_direct), which its ServerArgs does not reach for a dummy model; then it is the process's."""
        server_args._handle_hicache()
        self.sg.publish(server_args)

    def placed(self, world) -> dict:
        """The rank's groups and place, in the fields this release's CacheInitParams has (0.5.10 has one TP
        group; the attention groups come with 0.5.11, the PP group with 0.5.13)."""
        fields = {field.name for field in dataclasses.fields(self.sg.CacheInitParams)}
        return {k: v for k, v in (world.cache_params() if world is not None else {}).items() if k in fields}

    def build(self, params, server_args):
        if server_args.enable_hierarchical_cache:
            return self.sg.HiRadixCache(params, server_args)
        return self.sg.RadixCache(params)

    def _time_copies_by(self, clock) -> None:
        """Every copy the controller starts gets its ack's finish event from `clock` (per stream): its own
        events, recorded on CPU, are done at once."""
        controller = self.controller
        for method, queue, stream in (
            ("start_writing", controller.ack_write_queue, "write"),
            ("start_loading", controller.ack_load_queue, "load"),
        ):
            start = getattr(controller, method)

            def timed(*args, _start=start, _queue=queue, _stream=stream, **kwargs):
                before = len(_queue)
                result = _start(*args, **kwargs)
                if len(_queue) > before:
                    _queue[-1] = _queue[-1]._replace(finish_event=clock.submit(_stream, NO_LAYERS))
                return result

            setattr(controller, method, timed)

    # -- the questions, in this generation's terms ------------------------------------------------------

    def key(self, tokens):
        return self.sg.RadixKey(token_ids=list(tokens))

    def match_prefix(self, tokens):
        found = self.cache.match_prefix(self.sg.params.MatchPrefixParams(key=self.key(tokens)))
        return SGLangMatch(found.device_indices, found.last_device_node, found.last_host_node, found.host_hit_length)

    def inc_lock_ref(self, node) -> None:
        self.cache.inc_lock_ref(node)

    def dec_lock_ref(self, node) -> None:
        self.cache.dec_lock_ref(node)

    def evict_to_free(self, num_tokens: int) -> bool:
        """The release's scheduler evicts before it allocates (`mem_cache/common.evict_from_tree_cache`)."""
        self.sg.evict_from_tree_cache(self.cache, num_tokens)
        return self.allocator.available_size() >= num_tokens

    def init_load_back(self, match):
        fields = {field.name for field in dataclasses.fields(self.sg.params.InitLoadBackParams)}
        node = "best_match_node" if "best_match_node" in fields else "last_host_node"
        hit = match.host_hit_length
        params = self.sg.params.InitLoadBackParams(**{node: match.last_host_node}, host_hit_length=hit)
        return self.cache.init_load_back(params)

    def lock_match(self, match):
        """As the release's scheduler: the loaded slots follow the device prefix, and the lock moves to the
        node the prefix now ends at."""
        if match.host_hit_length == 0:
            return match.device_indices, match.last_device_node
        loaded, last = self.init_load_back(match)
        self.inc_lock_ref(last)
        self.dec_lock_ref(match.last_device_node)
        return torch.cat([match.device_indices, loaded]), last

    def insert(self, tokens, value, prev_prefix_len: int = 0, inserted_len: int = 0):
        return self.cache.insert(self.sg.params.InsertParams(key=self.key(tokens), value=value))

    def cache_unfinished_req(self, tokens, slots, prefix_len: int, last_node, inserted_len: int):
        """The release's `RadixCache.cache_unfinished_req`: insert, free the request's copies of what the tree
        held, match again for the tree's slots and node, move the lock there."""
        held = self.insert(tokens, slots[: len(tokens)]).prefix_len
        self.allocator.free(slots[prefix_len:held])
        match = self.cache.match_prefix(self.sg.params.MatchPrefixParams(key=self.key(tokens)))
        self.dec_lock_ref(last_node)
        self.inc_lock_ref(match.last_device_node)
        return match.device_indices, match.last_device_node

    def cache_finished_req(self, tokens, slots, prefix_len: int, last_node, inserted_len: int = 0, prompt_len: int = 0):
        """The release's `RadixCache.cache_finished_req`: insert, free the duplicates and the unaligned tail,
        release the lock (no split at the prompt: that is 0.5.23's)."""
        held = self.insert(tokens, slots[: len(tokens)]).prefix_len
        self.allocator.free(slots[prefix_len:held])
        if len(slots) > len(tokens):
            self.allocator.free(slots[len(tokens) :])
        self.dec_lock_ref(last_node)
        return held

    def flush_pending_backups(self) -> None:
        return None  # a write starts its copy as it is queued

    def check_hicache_events(self):
        if self.controller is None:
            return 0, 0
        c = self.controller
        self.ready = _leading_done(c.ack_write_queue), _leading_done(c.ack_load_queue)
        before = len(c.ack_write_queue), len(c.ack_load_queue)
        self.cache.check_hicache_events()
        return before[0] - len(c.ack_write_queue), before[1] - len(c.ack_load_queue)

    def copies_in_flight(self) -> bool:
        c = self.controller
        return c is not None and bool(c.ack_write_queue or c.ack_load_queue or c.load_queue)

    def waits_on_storage(self) -> bool:
        return False

    # -- observation ------------------------------------------------------------------------------------

    def tree_slots(self) -> torch.Tensor:
        """Every device slot the tree holds (the release's `all_values_flatten` fails on an empty tree)."""
        values, nodes = [], [self.cache.root_node]
        while nodes:
            node = nodes.pop()
            nodes.extend(node.children.values())
            if node is not self.cache.root_node and node.value is not None:
                values.append(node.value)
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    def check_integrity(self, held_by_requests: int = 0) -> None:
        """Every device slot free, in the tree, or held by a request (this generation has no `sanity_check`)."""
        accounted = self.device_free() + len(self.tree_slots()) + held_by_requests
        size = self.cfg.max_total_tokens
        assert accounted == size, f"SGLang {self.version}'s device slots leaked: {accounted} accounted of {size}"

    def summary(self) -> dict:
        return {}

    def close(self) -> None:
        self.clock.close()
