"""The ``standard`` allocator: one slot per token (page size 1), as SGLang's token allocator."""

from __future__ import annotations

from typing import Any

import torch

from kvplug_hookspecs import PoolGeometry

from ..pools import MHAKVPool
from .base import AllocatorCheckOptions, BaseAllocator, FreeIdStack, check_size

__all__ = ["StandardAllocator", "StandardAllocatorOptions"]


class StandardAllocatorOptions(AllocatorCheckOptions):
    """Options of the ``standard`` allocator."""


class StandardAllocator(BaseAllocator):
    """Hands out single slots ``1..size``; slot 0 is the padding slot and is never handed out.

    ``alloc(n)`` returns a new int64 tensor of ``n`` distinct slots, or ``None`` when fewer than
    ``n`` are free (nothing is taken then). ``pool`` may be any pool (or ``None``): the allocator
    only manages indices, so it can run over pools an engine built itself.
    """

    def __init__(
        self,
        size: int,
        *,
        device: str | torch.device = "auto",
        pool: Any = None,
        debug_checks: bool = False,
        check_bounds: bool = True,
        ownership_checks: bool = True,
    ) -> None:
        super().__init__(
            size,
            1,
            device=device,
            pool=pool,
            debug_checks=debug_checks,
            check_bounds=check_bounds,
            ownership_checks=ownership_checks,
        )
        self._stack = FreeIdStack(
            1, size, self.device, track=self.tracks_ownership, unit="slot", host=self._host
        )

    @classmethod
    def from_geometry(
        cls, geometry: PoolGeometry, options: StandardAllocatorOptions | None = None
    ) -> StandardAllocator:
        """Build the MHA pool a geometry describes and an allocator over it."""
        options = options or StandardAllocatorOptions()
        if geometry.page_size != 1:
            raise ValueError(
                f"the standard allocator hands out single slots (page_size 1), got "
                f"page_size={geometry.page_size}; use the 'paged' allocator"
            )
        pool = MHAKVPool.from_geometry(geometry)
        return cls(geometry.capacity_tokens, device=pool.device, pool=pool, **options.model_dump())

    def available_size(self) -> int:
        return len(self._stack)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` distinct free slots (int64, on ``device``), or ``None`` when short."""
        n = check_size(need_size, "need_size")
        if n > len(self._stack):
            return None
        return self._stack.pop(n)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """The paged API at page size 1: ``alloc(extend_num_tokens)``.

        With single-slot pages there is no partial page to continue, so the batch tensors are
        only checked for type, device and length, never read (no host sync).
        """
        self._batch(prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last_loc)
        return self.alloc(check_size(extend_num_tokens, "extend_num_tokens"))

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """The paged API at page size 1: one new slot per request, ``alloc(len(seq_lens))``."""
        seq, _ = self._batch(seq_lens=seq_lens, last_loc=last_loc)
        return self.alloc(seq.numel())

    def alloc_mark(self) -> int:
        return self._stack.top

    def rollback_alloc(self, mark: int) -> None:
        self._stack.rollback(mark)

    def release(self, indices: torch.Tensor) -> None:
        self._stack.push(indices)

    def _owner_stack(self) -> tuple[FreeIdStack, int]:
        return self._stack, 1

    def clear(self) -> None:
        """Every slot free again; an open free group is dropped."""
        self._stack.reset()
        self._free_group = None
