"""A tiny real transformer whose outputs prove that cached KV is right.

Seeded weights (the same on every process), RMSNorm, RoPE attention that reads K/V from the device pool by
slot index, a SiLU MLP and greedy sampling. Logits are scaled (`logit_scale`) so the top-1 margin dwarfs float
noise: a request served from cache must pick the same tokens as one computed from scratch.

`--dtype` (fp32 by default, or bf16 as SGLang serves) is that of the weights, the activations and the KV the
pools hold. As in SGLang's kernels, RMSNorm, RoPE and the softmax compute in fp32 on bf16 inputs, and the final
norm and lm_head run in fp32, so logits are fp32 whatever the dtype.

A model instance holds a contiguous range of layers (a PP stage) and a slice of the heads (a TP shard; the
attention output and MLP are all-reduced over the TP compute group). Under CP, each peer projects K/V for
its share of the batch's tokens and the shares are all-gathered (the rest of the layer is computed on every
peer, which keeps the lab simple), so CP peers hold identical KV and must agree on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .config import ModelConfig
from .distributed.parallel_state import all_gather, all_reduce, group_rank_and_size
from .mem_cache.base import CopyEvent
from .mem_cache.memory_pool import DeviceKVPool, torch_dtype


@dataclass
class ForwardBatch:
    """The tokens of one forward pass: each request extends its sequence by `extend_lens[i]` tokens."""

    tokens: torch.Tensor  # [N] input ids, requests concatenated
    positions: torch.Tensor  # [N]
    out_slots: torch.Tensor  # [N] device slots receiving the new tokens' K/V
    seq_slots: list[torch.Tensor]  # per request: slots of its whole sequence so far, new tokens included
    extend_lens: list[int]
    load_event: CopyEvent | None = None  # layer-wise load to wait on before attention reads the pool


def _rms_norm(x: torch.Tensor, weight: float) -> torch.Tensor:
    """RMSNorm computed in fp32, returned in the dtype of `x`."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(x.dtype)


@lru_cache(maxsize=1)
def _draw(seed: int, shape: tuple[int, int, int, int], logit_scale: float, layers: range, tp_rank: int, tp_size: int):
    """The embedding, the lm_head and the weights of `layers` (this TP rank's slice), drawn in fp32 on the CPU from
    the seed, so that every process and device gets the same. Every layer is drawn, so that each stage's slice
    matches the full model's. Kept for the next model of the same shape in this process: a benchmark runs the
    same 0.9B-parameter model many times, and its draw takes 7 s of CPU time."""
    (num_layers, d, f, v), g = shape, torch.Generator().manual_seed(seed)

    def rand(*dims):
        return torch.randn(*dims, generator=g) / dims[0] ** 0.5

    heads = slice(tp_rank * d // tp_size, (tp_rank + 1) * d // tp_size)
    mlp = slice(tp_rank * f // tp_size, (tp_rank + 1) * f // tp_size)
    embed = torch.randn(v, d, generator=g)
    lm_head = rand(d, v) * logit_scale  # stays fp32: logits are fp32 in every dtype
    weights = []
    for i in range(num_layers):
        w = {
            "wq": rand(d, d)[:, heads],
            "wk": rand(d, d)[:, heads],
            "wv": rand(d, d)[:, heads],
            "wo": rand(d, d)[heads, :],
            "w_up": rand(d, f)[:, mlp],
            "w_gate": rand(d, f)[:, mlp],
            "w_down": rand(f, d)[mlp, :],
        }
        if i in layers:
            weights.append({k: t.contiguous() for k, t in w.items()})
    return embed, lm_head, weights


class TinyModel:
    def __init__(
        self,
        cfg: ModelConfig,
        device: str,
        layers: range | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        attn_tp_group=None,
        attn_cp_group=None,
    ):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), torch_dtype(cfg.dtype)
        self.layers = layers if layers is not None else range(cfg.num_layers)
        self.tp_size, self.attn_tp_group, self.attn_cp_group = tp_size, attn_tp_group, attn_cp_group
        self.cp_rank, self.cp_size = group_rank_and_size(attn_cp_group)
        shape = (cfg.num_layers, cfg.hidden_size, cfg.mlp_size, cfg.vocab_size)
        embed, lm_head, weights = _draw(cfg.seed, shape, cfg.logit_scale, self.layers, tp_rank, tp_size)
        self.embed_tokens, self.lm_head = embed.to(self.device, self.dtype), lm_head.to(self.device)
        self.weights = [{k: t.to(self.device, self.dtype) for k, t in w.items()} for w in weights]
        self.num_local_heads = cfg.num_heads // tp_size
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(half, device=self.device) / half)

    @staticmethod
    def weight_bytes(cfg: ModelConfig, layers: int, tp_size: int = 1) -> float:
        """What a model of `layers` layers (a TP rank's shard of each) holds: the embedding and the layers in the
        dtype, the lm_head in fp32, and the one whole layer `_draw` holds at a time."""
        d, v, layer = cfg.hidden_size, cfg.vocab_size, 4 * cfg.hidden_size**2 + 3 * cfg.hidden_size * cfg.mlp_size
        return 4 * v * d + torch_dtype(cfg.dtype).itemsize * (v * d + layers * layer / tp_size + layer)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A batch input on the model's device without waiting for the GPU: a blocking copy would make the CPU
        wait, at every layer, for the kernels queued before it (a layer's wait for its load among them)."""
        return t.to(self.device, non_blocking=True)

    def _rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotary angles of `positions` (on the device), [N, 1, head_dim / 2], in fp32."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos()[:, None, :], angles.sin()[:, None, :]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding, computed in fp32, returned in the dtype of `x`."""
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            all_reduce(x, self.attn_tp_group)
        return x

    def _project_kv(self, x: torch.Tensor, w: dict, cos: torch.Tensor, sin: torch.Tensor):
        """K and V of every new token. Under CP each peer projects its share of the tokens and the shares are
        gathered, so all CP peers write identical KV into their pools."""
        h, hd, n = self.num_local_heads, self.cfg.head_dim, len(x)
        if self.cp_size == 1:
            return self._rope((x @ w["wk"]).view(-1, h, hd), cos, sin), (x @ w["wv"]).view(-1, h, hd)
        share = -(-n // self.cp_size)
        rows = slice(self.cp_rank * share, min(n, (self.cp_rank + 1) * share))
        mine = torch.zeros(2, share, h, hd, device=self.device, dtype=x.dtype)
        kept = rows.stop - rows.start
        if kept > 0:
            mine[0, :kept] = self._rope((x[rows] @ w["wk"]).view(-1, h, hd), cos[rows], sin[rows])
            mine[1, :kept] = (x[rows] @ w["wv"]).view(-1, h, hd)
        gathered = [torch.empty_like(mine) for _ in range(self.cp_size)]
        all_gather(gathered, mine, self.attn_cp_group)
        kv = torch.cat(gathered, dim=1)[:, :n]
        return kv[0], kv[1]

    def check_peers_agree(self, n: int) -> None:
        """TP and CP peers must run the same batch. If their caches diverged they do not: fail with a clear
        error here rather than in a collective of mismatched sizes (an abort on gloo, a hang on NCCL)."""
        for name, group, size in (("TP", self.attn_tp_group, self.tp_size), ("CP", self.attn_cp_group, self.cp_size)):
            if size == 1:
                continue
            counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(size)]
            all_gather(counts, torch.tensor([n], device=self.device), group)
            if len({int(c) for c in counts}) > 1:
                raise RuntimeError(
                    f"{name} peers disagree on the batch: {[int(c) for c in counts]} tokens (caches diverged)"
                )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens[self._to_device(tokens)]

    def forward_layers(self, hidden: torch.Tensor, batch: ForwardBatch, pool: DeviceKVPool) -> torch.Tensor:
        """Run this stage's layers over `hidden` [N, hidden_size], writing new K/V into `pool`. What every layer
        shares (the slots, the rotary angles, each request's causal mask) is made once."""
        h, hd = self.num_local_heads, self.cfg.head_dim
        out_slots = self._to_device(batch.out_slots)
        lengths = [len(s) for s in batch.seq_slots]
        seq_slots = self._to_device(torch.cat(batch.seq_slots)).split(lengths)
        cos, sin = self._rope_angles(self._to_device(batch.positions))
        future = [  # a new token at row i sees the sequence up to its own position: masked beyond it
            torch.ones(n, t, dtype=torch.bool, device=self.device).triu(t - n + 1)
            for n, t in zip(batch.extend_lens, lengths, strict=True)
        ]
        for local, w in enumerate(self.weights):
            x = _rms_norm(hidden, 1.0)
            q = self._rope((x @ w["wq"]).view(-1, h, hd), cos, sin)
            k, v = self._project_kv(x, w, cos, sin)
            if batch.load_event is not None:
                batch.load_event.wait_layer(local)
            k_pool, v_pool = pool.buffers(local)
            k_pool[out_slots] = k
            v_pool[out_slots] = v
            outputs, start = [], 0
            for n, slots, masked in zip(batch.extend_lens, seq_slots, future, strict=True):
                qi = q[start : start + n].transpose(0, 1)  # [h, n, hd]
                ki, vi = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)  # [h, T, hd]
                scores = (qi @ ki.transpose(1, 2) / hd**0.5).masked_fill(masked, float("-inf"))
                probs = scores.softmax(-1, dtype=torch.float32).to(vi.dtype)
                outputs.append((probs @ vi).transpose(0, 1).reshape(n, h * hd))
                start += n
            hidden = hidden + self._all_reduce(torch.cat(outputs) @ w["wo"])
            x = _rms_norm(hidden, 1.0)
            mlp = torch.nn.functional.silu(x @ w["w_gate"]) * (x @ w["w_up"])
            hidden = hidden + self._all_reduce(mlp @ w["w_down"])
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the given hidden rows, [rows, vocab], in fp32 (the final norm and lm_head too)."""
        return _rms_norm(hidden.float(), 1.0) @ self.lm_head
