"""The tiny model's building blocks: RMS norm, rotary positions, a gated MLP.

Plain torch functions over explicit weight tensors, shared by the pool-backed forward pass and
the dense reference, so the two differ only in where attention reads its keys and values.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "gated_mlp", "rms_norm", "rotary_cos_sin"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Root-mean-square norm over the last dimension, scaled by ``weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` of shape ``[n, head_dim // 2]`` for the sequence positions ``positions``.

    Computed from each token's absolute position, so a token's rotation does not depend on
    whether its prefix came from the cache or was computed in the same step.
    """
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[n, heads, head_dim]``) by its tokens' angles (NeoX half-split layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def gated_mlp(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU feed-forward: ``(silu(x W_gate) * x W_up) W_down``."""
    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down
