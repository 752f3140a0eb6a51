"""The worlds the lab's tools and tests run, each defined once, in `run` flags: a command that a tool prints is
the world it ran, and `config(...)` turns the same flags into a `RunConfig`.

* `WORKLOAD` - 4 clients x 4 rounds (32-token openings, 16-token follow-ups, 8-token answers) over a 256-token
  device pool: small, and still large enough to overflow it, so write-through, eviction and load-back all happen.
* `WORLD` - that workload with the host tier and the output oracle on 3 layers (so PP stages hold different
  layer counts): the bug zoo, the exercises and the multi-rank tests add their world size and faults to it.
* `World` - one world of a tool's list (the exercise's, `compare --worlds`', the release matrix's): a name and
  its flags.
* `TIER_WORKLOAD` / `TIER_CACHES` - one rank whose history outgrows device and host (8 conversations of 5 turns): the
  hit rate per tier (figures, notebook 04). The storage run's prefetch threshold, 24 tokens, is above a turn's
  new tokens (16 beyond what the tree holds): from round 1 only a prompt whose history the host dropped asks storage.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..args import add_run_flags, config_from_args
from ..config import RunConfig
from ..errors import ConfigError

BENCH_RESULTS = Path("bench/results")  # the repository's results folder (bench/common.RESULTS), from its root
WORKLOAD = (
    "--max-total-tokens 256 --hicache-ratio 3 --num-clients 4 --num-rounds 4 --request-length 32 "
    "--sub-question-input-length 16 --output-length 8"
)
WORLD = f"--num-layers 3 {WORKLOAD} --enable-hierarchical-cache --check-outputs"
TIER_WORKLOAD = (
    "--max-total-tokens 256 --num-clients 8 --num-rounds 5 --request-length 32 --sub-question-input-length 16 "
    "--output-length 8"
)
TIER_CACHES = {  # CacheConfig fields of each tier stack
    "L1": {},
    "L1 + L2": {"enable_hierarchical_cache": True},
    "L1 + L2 + L3": {"enable_hierarchical_cache": True, "storage_backend": "file", "prefetch_threshold": 24},
}


@dataclass(frozen=True)
class World:
    """A world a tool runs, in its list of worlds: its name as the tool prints it, and its `run` flags beyond the
    tool's own workload; `key`, its name on the command line where the tool lets one pick worlds."""

    name: str
    flags: str
    key: str = ""


class _Refusing(argparse.ArgumentParser):
    """A parser of `run` flags that raises, for a flag it cannot take, what a bad value raises: a ConfigError."""

    def error(self, message: str):
        raise ConfigError(f"{message} (`python -m hicache_lab run --help` lists the flags and their values)")


def config(*flags: str) -> RunConfig:
    """The `RunConfig` of these `run` flags (a later flag overrides an earlier one); ConfigError for a flag or value
    `run` would refuse."""
    parser = _Refusing()
    add_run_flags(parser)
    return config_from_args(parser.parse_args(" ".join(flags).split()))


def tier_config(device: str = "cpu", **cache) -> RunConfig:
    """`TIER_WORKLOAD` on `device` with these CacheConfig fields (one of `TIER_CACHES`): from round 2 the histories
    outgrow the 512-token host pool too (ratio 2), and from round 3 the storage tier finds what the host dropped."""
    cfg = config(TIER_WORKLOAD, f"--device {device}")
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, **cache))
