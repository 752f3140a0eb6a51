"""SGLang's modules each adapter builds from, imported on first use (the lab runs without sglang) from the release
this process holds (releases.activate: one per process): `sglang_modules` for the `UnifiedRadixCache` API
(cache.py: 0.5.22 and 0.5.23, the venv's), `hiradix_modules` for the `HiRadixCache` one (hiradix.py: 0.5.10 to
0.5.18). Each silences what the release logs at every build, harmless here."""

from __future__ import annotations

import functools
import importlib
import logging
import types

from .cpu import install_cpu_replacements, prepare_imports, quiet_imports
from .releases import REFERENCE, activate


@functools.cache
def sglang_modules(version: str = REFERENCE):
    """SGLang's modules the adapter builds from (imported on first use: the lab runs without sglang): the venv's
    0.5.23, or release `version` of the same API (releases.py)."""
    if version == REFERENCE:
        prepare_imports()
    else:
        activate(version)
    with quiet_imports():
        from sglang.srt import server_args
        from sglang.srt.arg_groups import hicache_hook, resolution_hooks
        from sglang.srt.mem_cache import (
            base_prefix_cache,
            cache_init_params,
            l2_transfer,
            memory_pool,
            radix_cache,
            unified_radix_cache,
        )
        from sglang.srt.mem_cache.allocator import paged, token
        from sglang.srt.mem_cache.unified_cache import component_type
    install_cpu_replacements()
    # CPU events keep no time, so SGLang's copy timing is off; it says so at every copy engine it builds.
    logging.getLogger(l2_transfer.__name__).setLevel(logging.ERROR)
    # Its hook says at every build that the direct io backend turns page_first into page_first_direct.
    logging.getLogger(hicache_hook.__name__).setLevel(logging.ERROR)
    return types.SimpleNamespace(
        params=base_prefix_cache,
        RadixKey=radix_cache.RadixKey,
        UnifiedRadixCache=unified_radix_cache.UnifiedRadixCache,
        TokenAllocator=token.TokenToKVPoolAllocator,
        PagedAllocator=paged.PagedTokenToKVPoolAllocator,
        CacheInitParams=cache_init_params.CacheInitParams,
        MHATokenToKVPool=memory_pool.MHATokenToKVPool,
        ReqToTokenPool=memory_pool.ReqToTokenPool,
        FULL=component_type.ComponentType.FULL,
        ServerArgs=server_args.ServerArgs,
        publish=server_args.set_global_server_args_for_scheduler,
        run_hook=resolution_hooks.run_hook,
        handle_hicache=hicache_hook.handle_hicache,
    )


@functools.cache
def hiradix_modules(version: str):
    """The modules the HiRadixCache adapter (hiradix.py) builds from, of release `version` (0.5.10 to 0.5.18)."""
    activate(version)

    def load(name: str):
        with quiet_imports():
            return importlib.import_module(f"sglang.srt.{name}")

    params, allocator = load("mem_cache.base_prefix_cache"), load("mem_cache.allocator")
    pool, radix, common = load("mem_cache.memory_pool"), load("mem_cache.radix_cache"), load("mem_cache.common")
    server_args = load("server_args")
    logging.getLogger(server_args.__name__).setLevel(logging.ERROR)  # it says page_first becomes page_first_direct
    logging.getLogger("sglang.srt.mem_cache.l2_transfer").setLevel(logging.ERROR)  # 0.5.18: CPU events keep no time
    return types.SimpleNamespace(
        version=version,
        params=params,
        RadixKey=radix.RadixKey,
        RadixCache=radix.RadixCache,
        HiRadixCache=load("mem_cache.hiradix_cache").HiRadixCache,
        TokenAllocator=allocator.TokenToKVPoolAllocator,
        PagedAllocator=allocator.PagedTokenToKVPoolAllocator,
        CacheInitParams=load("mem_cache.cache_init_params").CacheInitParams,
        MHATokenToKVPool=pool.MHATokenToKVPool,
        ReqToTokenPool=pool.ReqToTokenPool,
        ServerArgs=server_args.ServerArgs,
        publish=server_args.set_global_server_args_for_scheduler,
        evict_from_tree_cache=common.evict_from_tree_cache,
    )
