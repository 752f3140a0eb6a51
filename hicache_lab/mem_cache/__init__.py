"""The cache the lab is about: one rank's tiers. In reading order: `base` (the contracts), `radix_tree`,
`radix_cache` (the device-only cache), `memory_pool` / `memory_pool_host` (L1 / L2 pools), `pcie` and
`copy_engine` (how bytes move), `cache_controller` (copies and their acks), `hiradix_cache` (the host tier:
policies, eviction, load-back, acks consumed by an agreed count), `hicache_storage` (L3 backends),
`storage_tier` (backups and prefetches), `build` (the one wiring). SGLang: `python/sglang/srt/mem_cache/` and
`managers/cache_controller.py`."""
