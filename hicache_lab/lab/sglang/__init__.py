"""SGLang as the reference: 0.5.23 imported on CPU (`cpu`), its own cache answering the lab scheduler's questions
(`cache`, `rank_cache`), a rank's cache operations recorded (`recording`) and replayed through it (`conformance`),
its source and bench_multiturn logs beside the lab's (`source`); and its older releases, each in its own code, as
a rank's cache (`releases`, `modules`, `hiradix`, `shims`)."""
