"""The lab's wing: what exists to teach, to check or to draw, beside the core it plugs into through one seam
(entrypoints/binders.py). Its rooms, bottom up, each importing only from the ones before it:

* `plugins` - `--plugin MODULE:OBJECT`: your own protocol or policy, a binder, loaded and bound into every rank;
* `presets` - the worlds tools and tests run, as `run` flags;
* `sglang/` - SGLang 0.5.23 as the reference: importing it on CPU (`cpu`), its own cache driven by the lab's
  scheduler (`cache`), the cache-op recorder (`recording`), the conformance replay (`replay`), its source
  beside the lab's (`source`), its bench_multiturn logs (`bench_log`);
* `check/` - what shows the lab is right: faults (`faults`), the bug zoo (`zoo`), the soak (`soak`, and
  hostile input from a source checkout's tests/hostile/), the exhaustive timings (`exhaustive`);
* `teach/` - what a student runs: the tour (`tour`), the causal chain (`chain`), `--sync-impl` (`sync_impl`)
  and its audit (`sync_audit`), the exercise and its check (`exercise`);
* `figures/` - the figures, one module per family, and `python -m hicache_lab figures` (`regenerate`);
* `binders` - everything the lab binds into a run, for `python -m hicache_lab run`.

Nothing below `lab/` imports it: `hicache_lab.__main__`, `bench/` and the tests do."""
