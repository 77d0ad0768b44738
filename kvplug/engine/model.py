"""The model interface of the reference scheduler: what a forward pass is given and returns.

The scheduler owns memory (which slots each position uses); the model owns compute. A model
writes the K/V of each item's new tokens into the pool at the item's last slots and attends over
all of the item's slots, reading back from the pool, so a wrong slot anywhere shows in its output.
``model=None`` is the simulator: no K/V is computed and the next tokens are the request's given
output tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..stack import KVCacheStack

__all__ = ["ForwardItem", "Model"]


@dataclass(frozen=True)
class ForwardItem:
    """One request's part of a forward batch.

    ``token_ids`` are the tokens whose K/V this step computes (a prompt chunk, or the last sampled
    token), starting at sequence position ``start_pos``. ``slots`` are the int64 full-pool slots
    of positions ``[0, start_pos + len(token_ids))`` on the pool's device: the cached prefix,
    earlier chunks, then this step's new slots (the last ``len(token_ids)``). ``sample`` is true
    when the step reaches the end of the sequence (the last prompt chunk, or a decode step): the
    model then returns the next token.
    """

    request_id: int
    token_ids: Sequence[int]
    start_pos: int
    slots: torch.Tensor
    sample: bool


class Model(Protocol):
    """What the reference scheduler calls once per step with every scheduled request."""

    def forward(self, stack: KVCacheStack, items: Sequence[ForwardItem]) -> list[int | None]:
        """Write K/V of each item's ``token_ids`` at its last ``len(token_ids)`` slots (every
        layer), attend over all its slots (window layers: the last ``sliding_window_size``
        positions, translated with ``allocator.translate_loc_from_full_to_swa``), and return the
        greedy next token for items with ``sample=True`` (``None`` for the others)."""
        ...
