"""Serving around the cache: requests and micro-batches (`schedule_batch`), the prefill batch's budgets
(`schedule_policy`), one rank's scheduling and a batch's results into the requests and the tree (`scheduler`),
the pipeline-parallel event loop (`scheduler_pp`), workloads (`workload`), the per-step record (`step_trace`) and
its modelled time (`latency_model`). SGLang: `python/sglang/srt/managers/`."""
