"""Running a world and reading its result: the `run` flags (`args`), what is checked before any rank starts
(`preflight`), the output directory a run owns (`outdir`), one rank wired and run (`rank`), a world of ranks
(`launch`), how its processes end (`ending`), the seam lab tooling attaches through (`binders`), the summary
(`report`) and the correctness oracle (`oracle`). SGLang: `python/sglang/srt/entrypoints/`."""
