"""A 12-point sweep from Python: pipeline stages x device pool x host pool ratio, as one table and one figure."""

from hicache_lab.api import sweep
from hicache_lab.lab.presets import WORKLOAD

if __name__ == "__main__":  # a run's ranks start by importing this script again: the runs go under this guard
    grid = {"--pp": [1, 2], "--max-total-tokens": [192, 256], "--hicache-ratio": [1.5, 2, 3]}
    runs = sweep(grid, base=f"{WORKLOAD} --enable-hierarchical-cache --check-outputs", out="runs/sweep")
    print(runs.shape, "(a row per run and round) at commit", *runs["provenance.commit"].unique())
    later = runs[runs["round"] >= 1].groupby(["parallel.pp", "cache.max_total_tokens", "cache.hicache_ratio"])
    means = later["hit_rate"].mean().unstack(["parallel.pp", "cache.max_total_tokens"])
    axes = means.plot(marker="o", ylabel="mean hit rate, rounds 1-3", title="L1 + L2 over the host pool's size")
    axes.figure.savefig("runs/sweep/hit_rate.png")
    print(means)
