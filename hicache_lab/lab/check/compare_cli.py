"""`python -m hicache_lab compare`: the command (compare.py does the comparing), and `compare --worlds`:
`compare` over the worlds the lab runs (pipelines of 2-4 stages, TP x PP, CP, CP x PP, L3 under each prefetch
policy, write_back with L3, pages of 1, 16 and 64 tokens, both host layouts, real latency with an injected delay,
and the seed's legacy worlds), one table row each: equal, or the differences and the docs/fidelity.md row they
fall under.

Every world runs a small workload (8 clients x 4 rounds) in a device pool small enough that the host tier is
used; L3 worlds flush the cache between rounds, so that later rounds' hits come from storage.
"""

from __future__ import annotations

import signal
from pathlib import Path

from ...args import add_run_flags, config_from_args
from ...errors import ConfigError
from ..presets import World, config
from ..sglang import releases
from ..sglang.binder import SGLANG_CACHE
from .compare import by_step, compare, with_impl
from .mutants import MUTANTS, Mutant

BASE = "--num-clients 8 --num-rounds 4 --max-total-tokens 512 --enable-hierarchical-cache"
L3 = "--hicache-storage-backend file --flush-cache-between-rounds"
WORLDS = (  # flags beyond BASE
    World("PP 2", "--pp 2"),
    World("PP 2, the proposals on", "--pp 2 --enable-fix alloc_agreement --enable-fix prefetch_vote"),
    World("PP 3", "--pp 3 --num-layers 3"),
    World("PP 4", "--pp 4"),
    World("TP 2 x PP 2", "--tp 2 --pp 2"),
    World("CP 2", "--cp 2"),
    World("CP 2 x PP 2", "--cp 2 --pp 2"),
    World("L3 wait_complete", f"{L3} --hicache-storage-prefetch-policy wait_complete"),
    World("L3 best_effort", f"{L3} --hicache-storage-prefetch-policy best_effort"),
    World("L3 timeout", f"{L3} --hicache-storage-prefetch-policy timeout"),
    World("CP 2, L3", f"--cp 2 {L3}"),
    World("write_back, L3", f"--hicache-write-policy write_back {L3}"),
    World("write_through_selective", "--hicache-write-policy write_through_selective"),
    World("page 16", "--page-size 16"),
    World("page 64, PP 2", "--page-size 64 --pp 2 --max-total-tokens 1024"),
    World("layer_first", "--hicache-mem-layout layer_first"),
    World("page_first", "--hicache-mem-layout page_first"),
    World("real latency, 2 ms delays", "--latency real --injected-delay-ms 2"),
    World("PP 2, legacy", "--pp 2 --sync legacy"),
    World("CP 2, L3, legacy", f"--cp 2 {L3} --sync legacy"),
)


def run_worlds(out: Path, binders: tuple, names: list[str] | None = None) -> list[dict]:
    """One row per world: its flags, whether both runs completed with exact outputs, and how they compare step
    by step (acks consumed, batches), rank by rank (endings, prefetch counts) and round by round (hits by tier)."""
    rows = []
    for world in WORLDS:
        if names and world.name not in names:
            continue
        out_dir = out / world.name.replace(" ", "_").replace(",", "").replace("'", "")
        result = compare(config(BASE, world.flags), out_dir, binders)
        ends = {impl: s["completed"] for impl, s in result.summaries.items()}
        exact = {impl: s["outputs_match_reference"] for impl, s in result.summaries.items()}
        rows.append(
            {
                "world": world.name,
                "flags": world.flags,
                "completed (lab, SGLang)": f"{ends['lab']}, {ends['sglang']}",
                "exact (lab, SGLang)": f"{exact['lab']}, {exact['sglang']}",
                "steps: acks, batches": _verdict([d for d in result.differences if d.quantity != "relay_sent"], "step"),
                "steps: relay sends": _verdict([d for d in result.differences if d.quantity == "relay_sent"], "step"),
                **{kind: _verdict(result.differences, kind[:-1]) for kind in ("ranks", "rounds")},
                "kept": ", ".join(row for row, _ in result.kept) if result.differences else "",
            }
        )
        alike = "equal" if result.sound else f"equal, both wrong alike ({result.wrong['lab']})"
        rows[-1]["verdict"] = alike if result.equal else "different"
        print(f"{world.name}: {rows[-1]['verdict']} (steps: {rows[-1]['steps: acks, batches']})", flush=True)
    return rows


def _verdict(differences, kind: str) -> str:
    """`equal`, or how many differences there are of this kind ("step", "rank", "round") and the first."""
    mine = [d for d in differences if d.where.startswith(kind)]
    return "equal" if not mine else f"{len(mine)}; first: {mine[0]}"


def format_worlds(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


# -- the command -------------------------------------------------------------------------------------------


def format_rounds(summaries: dict[str, dict], other: str = "SGLang") -> str:
    """Hit tokens per round and tier, the lab's beside the other side's (SGLang's)."""
    lines = [
        f"{'round':>5} {'prompt':>7}   {'lab: device':>11} {'host':>6} {'storage':>7}   {other + ': device':>14} "
        f"{'host':>6} {'storage':>7}"
    ]
    for left, right in zip(summaries["lab"]["rounds"], summaries["sglang"]["rounds"], strict=False):
        cells = [f"{r['cached_device']:>6} {r['cached_host']:>6} {r['cached_storage']:>7}" for r in (left, right)]
        lines.append(f"{left['round']:>5} {left['prompt_tokens']:>7}   {cells[0]:>25}   {cells[1]:>28}")
    return "\n".join(lines)


def add_compare_flags(parser) -> None:
    add_run_flags(parser)
    parser.add_argument("--out", default="runs/compare", help="where both runs go: OUT/lab, OUT/sglang")
    parser.add_argument("--show", type=int, default=5, help="differences to print (default 5)")
    parser.add_argument(
        "--against",
        default="sglang",
        metavar="{sglang,sglang==X,lab}",
        help="SGLang's side: sglang (0.5.23, default) or an installed release, which runs its own agreement "
        "whatever --sync says (e.g. --sync legacy --against sglang==0.5.12: the lab's legacy beside that release); "
        "lab: the lab without the --plugins, beside the lab with them",
    )
    parser.add_argument(
        "--worlds",
        action="store_true",
        help="compare over the lab's list of worlds instead (`WORLDS` in lab/check/compare_cli.py, their own "
        "workload): a table, also written to OUT/worlds.md",
    )
    parser.add_argument(
        "--mutant",
        choices=MUTANTS,
        help="a deliberate change to the lab's agreement, in the lab's run only: compare must catch it "
        "(lab/check/mutants.py)",
    )


def checked_config(args):
    """The configuration both runs start from, refused before either starts where it cannot be compared."""
    cfg = config_from_args(args)
    if cfg.lab.cache_impl != "lab":
        raise ConfigError("compare runs both caches itself: drop --cache-impl")
    if args.show < 0:
        raise ConfigError(f"--show {args.show}: give how many differences to print, 0 or more")
    if args.against == "lab" and not cfg.lab.plugins:
        raise ConfigError("--against lab compares a plug-in with the lab's own protocol: add --plugin MODULE:OBJECT")
    SGLANG_CACHE.check(with_impl(cfg, args.against))
    return cfg


def cmd_compare(args) -> int:
    """Run one world and workload with the lab's cache and with sglang 0.5.23's own (`--cache-impl sglang`),
    and compare them step by step and rank by rank: acks consumed per queue, batches, crashes, storage
    prefetches, per-round hit tokens by tier. A run that diverged, crashed or gave wrong outputs on either side
    is said first. Exit 0 equal with both runs sound, 1 different or either run wrong (the first difference
    first; a difference the lab keeps on purpose under its docs/fidelity.md row, where both runs are sound),
    2 cannot compare, 128 + signal interrupted. Two runs that diverged alike (same step, queue and values) are
    compared up to that step only, and said to hold the same bug. `--against sglang==X`: SGLang's side runs
    release X's own cache and agreement."""
    if args.worlds and args.against != "sglang":
        raise ConfigError("--worlds compares with sglang 0.5.23: drop --against (or --worlds)")
    if args.worlds:
        rows = run_worlds(Path(args.out), args.binders)
        table = format_worlds(rows)
        (Path(args.out) / "worlds.md").write_text(table + "\n")
        print(table)
        return 0 if all(r["verdict"].startswith("equal") or r["kept"] for r in rows) else 1
    cfg = checked_config(args)
    mutants = (Mutant(args.mutant),) if args.mutant else ()
    for mutant in mutants:
        mutant.check(cfg)
    result = compare(cfg, Path(args.out), args.binders, mutants, against=args.against)
    if result.interrupted:
        print(f"interrupted by {result.interrupted}: nothing compared (the runs so far are in {args.out})")
        return 128 + signal.Signals[result.interrupted]
    other = "the lab without its plug-ins" if args.against == "lab" else f"SGLang {releases.parse(args.against)}"
    for impl, label in (("lab", "lab"), ("sglang", other)):
        print(f"{label}: {result.wrong.get(impl, 'completed, never diverged; outputs match reference: True')}")
    print(format_rounds(result.summaries, "without" if args.against == "lab" else "SGLang"))
    steps = len(by_step(Path(args.out) / "lab"))
    if named := result.named:
        quantities = ", ".join(sorted({d.quantity for d in named}))
        print(f"as the plug-ins say: {len(named)} differences in {quantities} (their `differences`), set apart")
    if result.equal and result.sound:
        print(f"equal{' but for those' if named else ''}: {steps} rank-steps, every rank's ending, prefetches, rounds")
        return 0
    if first := result.diverged_alike:
        print(
            f"both diverged alike at step {first['step']} on {first['quantity']}, parting the same ranks: the same "
            "bug in both; steps compared up to it (each diverged world's later steps are its own)"
        )
        if result.equal:
            return 1
    if result.equal:
        print(f"equal, but both runs went wrong, identically ({steps} rank-steps): see above; this is no fidelity")
        return 1
    print(f"{len(result.differences)} differences; the first {min(args.show, len(result.differences))}:")
    for difference in result.differences[: args.show]:
        print(f"  {difference}")
    for row, why in result.kept:
        print(f"kept on purpose in this world (docs/fidelity.md, {row}): {why}")
    if result.differences and not result.kept:
        print("no docs/fidelity.md row explains these differences")
    return 1
