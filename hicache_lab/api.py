"""The lab from Python: `run` one configuration, `load_runs` many into one table, `sweep` a grid of flags.

    from hicache_lab.api import run, sweep

    if __name__ == "__main__":  # a run's ranks start by importing this script again: see `run`
        one = run("--pp 2 --enable-hierarchical-cache", out="runs/one")
        print(one.rounds)
        table = sweep({"--hicache-ratio": [2, 3]}, base="--enable-hierarchical-cache", out="runs/ratios")

A configuration is `run` flags (a string, or a list of strings, as `python -m hicache_lab run` takes them) or a
`RunConfig`; `plugins` are `Binder`s (entrypoints/binders.py), bound after the lab's own. Every run's
`summary.json` holds its provenance (provenance.py); `load_runs` makes it, the configuration and each round's
numbers columns of one table."""

from __future__ import annotations

import ast
import dataclasses
import glob
import itertools
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .config import RunConfig
from .entrypoints.binders import Binder
from .errors import ConfigError
from .lab import binders, presets
from .managers.step_trace import load_trace

# pandas and tqdm are imported where they are used: a run's ranks import the calling script, and this module with
# it, and each would spend a part of a second loading them
if TYPE_CHECKING:
    import pandas as pd

SUMMARY = "summary.json"
ENDING = ("completed", "crashed", "diverged", "outputs_match_reference", "error", "elapsed_s")  # load_runs' columns


@dataclass(frozen=True)
class Run:
    """One run: its configuration, its `summary.json` (a dict) and its directory; `rounds` (a row per round: hit
    rates, modelled and wall-clock TTFT) and `trace` (a row per rank and step) as DataFrames."""

    config: RunConfig
    summary: dict
    out: Path

    @property
    def rounds(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.summary["rounds"])

    @property
    def trace(self) -> pd.DataFrame:
        return load_trace(self.out)


def config(flags: str | Sequence[str]) -> RunConfig:
    """The `RunConfig` of `run` flags, a later flag overriding an earlier one; ConfigError for what `run` refuses."""
    return presets.config(*([flags] if isinstance(flags, str) else flags))


def run(flags: str | Sequence[str] | RunConfig, out: str | Path, plugins: Iterable[Binder] = (), verbose=False) -> Run:
    """Run one configuration into the directory `out` (a new or empty one, or one a run wrote before: outdir.py),
    quietly unless `verbose` (then as `python -m hicache_lab run` prints). A run's ranks start from a fork server
    that imports the calling script again, so a script calls this under `if __name__ == "__main__":`, else it is
    refused at once (exit 2)."""
    _require_main_guard("run")
    cfg = flags if isinstance(flags, RunConfig) else config(flags)
    return Run(cfg, binders.run(cfg, Path(out), verbose, more=_binders(plugins)), Path(out))


def sweep(
    grid: dict[str, Sequence], base: str | Sequence[str] = "", out: str | Path = "runs/sweep", plugins=()
) -> pd.DataFrame:
    """Run every point of `grid` (each `run` flag's values, as {"--hicache-ratio": [2, 3], "--pp": [1, 2]}: their
    product, the last flag fastest) on `base`'s flags, each into OUT/FLAG=VALUE,... (a value True gives the bare
    flag, False leaves it out), with a progress bar; `load_runs` of every point. A point whose directory holds
    the summary of a run of the same configuration that no signal cut short is not run again: a sweep stopped
    part way resumes where it stopped. Every point's flags are checked before the first run."""
    from tqdm import tqdm

    _require_main_guard("sweep")
    for flag, values in grid.items():
        if not str(flag).startswith("--") or isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            example = "{'--hicache-ratio': [2, 3]}"
            raise ConfigError(
                f"sweep's grid maps `run` flags to lists of values, as {example}, not {flag!r}: {values!r}"
            )
    points = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    base = [base] if isinstance(base, str) else list(base)
    configs = [config([*base, *(_flag(flag, value) for flag, value in point.items())]) for point in points]
    where = [Path(out) / _name(point) for point in points]
    done = 0
    with tqdm(total=len(points), desc=f"sweep {out}", unit="run") as bar:
        for cfg, run_dir in zip(configs, where, strict=True):
            if _ran(run_dir, cfg):
                done += 1
                bar.set_postfix_str(f"{done} already run, not run again")
            else:
                run(cfg, run_dir, plugins)
            bar.update()
    return load_runs(where)


def load_runs(paths: str | Path | Iterable[str | Path]) -> pd.DataFrame:
    """One table of many runs, a row per run and round: its directory (`run`), the round's numbers (`round`,
    `hit_rate`, `cached_host`, ...), how the run ended (`completed`, `crashed`, `diverged`, ...), its configuration
    by dotted name (`cache.page_size`, `parallel.pp`, ...) and its provenance (`provenance.commit`, ...). `paths`:
    run directories, a glob of them, or a directory whose subdirectories are runs (a sweep's)."""
    runs = [run_dir for path in ([paths] if isinstance(paths, (str, Path)) else paths) for run_dir in _runs_in(path)]
    import pandas as pd

    rows = []
    for run_dir in runs:
        summary = json.loads((run_dir / SUMMARY).read_text())
        about = {key: summary.get(key) for key in ENDING} | _flat(summary["config"])
        about |= _flat(summary.get("provenance", {}), "provenance.")
        rows += [{"run": str(run_dir), **row, **about} for row in summary["rounds"] or [{}]]
    return pd.DataFrame(rows)


def _runs_in(path: str | Path) -> list[Path]:
    """The run directories `path` names (a glob if a string): those holding a summary, else their subdirectories
    that do; ConfigError where there is none."""
    named = [Path(p) for p in sorted(glob.glob(path))] if isinstance(path, str) else [Path(path)]
    runs = [
        r for p in named for r in ([p] if (p / SUMMARY).is_file() else sorted(s.parent for s in p.glob(f"*/{SUMMARY}")))
    ]
    if not runs:
        raise ConfigError(
            f"load_runs: {path} holds no run ({SUMMARY}, in it or its subdirectories): give run directories, a glob "
            "of them, or a sweep's directory"
        )
    return runs


def _flat(tree: dict, prefix: str = "") -> dict:
    """A nested dict's leaves by dotted name (lists as tuples, so a column can be grouped by)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = tuple(value) if isinstance(value, list) else value
    return flat


def _flag(flag: str, value) -> str:
    return flag if value is True else "" if value is False else f"{flag} {value}"


def _name(point: dict) -> str:
    """A point's directory: its flags and values, as `hicache-ratio=2,pp=1`."""
    name = ",".join(f"{flag.lstrip('-')}={value}" for flag, value in point.items()) or "base"
    return re.sub(r"[^\w.,=+-]", "_", name)


def _ran(run_dir: Path, cfg: RunConfig) -> bool:
    """Whether `run_dir` holds the summary of a run of `cfg` that no signal cut short."""
    try:
        summary = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return False
    return summary.get("interrupted") is None and summary.get("config") == json.loads(
        json.dumps(dataclasses.asdict(cfg))
    )


def _binders(plugins: Iterable[Binder]) -> tuple[Binder, ...]:
    plugins = tuple(plugins)
    if wrong := [p for p in plugins if not isinstance(p, Binder)]:
        raise ConfigError(f"plugins are Binder instances (hicache_lab.entrypoints.binders.Binder), not {wrong!r}")
    return plugins


def _require_main_guard(name: str) -> None:
    """Refuse at once, as the command line refuses a configuration (exit 2), a call from a script's top level
    outside `if __name__ == "__main__":`. The fork server a run starts its ranks from (multiprocessing's
    forkserver) runs the calling script again for every rank, and its top level would start the run again there:
    every rank would fail, with nothing to say why. Jupyter, `python -c` and the REPL have no script to run again."""
    main = sys.modules["__main__"]
    frame, script = sys._getframe(1), getattr(main, "__file__", None)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None or script is None:  # not called from a script's code: Jupyter, `python -c`, the REPL
        return
    try:
        body = ast.parse(Path(script).read_text()).body
    except (OSError, SyntaxError, ValueError):  # no source to read: nothing to check
        return
    top = next((node for node in body if node.lineno <= frame.f_lineno <= node.end_lineno), None)
    if top is None or (isinstance(top, ast.If) and ast.unparse(top.test).replace("'", '"') == '__name__ == "__main__"'):
        return
    print(
        f"configuration error: hicache_lab.api.{name} is called from the top level of {script}, line "
        f"{frame.f_lineno}, which every rank of the run would run again (it imports the script): put the calls "
        'under `if __name__ == "__main__":`',
        file=sys.stderr,
    )
    raise SystemExit(2)
