"""How often legacy sync diverges under *real* latency, against fixed, over many seeds.

Real copies finish when they finish, so whether two stages see different acks depends on timing: this
measures the rate instead of asserting it. Outside `make test` (it takes minutes).

    python -m bench.divergence_rate --pp 2 --seeds 10 --delays-ms 0 2 --enable-hierarchical-cache
    PYTHONPATH=. python -m bench.divergence_rate --tp 2 --pp 2 --device cuda --check-outputs \
        --enable-hierarchical-cache --hicache-storage-backend file --seeds 2 --delays-ms 1 5 --out DIR/x.csv

Each row also keeps the run's hit rate per round, its mean step time and the first line of any crash.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from pathlib import Path

import torch

from bench.common import RESULTS, write_csv
from hicache_lab.args import add_run_flags, config_from_args
from hicache_lab.lab.binders import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser)
    parser.add_argument("--seeds", type=int, default=10, help="seeds per (delay, sync mode)")
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 2.0], help="mean injected delays")
    parser.add_argument("--out", default=str(RESULTS / "divergence_rate.csv"), help="CSV of every run")
    parser.add_argument(
        "--modes", nargs="+", default=["legacy", "fixed"], help="sync modes to compare; with --plugin, also `plugin`"
    )
    args = parser.parse_args()
    base = config_from_args(args)
    modes = [*args.modes, *(["plugin"] * bool(base.lab.plugins))]  # `plugin`: fixed with --plugin's, the rest without
    gpus = torch.cuda.device_count() if base.device == "cuda" else 0
    machine = f"{gpus}x {torch.cuda.get_device_name()}" if gpus else f"CPU ({platform.machine()})"
    rows = []
    for delay in args.delays_ms:
        for sync in modes:
            for seed in range(args.seeds):
                cfg = dataclasses.replace(
                    base,
                    cache=dataclasses.replace(base.cache, latency="real", injected_delay_ms=delay),
                    workload=dataclasses.replace(base.workload, seed=seed),
                    parallel=dataclasses.replace(base.parallel, sync="fixed" if sync == "plugin" else sync),
                ).with_lab(plugins=base.lab.plugins if sync == "plugin" else ())
                s = run(cfg, verbose=False)
                steps = [r["step_ms"] for r in s["rounds"]]
                rows.append(
                    {
                        "machine": machine,
                        "storage": cfg.cache.storage_backend,
                        "pp": cfg.parallel.pp,
                        "tp": cfg.parallel.tp,
                        "cp": cfg.parallel.cp,
                        "delay_ms": delay,
                        "sync": sync,
                        "seed": seed,
                        "diverged": s["diverged"],
                        "crashed": s["crashed"],
                        "outputs_match_reference": s["outputs_match_reference"],
                        "first_divergence_step": (s["first_divergence"] or {}).get("step"),
                        "hit_rate_by_round": " ".join(f"{r['hit_rate']:.3f}" for r in s["rounds"]),
                        "mean_step_ms": round(sum(steps) / len(steps), 2) if steps else None,
                        "error": (s["error"] or "").splitlines()[0][:160] if s["error"] else "",
                    }
                )
                print(f"delay {delay} ms, {sync:6}, seed {seed}: diverged={s['diverged']} crashed={s['crashed']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(Path(args.out), rows)
    print("\ndelay_ms  sync     diverged  crashed  (of seeds)")
    for delay in args.delays_ms:
        for sync in modes:
            group = [r for r in rows if r["delay_ms"] == delay and r["sync"] == sync]
            diverged = sum(r["diverged"] or r["crashed"] for r in group)
            print(f"{delay:8g}  {sync:7} {diverged:5}/{len(group)}  {sum(r['crashed'] for r in group):5}/{len(group)}")


if __name__ == "__main__":
    main()
