"""Running a world and reading its result: the `run` flags (`args`), one rank wired and run (`rank`), a world
of ranks (`launch`), hooks the entry point installs (`--sync-impl`, `--fault`), the summary (`report`) and the
correctness oracle. SGLang: `python/sglang/srt/entrypoints/`."""
