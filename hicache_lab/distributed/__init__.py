"""How ranks agree: the rank layout and its process groups (`parallel_state`), and every cross-rank agreement
the cache makes (`cache_sync`). SGLang: `python/sglang/srt/distributed/`."""
