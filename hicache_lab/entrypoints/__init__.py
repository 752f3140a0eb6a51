"""Running a world and reading its result: what is checked before any rank starts (`preflight`), the output
directory a run owns (`outdir`), one rank wired and run (`rank`), a world of ranks (`launch`; its ranks forked by
`fork_server`, watched while they run by `watch`), one rank of a world `torchrun` started (`torchrun`), how its
processes end (`ending`), the Mooncake master a run starts for itself (`mooncake_master`), the seam lab tooling
attaches through (`binders`), the summary (`report`) and the correctness oracle (`oracle`). SGLang:
`python/sglang/srt/entrypoints/`."""
