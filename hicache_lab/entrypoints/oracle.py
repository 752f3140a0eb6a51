"""The correctness oracle: every served request against the same request computed from scratch.

A request served from cache (device, host or storage) must produce logits within `LOGIT_ATOL` of a fresh
full prefill of its prompt and answer, at every generated position, and the same tokens (where two tokens'
reference logits lie within `LOGIT_ATOL`, either counts). Together with the
controller's byte-for-byte copy checks this is `outputs_match_reference`.

The reference runs in the model's dtype. In bf16 the served KV was computed in other batches than the
reference's (a prefix in an earlier round, an answer token by token), so it differs from it by roundings, and
the logits by up to ~0.14 (measured on the tests' small workload; fp32: ~1e-5). One wrong KV token moves them
by 0.7 or more (one token of 100 in one layer of the default model, either dtype), so bf16's tolerance sits
between the two.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..managers.schedule_batch import Req
from ..mem_cache.cache_controller import CopyCheck
from ..mem_cache.memory_pool import DeviceKVPool
from ..model import ForwardBatch, TinyModel

# per --dtype: fp32 noise from a different summation order is ~1e-5, bf16's ~0.1; a wrong KV token moves logits ~1
LOGIT_ATOL = {"float32": 1e-3, "bfloat16": 0.25}


def reference_logits(model: TinyModel, req: Req) -> torch.Tensor:
    """Logits at each position that produced an output token, computed with no cache at all."""
    seq = req.prompt + req.output[:-1]
    cfg = model.cfg
    pool = DeviceKVPool(len(seq), cfg.num_layers, cfg.num_heads, cfg.head_dim, str(model.device), model.dtype)
    slots = torch.arange(len(seq))
    batch = ForwardBatch(torch.tensor(seq), slots, slots, [slots], [len(seq)])
    hidden = model.forward_layers(model.embed(batch.tokens), batch, pool)
    return model.logits(hidden[len(req.prompt) - 1 :]).cpu()


def check_outputs(model_cfg: ModelConfig, device: str, reqs: list[Req], copies: CopyCheck | None) -> dict:
    model, atol = TinyModel(model_cfg, device), LOGIT_ATOL[model_cfg.dtype]
    max_error, bad_logits, bad_tokens = 0.0, [], []
    for req in reqs:
        expected = reference_logits(model, req)
        error = (expected - torch.stack(req.logits)).abs().max().item()
        if not error <= atol:  # NaN (a read of poisoned KV) fails too
            bad_logits.append(req.rid)
        # a token is wrong where the reference prefers another by more than the noise (a near-tie may go either way)
        served = expected.gather(-1, torch.tensor(req.output)[:, None]).squeeze(-1)
        if not ((expected.max(-1).values - served) <= atol).all():
            bad_tokens.append(req.rid)
        max_error = max(max_error, error) if error == error else float("inf")
    copy_mismatches = copies.mismatched if copies else []
    return {
        "requests_checked": len(reqs),
        "max_logit_error": max_error,
        "logit_atol": atol,
        "requests_with_wrong_logits": bad_logits,
        "requests_with_wrong_tokens": bad_tokens,
        "copies_checked": copies.checked if copies else 0,
        "copy_mismatches": copy_mismatches,
        "ok": not bad_logits and not bad_tokens and not copy_mismatches,
    }
