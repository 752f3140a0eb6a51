"""The release matrix's runs (`python -m hicache_lab releases`, lab/figures/releases.py): SGLang's history in its
own code. Every installed release (`make releases`) runs as every rank's cache (`--cache-impl sglang==X`,
lab/sglang/releases.py) over a set of worlds, and each run says what that release's own code did there: diverged
(at which step, on which queue), crashed (with which error), deadlocked (a collective that never met, within
`--collective-timeout`), leaked relay sends (outstanding sends from earlier steps never reaped), or agreed with
exact outputs. A world a release cannot run is refused before any rank starts, with the reason; an interrupted
run is not judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...config import RunConfig
from ...entrypoints.launch import run_world
from ...errors import ConfigError
from ..presets import WORLD, World
from ..presets import config as preset_config
from ..sglang import releases
from ..sglang.binder import SGLANG_CACHE

BASE_FLAGS = f"{WORLD} --collective-timeout 20"  # the zoo's small world: host tier, output oracle, 3 layers


WORLDS = (
    World("PP 2", "--pp 2", key="pp2"),
    World("PP 3", "--pp 3", key="pp3"),
    World("CP 2", "--cp 2", key="cp2"),
    World("CP 2, DP attention", "--cp 2 --enable-dp-attention", key="cp2-dpa"),
    World("TP 2 x PP 2", "--tp 2 --pp 2", key="tp2pp2"),
    World("PP 2, async depth 1", "--pp 2 --pp-async-batch-depth 1", key="pp2-async"),
    World(
        "PP 2, file L3, timeout",
        "--pp 2 --hicache-storage-backend file --hicache-storage-prefetch-policy timeout",
        key="pp2-l3",
    ),
)


@dataclass
class Cell:
    release: str
    world: str
    outcome: str  # agreed, leaked, diverged, crashed, deadlocked, wrong, refused or not judged
    detail: str
    words: tuple[str, ...] = ()  # the cell in a few words, line by line (the table's and the figure's)

    def __post_init__(self) -> None:
        self.words = self.words or (self.outcome,)


def _held(outcome: str, sends: int) -> tuple[str, ...]:
    return (outcome, f"{sends} send{'s' * (sends != 1)} held") if sends else (outcome,)


def config(release: str, world: World) -> RunConfig:
    return preset_config(BASE_FLAGS, world.flags, f"--cache-impl sglang=={release}")


def judge(release: str, world: World, summary: dict) -> Cell:
    """What release `release`'s code did in `world`, from its run's summary."""
    s, sched = summary, summary.get("scheduling") or {}
    most = sched.get("max_relay_sends", 0)
    outstanding = f"at most {most} relay send{'s' * (most != 1)} outstanding"
    if s.get("interrupted"):
        return Cell(release, world.name, "not judged", f"interrupted by {s['interrupted']}")
    if s["diverged"]:
        first = s["first_divergence"]
        values = ", ".join(f"rank {r} {v}" for r, v in first["values"].items())
        then = f"; then {s['error']}" if s["crashed"] else ""
        detail = f"step {first['step']}, {first['quantity']}: {values}{then}"
        return Cell(release, world.name, "diverged", detail, ("diverged", f"step {first['step']}", first["quantity"]))
    if s["crashed"]:
        waited = "timed out" in (s["error"] or "") or "never reported" in (s["error"] or "")
        return Cell(release, world.name, "deadlocked" if waited else "crashed", s["error"])
    if s["outputs_match_reference"] is not True:
        return Cell(release, world.name, "wrong", f"outputs match reference: {s['outputs_match_reference']}")
    older, sends = sched.get("max_older_relay_sends", 0), sched.get("max_relay_sends", 0)
    if older:
        detail = f"{outstanding}, {older} of them from earlier steps; outputs exact"
        return Cell(release, world.name, "leaked", detail, _held("leaked", sends))
    return Cell(release, world.name, "agreed", f"outputs exact; {outstanding}", _held("agreed", sends))


def run_cell(release: str, world: World, out: Path) -> Cell:
    try:
        cfg = config(release, world)
        SGLANG_CACHE.check(cfg)
    except ConfigError as exc:
        return Cell(release, world.name, "refused", str(exc).split("cannot run this: ")[-1])
    summary = run_world(cfg, out / f"sglang-{release}" / world.key, verbose=False, binders=(SGLANG_CACHE,))
    return judge(release, world, summary)


def format_table(cells: list[Cell], worlds: tuple[World, ...]) -> str:
    """A markdown table, one row per world, one column per release, each cell in a few words; then every cell
    that did not agree, in full."""
    versions = list(dict.fromkeys(c.release for c in cells))
    by = {(c.release, c.world): c for c in cells}
    lines = [
        "| world | " + " | ".join(f"{v}: {releases.RELEASES[v].label}" for v in versions) + " |",
        "|---|" + "---|" * len(versions),
    ]
    for world in worlds:
        row = (", ".join(by[v, world.name].words) for v in versions)
        lines.append(f"| {world.name} | " + " | ".join(row) + " |")
    lines.append("")
    for cell in cells:
        if cell.outcome != "agreed":
            lines.append(f"* {cell.release}, {cell.world}: {cell.outcome}: {cell.detail}")
    return "\n".join(lines)
