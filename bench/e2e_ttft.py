"""End to end on a GPU: TTFT per round with and without the hierarchical cache, for a model of realistic shape.

A randomly initialised ~0.9B-parameter model (16 layers, hidden 2048, MLP 5632, 32k vocabulary, fp32) serves
long multi-turn conversations whose history outgrows the device pool, so later rounds either recompute the
history (L1 only) or copy it back from host memory (L1 + L2). Both runs use the same workload and seed;
the ratio of mean TTFT in the later rounds is the figure (target: L1 + L2 at least 2x lower).

    PYTHONPATH=. python -m bench.e2e_ttft --device cuda --latency real
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from bench.common import RESULTS
from hicache_lab.entrypoints.args import add_run_flags, config_from_args
from hicache_lab.entrypoints.launch import run

REALISTIC = {
    "num_layers": 16,
    "hidden_size": 2048,
    "num_heads": 16,
    "mlp_size": 5632,
    "vocab_size": 32000,
    "num_clients": 16,
    "num_rounds": 6,
    "request_length": 1024,
    "sub_question_input_length": 128,
    "output_length": 8,
    "max_total_tokens": 12288,
    "hicache_ratio": 4.0,
    "page_size": 64,
    "host_layout": "page_first",  # whole pages per copy: ~5x the bandwidth of layer_first (BENCHMARKS.md)
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_flags(parser, **REALISTIC)
    parser.add_argument("--later-from", type=int, default=2, help="first round counted as 'later'")
    args = parser.parse_args()
    base = config_from_args(args)
    results = {}
    for label, hicache in (("L1 only", False), ("L1 + L2", True)):
        cfg = dataclasses.replace(base, cache=dataclasses.replace(base.cache, enable_hierarchical_cache=hicache))
        print(f"=== {label} ===")
        results[label] = run(cfg, verbose=True)["rounds"]
    later = {k: [r for r in rows if r["round"] >= args.later_from] for k, rows in results.items()}
    ttft = {k: sum(r["ttft_ms"] for r in rows) / len(rows) for k, rows in later.items()}
    print(
        f"\nmean TTFT, rounds >= {args.later_from}: L1 only {ttft['L1 only']:.1f} ms, "
        f"L1 + L2 {ttft['L1 + L2']:.1f} ms, ratio {ttft['L1 only'] / ttft['L1 + L2']:.2f}x"
    )
    RESULTS.mkdir(exist_ok=True)
    out = {"workload": REALISTIC, "config": dataclasses.asdict(base), "rounds": results, "later_mean_ttft_ms": ttft}
    (RESULTS / "e2e_ttft.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
