"""The cache the lab is about: one rank's tiers. In reading order: `base` (the contracts), `utils` (page
arithmetic, the page hash chain), `tree_node`, `radix_tree` (with what eviction may take),
`radix_cache` (the device-only cache), `memory_pool` / `memory_pool_host` (L1 / L2 pools), `pcie`,
`copy_engine` and `staging_ring` (how bytes move), `cache_controller` (copies and their acks), `hiradix_cache`
(the host tier: policies, acks consumed by an agreed count, eviction,
load-back and prefetched pages), `hicache_storage` and `mooncake_store` (L3 backends), `storage_tier`
(backups and prefetches), `build` (the one wiring). SGLang: `python/sglang/srt/mem_cache/`
and `managers/cache_controller.py`."""
