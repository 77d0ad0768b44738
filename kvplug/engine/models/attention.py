"""Attention over K/V read back from a kvplug pool at the slots the scheduler hands over.

One forward step batches requests with different prefix lengths. Every index tensor is built
once per step (``StepLayout``, ``KeyView``) and shared by all layers; the per-layer work is a
gather of each request's key/value rows from the pool buffers, one masked batched matmul and a
scatter back to the flat token order. No Python loop runs over tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["KeyView", "StepLayout", "attend", "key_view", "step_layout"]


class ItemLike(Protocol):
    """What attention needs of a forward item (``kvplug.engine.model.ForwardItem``)."""

    @property
    def request_id(self) -> int: ...

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def start_pos(self) -> int: ...

    @property
    def slots(self) -> torch.Tensor: ...

    @property
    def sample(self) -> bool: ...


@dataclass(frozen=True)
class StepLayout:
    """Where each request's new tokens sit in the flat batch and in the pool, for one step.

    ``B`` requests, ``Q`` the most new tokens of one request, ``L`` the longest sequence.
    """

    start: torch.Tensor  # [B] position of each request's first new token
    seq_lens: torch.Tensor  # [B] positions with K/V after this step (prefix + new)
    q_index: torch.Tensor  # [B, Q] row of each new token in the flat batch (0 where padded)
    q_valid: torch.Tensor  # [B, Q] True where a request has that many new tokens
    q_pos: torch.Tensor  # [B, Q] sequence position of each new token (padding: the last one)
    seq_slots: torch.Tensor  # [B, L] full-pool slot of every position (padding slot 0 after)
    positions: torch.Tensor  # [T] position of each new token, in flat batch order
    new_slots: torch.Tensor  # [T] full-pool slot of each new token, in flat batch order
    last_row: torch.Tensor  # [B] flat row of each request's last new token


@dataclass(frozen=True)
class KeyView:
    """The key positions one kind of layer reads: all of them, or the last ``window``."""

    slots: torch.Tensor  # [B, K] pool slots to read (padding slot 0 where not valid)
    pos: torch.Tensor  # [B, K] sequence positions of those keys
    valid: torch.Tensor  # [B, K]
    mask: torch.Tensor  # [B, Q, K] which keys each new token attends to


def step_layout(items: Sequence[ItemLike], device: torch.device) -> StepLayout:
    """Index tensors of one step; ``items[i].slots`` covers positions ``[0, start + n)``."""
    n_new = torch.tensor([len(it.token_ids) for it in items], dtype=torch.int64, device=device)
    start = torch.tensor([it.start_pos for it in items], dtype=torch.int64, device=device)
    seq_lens = start + n_new
    seq_slots = torch.nn.utils.rnn.pad_sequence(
        [it.slots.to(torch.int64) for it in items], batch_first=True, padding_value=0
    )
    got = torch.tensor([it.slots.numel() for it in items], dtype=torch.int64, device=device)
    if not torch.equal(got, seq_lens):
        bad = int((got != seq_lens).nonzero()[0, 0])
        raise ValueError(
            f"item {bad} (request {items[bad].request_id}) has "
            f"{int(got[bad])} slots for {int(seq_lens[bad])} positions "
            "(start_pos + len(token_ids))"
        )
    q_max = int(n_new.max())
    offsets = torch.cumsum(n_new, 0) - n_new
    cols = torch.arange(q_max, dtype=torch.int64, device=device)
    q_valid = cols[None, :] < n_new[:, None]
    q_index = torch.where(q_valid, offsets[:, None] + cols[None, :], 0)
    q_pos = torch.where(q_valid, start[:, None] + cols[None, :], seq_lens[:, None] - 1)
    seq_cols = torch.arange(seq_slots.shape[1], dtype=torch.int64, device=device)
    is_new = (seq_cols[None, :] >= start[:, None]) & (seq_cols[None, :] < seq_lens[:, None])
    return StepLayout(
        start=start,
        seq_lens=seq_lens,
        q_index=q_index,
        q_valid=q_valid,
        q_pos=q_pos,
        seq_slots=seq_slots,
        positions=torch.masked_select(q_pos, q_valid),
        new_slots=torch.masked_select(seq_slots, is_new),
        last_row=offsets + n_new - 1,
    )


def key_view(
    layout: StepLayout,
    window: int | None = None,
    translate: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> KeyView:
    """The keys a layer reads: every position, or (``window``) only the last ``window`` ones.

    A query at position ``p`` attends key positions ``j`` with ``j <= p`` and, for a window
    layer, ``j > p - window``. Window layers read only positions from
    ``start - window + 1`` on, so tokens that left the window (their window slots freed or
    tombstoned) are never read. ``translate`` maps full slots to the window pool's slots
    (``allocator.translate_loc_from_full_to_swa``); a needed position without a window slot is
    an error, not silently padding.
    """
    device = layout.start.device
    kstart = torch.zeros_like(layout.start)
    if window is not None:
        kstart = (layout.start - window + 1).clamp(min=0)
    k_max = int((layout.seq_lens - kstart).max())
    pos = kstart[:, None] + torch.arange(k_max, dtype=torch.int64, device=device)[None, :]
    valid = pos < layout.seq_lens[:, None]
    cols = pos.clamp(max=layout.seq_slots.shape[1] - 1)
    slots = torch.where(valid, layout.seq_slots.gather(1, cols), 0)
    if translate is not None:
        slots = torch.where(valid, translate(slots), 0)
        missing = valid & (slots == 0)
        if bool(missing.any()):
            b, k = (int(x) for x in missing.nonzero()[0])
            raise RuntimeError(
                f"batch item {b}: position {int(pos[b, k])} is inside the attention window "
                "but its full slot has no window-pool slot (freed or never mapped)"
            )
    q_pos = layout.q_pos[:, :, None]
    mask = valid[:, None, :] & (pos[:, None, :] <= q_pos)
    if window is not None:
        mask &= pos[:, None, :] > q_pos - window
    return KeyView(slots=slots, pos=pos, valid=valid, mask=mask)


def attend(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    layout: StepLayout,
    keys: KeyView,
) -> torch.Tensor:
    """Grouped-query attention of the new tokens over keys/values read from the pool buffers.

    ``q`` is ``[T, heads, head_dim]`` in flat batch order; ``k_buf``/``v_buf`` are a layer's
    pool buffers ``[rows, kv_heads, head_dim]``. Returns ``[T, heads * head_dim]``.
    """
    batch, q_max = layout.q_index.shape
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    qb = q[layout.q_index].view(batch, q_max, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    k = k_buf[keys.slots].to(q.dtype).permute(0, 2, 1, 3)[:, :, None]  # [B, kvh, 1, K, d]
    v = v_buf[keys.slots].to(q.dtype).permute(0, 2, 1, 3)[:, :, None]
    scores = (qb @ k.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))  # [B, kvh, g, Q, K]
    scores = scores.masked_fill(~keys.mask[:, None, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [B, kvh, g, Q, d]
    out = out.permute(0, 3, 1, 2, 4).reshape(batch, q_max, heads * head_dim)
    return out[layout.q_valid]
