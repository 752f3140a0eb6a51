"""The figures, one module a family: `style` (the colours every figure shares, `save_figure`), `pipeline` (a
pipeline run's acks and tree digests, stage by stage), `chain` (the causal chain of a legacy run), `hit_rates`
(hit rate by round and by tier, the prefetch rate limit), `trees` (one rank's radix tree), `sync_cost`
(bench/agreement_cost.py's results), `lockstep` (its modelled pipeline's timeline as a Gantt chart),
`against_sglang` (the lab beside SGLang: bench_multiturn logs, the replay through its cache), `releases`
(`python -m hicache_lab releases`: SGLang's releases over a set of worlds, a table and a figure); and
`python -m hicache_lab figures`, which regenerates them from live runs (`--out figures`) (`regenerate`). Every
figure is drawn to a file: the room picks matplotlib's Agg backend before any of its modules imports pyplot."""

import matplotlib

matplotlib.use("Agg")
