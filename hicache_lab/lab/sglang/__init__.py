"""SGLang as the reference: 0.5.23 imported on CPU (`cpu`), its own cache answering the lab scheduler's questions
(`cache`, `rank_cache`) in its place in a world (`world`), bound into a run (`binder`), the seed's bugs put back
into it (`reverts`); a rank's cache operations recorded (`recording`) and replayed through it (`replay`, copies
completed as recorded by `completion`; the command in `conform_cli`); its source beside the lab's (`source`); its
bench_multiturn logs (`bench_log`); and its older releases, each in its own code, as a rank's cache (`releases`,
`modules`, `hiradix`, `shims`)."""
