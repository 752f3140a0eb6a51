"""Serving around the cache: requests and micro-batches (`schedule_batch`), one rank's scheduling
(`scheduler`), the pipeline-parallel event loop (`scheduler_pp`), workloads and the per-step record
(`step_trace`). SGLang: `python/sglang/srt/managers/`."""
