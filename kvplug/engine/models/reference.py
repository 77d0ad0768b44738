"""Dense recompute of the tiny model: no pool, no cache, no slots — the correctness oracle.

Each call runs the whole sequence from scratch with an explicit causal (and, for window layers,
sliding-window) mask. K/V are rounded through the pool's dtype, as a pool write would round
them, so a float16 pool is compared like for like. The pool-backed forward must match it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .layers import apply_rotary, gated_mlp, rms_norm, rotary_cos_sin
from .tiny import TinyModel

__all__ = ["reference_generate", "reference_logits"]


@torch.inference_mode()
def reference_logits(
    model: TinyModel, token_ids: Sequence[int], *, kv_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Logits ``[len(token_ids), vocab]`` of every position, recomputed densely."""
    c = model.config
    n = len(token_ids)
    tokens = torch.tensor(list(token_ids), dtype=torch.int64, device=model.device)
    positions = torch.arange(n, device=model.device)
    cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_theta)
    causal = positions[None, :] <= positions[:, None]
    window_mask = causal
    if c.sliding_window_size is not None:
        window_mask = causal & (positions[None, :] > positions[:, None] - c.sliding_window_size)
    group = c.num_heads // c.kv_heads
    x = model.embed[tokens]
    for i, w in enumerate(model.layers):
        h = rms_norm(x, w.attn_norm)
        q = apply_rotary((h @ w.wq).view(n, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary((h @ w.wk).view(n, c.kv_heads, c.head_dim), cos, sin)
        v = (h @ w.wv).view(n, c.kv_heads, c.head_dim)
        if kv_dtype is not None:
            k, v = k.to(kv_dtype).to(q.dtype), v.to(kv_dtype).to(q.dtype)
        k = k.repeat_interleave(group, dim=1)  # head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        mask = window_mask if model.is_window_layer(i) else causal
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, c.num_heads * c.head_dim)
        x = x + attn @ w.wo
        x = x + gated_mlp(rms_norm(x, w.mlp_norm), w.w_gate, w.w_up, w.w_down)
    return rms_norm(x, model.final_norm) @ model.lm_head


def reference_generate(
    model: TinyModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    kv_dtype: torch.dtype | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy generation recomputing everything at every step (caching off, by construction).

    Returns the generated tokens and, for each, the logits it was the argmax of.
    """
    tokens = list(prompt)
    out: list[int] = []
    logits: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        row = reference_logits(model, tokens, kv_dtype=kv_dtype)[-1]
        token = int(row.argmax())
        out.append(token)
        logits.append(row)
        tokens.append(token)
    return out, logits
