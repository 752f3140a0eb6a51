"""A modelled step time and TTFT: what a step did, costed on the GPU that BENCHMARKS.md measures; deterministic.

Wall-clock `ttft_ms` on a laptop measures the laptop. The lab instead keeps a modelled clock per stage
(`ModelledClock`): each step advances it by `LatencyModel.step_ms` of what the step did, and a request's modelled
TTFT is the clock after the step that sampled its first token minus the clock when it arrived. A step costs

    overhead + linear + attention + (1 - hidden) * load + storage

* linear: 2 x the stage's weights (its layers, its TP share) per token computed, prefill or decode;
* attention: 4 x hidden (its TP share) x layers per (query token, key token) pair, the causal pairs of the new
  tokens included;
* load: the KV bytes of the tokens it started loading host -> device, of which the share `hidden` runs under the
  compute (the layer-wise load);
* storage: the KV bytes of tokens read from storage for the requests it admitted;
* overhead: the lab's own work per step (scheduler, cache, bookkeeping), idle steps included.

Backups device -> host cost nothing: they run on the copy engine's own stream. KV bytes per token are the run's
(its layers, heads, head size and dtype). `--priced-as bench` prices the 0.9B model of those rows instead
(`BENCH_MODEL`, the stage's share of its layers): the run's steps, hits and loads, at a server's cost per token.
What the model leaves out is in docs/latency.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from .schedule_batch import Req


@dataclass(frozen=True)
class GpuCosts:
    """The costs of the GPU that BENCHMARKS.md measures, for the lab's fp32 model; each from the row named beside it."""

    # "Layer-wise load overlap", column "compute (prefix on device)": 512 new tokens over prefixes of 1,024-8,192
    # tokens (27.6, 32.2, 38.5, 53.1 ms), fitted as tokens x linear + pairs x attention: 45.9 us per token of the
    # 0.82B-weight model (35.8 TFLOP/s) and 6.84 ns per pair over 16 layers of hidden 2048 (19.2 TFLOP/s)
    linear_tflops: float = 35.8
    attention_tflops: float = 19.2
    # "Copy bandwidth through the lab's copy engine": load, `page_first`, page 64, one batch: 45.7 GB/s
    load_gb_per_s: float = 45.7
    # "Layer-wise load overlap": (compute + copy - overlapped) / copy, Triton rows: 0.20, 0.33, 0.37, 0.43
    load_hidden: float = 0.33
    # No row measures a store's reads: an assumed local NVMe SSD (a few GB/s)
    storage_gb_per_s: float = 5.0
    # "Where a scheduler step goes", pp 1, L1: all but the model (cache 0.10 + scheduler 0.18 + bookkeeping 0.88 +
    # unattributed 0.02 ms)
    step_overhead_ms: float = 1.18


# The model BENCHMARKS.md's GPU rows measure (bench/e2e_ttft.py, bench/load_overlap.py): `--priced-as bench`
BENCH_MODEL = ModelConfig(num_layers=16, hidden_size=2048, num_heads=16, mlp_size=5632, vocab_size=32000)


@dataclass(frozen=True)
class LatencyModel:
    """One stage's shape (weights and KV bytes per token on this rank) priced by `costs`."""

    weights: int  # weights of the stage's layers on this rank (attention and MLP; TP shares)
    attention_width: int  # layers x this rank's share of the hidden size
    kv_bytes_per_token: int  # this rank's pool: its layers and heads
    costs: GpuCosts = GpuCosts()

    @classmethod
    def of_stage(cls, model: ModelConfig, layers: int, tp: int, kv_bytes_per_token: int) -> LatencyModel:
        """The model of a rank holding `layers` layers of `model` and a 1/`tp` share of its heads and MLP; with
        `model.priced_as` "bench", of the same share of `BENCH_MODEL`'s layers (fp32 KV, K and V per layer)."""
        if model.priced_as == "bench":
            layers = max(1, round(layers * BENCH_MODEL.num_layers / model.num_layers))
            model, kv_bytes_per_token = BENCH_MODEL, layers * 2 * BENCH_MODEL.hidden_size * 4 // tp
        h, m = model.hidden_size, model.mlp_size
        return cls(layers * (4 * h * h + 3 * h * m) // tp, layers * h // tp, kv_bytes_per_token)

    def step_ms(self, extend_lens: list[int], kv_lens: list[int], loaded: int, from_storage: int) -> float:
        """A step whose requests computed `extend_lens` tokens each (1 for a decode), ending at `kv_lens` tokens of
        KV, after starting loads of `loaded` tokens and reading `from_storage` tokens from storage."""
        c = self.costs
        tokens = sum(extend_lens)
        pairs = sum(n * (end - n) + n * (n + 1) // 2 for n, end in zip(extend_lens, kv_lens, strict=True))
        compute_s = 2 * self.weights * tokens / (c.linear_tflops * 1e12)
        compute_s += 4 * self.attention_width * pairs / (c.attention_tflops * 1e12)
        load_s = (1 - c.load_hidden) * loaded * self.kv_bytes_per_token / (c.load_gb_per_s * 1e9)
        storage_s = from_storage * self.kv_bytes_per_token / (c.storage_gb_per_s * 1e9)
        return c.step_overhead_ms + 1e3 * (compute_s + load_s + storage_s)


class ModelledClock:
    """A stage's modelled clock, in ms from the run's start: advanced by each step's modelled time, or moved on to
    the next arrival when nothing runs (timed replay)."""

    def __init__(self, model: LatencyModel):
        self.model, self.now_ms = model, 0.0
        self._charged: set[int] = set()  # requests whose storage reads a step paid for

    def step(self, reqs: list[Req], extend_lens: list[int], loaded: int) -> float:
        """Advance by the step that ran `reqs` with `extend_lens`; returns the step's modelled ms."""
        fresh = [r for r in reqs if r.rid not in self._charged and r.cached_storage]
        self._charged.update(r.rid for r in fresh)
        ms = self.model.step_ms(extend_lens, [r.kv_len for r in reqs], loaded, sum(r.cached_storage for r in fresh))
        self.now_ms += ms
        return ms

    def wait_until(self, ms: float) -> None:
        self.now_ms = max(self.now_ms, ms)
