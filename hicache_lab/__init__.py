"""hicache_lab: SGLang's hierarchical KV cache, small enough to read, real enough to break.

The core, in reading order: `config` and `parallel_config` (what a run is), `args` (the `run` flags: SGLang's
`server_args.py`), `errors`, `mem_cache` (one rank's tiers), `distributed` (the groups and how ranks agree),
`model` (a tiny real transformer), `managers` (the scheduler, SGLang's), `mooncake_trace` and `workload_files`
(workloads from outside: traces, conversation files, length distributions, a run's requests replayed; read as
checked JSON by `jsonl`), `provenance` (where a run came from, in its summary), `entrypoints`
(running a world), and the two ways in: `api` (the lab from Python: `run`, `load_runs`, `sweep`) and `__main__`
(the command line). The lab's tooling is `lab`: the core never imports it."""

__version__ = "0.1.0"
