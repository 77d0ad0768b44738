"""A tiny decoder-only transformer whose attention lives in a kvplug pool.

Fixed-seed random weights (nothing is downloaded), grouped-query attention, rotary positions,
optional sliding-window layers. ``TinyModel.forward`` implements the reference scheduler's
``Model`` protocol: it writes each new token's K/V into the stack's pool at the slots the
allocator gave (``pool.set_kv``) and attends over every position's K/V read back from the pool
at the request's slots (cached prefix + new). Nothing is kept between steps except what the pool
holds, so a wrong slot anywhere in the cache or the scheduler changes the output; the dense
``reference_logits`` recompute, which never touches a pool, is what it is checked against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from .attention import ItemLike, attend, key_view, step_layout
from .layers import apply_rotary, gated_mlp, rms_norm, rotary_cos_sin

__all__ = ["LayerWeights", "TinyConfig", "TinyModel"]


@dataclass(frozen=True)
class TinyConfig:
    """Architecture of the tiny model; ``kv_heads``/``head_dim``/``num_layers`` must match the pool.

    ``swa_layer_ids`` are the sliding-window layers (attending to the last
    ``sliding_window_size`` positions, themselves included); empty for a full-attention model.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    sliding_window_size: int | None = None
    swa_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of kv_heads={self.kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary halves)")
        if self.swa_layer_ids and self.sliding_window_size is None:
            raise ValueError("swa_layer_ids given without a sliding_window_size")
        if any(not 0 <= i < self.num_layers for i in self.swa_layer_ids):
            raise ValueError(
                f"swa_layer_ids {list(self.swa_layer_ids)} out of range for "
                f"{self.num_layers} layers"
            )

    @classmethod
    def for_stack(cls, stack: Any, **overrides: Any) -> TinyConfig:
        """A config whose KV geometry (layers, kv heads, head dim, window layers) fits ``stack``."""
        geometry = stack.config.pool
        values: dict[str, Any] = {
            "num_layers": geometry.num_layers,
            "kv_heads": geometry.kv_heads,
            "head_dim": geometry.head_dim,
            "num_heads": 2 * geometry.kv_heads,
        }
        swa_ids = getattr(stack.pool, "swa_layer_ids", ())
        if swa_ids:
            values["swa_layer_ids"] = tuple(swa_ids)
            values["sliding_window_size"] = stack.allocator.sliding_window_size
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights (``x @ w`` convention)."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class TinyModel:
    """The tiny transformer over a kvplug stack's pool (see the module docstring).

    ``record_logits=True`` keeps the logits of every sampled position in ``logits``, keyed by
    ``(request_id, position)`` (the position of the token whose next token was sampled), so
    tests can compare them with a recompute; a re-admitted request overwrites its own entries.
    """

    def __init__(
        self,
        config: TinyConfig,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        record_logits: bool = False,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.record_logits = record_logits
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.tokens_computed = 0  # tokens whose K/V this model computed (cache hits are not)
        gen = torch.Generator().manual_seed(config.seed)
        c = config

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen) / math.sqrt(rows)
            return w.to(device=self.device, dtype=dtype)

        def norm(size: int) -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(size, generator=gen)
            return w.to(device=self.device, dtype=dtype)

        self.embed = weight(c.vocab_size, c.hidden_size) * math.sqrt(c.vocab_size)
        self.layers = [
            LayerWeights(
                attn_norm=norm(c.hidden_size),
                wq=weight(c.hidden_size, c.num_heads * c.head_dim),
                wk=weight(c.hidden_size, c.kv_heads * c.head_dim),
                wv=weight(c.hidden_size, c.kv_heads * c.head_dim),
                wo=weight(c.num_heads * c.head_dim, c.hidden_size),
                mlp_norm=norm(c.hidden_size),
                w_gate=weight(c.hidden_size, c.intermediate_size),
                w_up=weight(c.hidden_size, c.intermediate_size),
                w_down=weight(c.intermediate_size, c.hidden_size),
            )
            for _ in range(c.num_layers)
        ]
        self.final_norm = norm(c.hidden_size)
        self.lm_head = weight(c.hidden_size, c.vocab_size)

    @classmethod
    def for_stack(cls, stack: Any, *, record_logits: bool = False, **config: Any) -> TinyModel:
        """A model on the pool's device whose geometry fits it (``TinyConfig.for_stack``).

        Float32 weights; a float16/bfloat16 pool rounds the K/V it stores, as a real engine's does.
        """
        return cls(
            TinyConfig.for_stack(stack, **config),
            device=stack.pool.device,
            record_logits=record_logits,
        )

    def is_window_layer(self, layer: int) -> bool:
        return layer in self.config.swa_layer_ids

    def check_stack(self, stack: Any) -> None:
        """Refuse a pool whose geometry or window layers, or an allocator whose window, do not
        match this model: the K/V it would read would not be the K/V its layers wrote."""
        c, pool = self.config, stack.pool
        kv_heads = getattr(pool, "kv_heads", None) or pool.full.kv_heads
        head_dim = getattr(pool, "head_dim", None) or pool.full.head_dim
        got = (pool.num_layers, kv_heads, head_dim, tuple(getattr(pool, "swa_layer_ids", ())))
        want = (c.num_layers, c.kv_heads, c.head_dim, tuple(sorted(c.swa_layer_ids)))
        if got != want:
            raise ValueError(
                f"pool (layers, kv_heads, head_dim, window layers) = {got} does not match "
                f"the model's {want}"
            )
        if pool.device != self.device:
            raise ValueError(f"pool is on {pool.device}, the model on {self.device}")
        window = getattr(stack.allocator, "sliding_window_size", None)
        if c.swa_layer_ids and window != c.sliding_window_size:
            raise ValueError(
                f"the allocator keeps a {window}-token window, the model attends over "
                f"{c.sliding_window_size}"
            )

    @torch.inference_mode()
    def forward(self, stack: Any, items: Sequence[ItemLike]) -> list[int | None]:
        """One batched step: write each item's new K/V into the pool, attend, sample greedily.

        Each item's ``slots`` are the full-pool slots of positions ``[0, start_pos + n)``; the
        last ``n`` receive this step's K/V. Window layers write and read window-pool slots
        (``allocator.translate_loc_from_full_to_swa``) and read only the last
        ``sliding_window_size`` positions. Returns the argmax next token for items with
        ``sample=True``, else ``None``.
        """
        if not items:
            return []
        pool, c = stack.pool, self.config
        self.check_stack(stack)
        layout = step_layout(items, self.device)
        full_keys = key_view(layout)
        window_keys, window_new = full_keys, layout.new_slots
        if c.swa_layer_ids:
            translate = stack.allocator.translate_loc_from_full_to_swa
            window_keys = key_view(layout, c.sliding_window_size, translate)
            window_new = translate(layout.new_slots)
        tokens = torch.tensor(
            list(chain.from_iterable(it.token_ids for it in items)),
            dtype=torch.int64,
            device=self.device,
        )
        cos, sin = rotary_cos_sin(layout.positions, c.head_dim, c.rope_theta)
        n = tokens.numel()
        x = self.embed[tokens]
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.attn_norm)
            q = apply_rotary((h @ w.wq).view(n, c.num_heads, c.head_dim), cos, sin)
            k = apply_rotary((h @ w.wk).view(n, c.kv_heads, c.head_dim), cos, sin)
            v = (h @ w.wv).view(n, c.kv_heads, c.head_dim)
            window = self.is_window_layer(i)
            pool.set_kv(i, window_new if window else layout.new_slots, k, v)
            k_buf, v_buf = pool.get_kv(i)
            x = x + attend(q, k_buf, v_buf, layout, window_keys if window else full_keys) @ w.wo
            x = x + gated_mlp(rms_norm(x, w.mlp_norm), w.w_gate, w.w_up, w.w_down)
        self.tokens_computed += n
        sampled = [i for i, it in enumerate(items) if it.sample]
        out: list[int | None] = [None] * len(items)
        if not sampled:
            return out
        rows = layout.last_row[torch.tensor(sampled, device=self.device)]
        logits = rms_norm(x[rows], self.final_norm) @ self.lm_head
        for j, token in zip(sampled, logits.argmax(-1).tolist()):
            out[j] = int(token)
        if self.record_logits:
            for r, j in enumerate(sampled):
                it = items[j]
                key = (it.request_id, it.start_pos + len(it.token_ids) - 1)
                self.logits[key] = logits[r].clone()
        return out
