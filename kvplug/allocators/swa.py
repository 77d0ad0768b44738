"""The ``swa`` allocator: full-attention and sliding-window slots for hybrid models.

Every token gets a slot in the full pool (its index is what the engine sees) and a slot in the
smaller window pool; ``full_to_swa_index_mapping[full_slot]`` is the window slot, 0 when the
token has none (slot 0 of the window pool is padding, so reads and writes through an unmapped
entry land in padding). When tokens slide out of the window, ``free_swa`` returns only their
window slots. Matches SGLang's SWATokenToKVPoolAllocator.

With pages (``page_size > 1``) both sides are paged allocators that move in lockstep: a full
page maps slot for slot onto one window page, so freeing either side works on whole pages, as
in the ``paged`` allocator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field, field_validator

from kvplug_hookspecs import EvictParams, PoolGeometry

from ..pools import HybridSWAKVPool, check_index_tensor
from .base import AllocatorCheckOptions, BaseAllocator, FreeIdStack, check_size
from .paged import PagedAllocator
from .standard import StandardAllocator

__all__ = ["SWAAllocator", "SWAAllocatorOptions", "default_swa_layer_ids"]


def default_swa_layer_ids(num_layers: int, full_attention_interval: int) -> tuple[int, ...]:
    """Layer ``i`` is full attention iff ``(i + 1) % interval == 0``, else sliding window.

    Interval 2 is GPT-OSS's alternation (0 window, 1 full, ...); 6 is Gemma 3's 5 local : 1 global.
    """
    return tuple(i for i in range(num_layers) if (i + 1) % full_attention_interval)


class SWAAllocatorOptions(AllocatorCheckOptions):
    """Options of the ``swa`` allocator; the full pool's size is the geometry's capacity."""

    swa_capacity_tokens: int = Field(strict=True, gt=0, description="slots of the window pool")
    sliding_window_size: int = Field(strict=True, gt=0, description="attention window in tokens")
    swa_layer_ids: tuple[int, ...] | None = Field(
        None,
        description="sliding-window layers; default: the layers full_attention_interval "
        "does not make full",
    )
    full_attention_interval: int = Field(
        2,
        strict=True,
        gt=0,
        description="with swa_layer_ids unset: every Nth layer is full attention",
    )

    @field_validator("swa_layer_ids")
    @classmethod
    def _distinct_non_negative(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError(
                "swa_layer_ids is empty; use the 'standard' allocator for a model without "
                "window layers"
            )
        if any(i < 0 for i in value) or len(set(value)) != len(value):
            raise ValueError(
                f"swa_layer_ids must be distinct non-negative layer ids, got {list(value)}"
            )
        return tuple(sorted(value))


class SWAAllocator(BaseAllocator):
    """A full-attention allocator and a window allocator with a full->window index map.

    ``size`` is the full pool's capacity, ``swa_size`` the window pool's. Every allocation
    (``alloc``, ``alloc_extend``, ``alloc_decode``) takes slots in both pools or in neither;
    ``available_size()`` is the smaller of the two free counts. ``free`` returns both sides (the
    window side where still mapped); ``free_swa`` only the window side, always immediately, even
    inside a free group.
    """

    _one_stack = False  # the window pool's slots are freed and owned too (release, _set_owner)

    def __init__(
        self,
        size: int,
        swa_size: int,
        sliding_window_size: int,
        *,
        page_size: int = 1,
        device: str | torch.device = "auto",
        pool: Any = None,
        debug_checks: bool = False,
        check_bounds: bool = True,
        ownership_checks: bool = True,
    ) -> None:
        super().__init__(
            size,
            page_size,
            device=device,
            pool=pool,
            debug_checks=debug_checks,
            check_bounds=check_bounds,
            ownership_checks=ownership_checks,
        )
        if (
            isinstance(sliding_window_size, bool)
            or not isinstance(sliding_window_size, int)
            or sliding_window_size <= 0
        ):
            raise ValueError(
                f"sliding_window_size must be a positive int, got {sliding_window_size!r}"
            )
        checks: dict[str, Any] = {
            "device": self.device,
            "debug_checks": debug_checks,
            "check_bounds": check_bounds,
            "ownership_checks": ownership_checks,
        }
        full_pool, swa_pool = getattr(pool, "full", None), getattr(pool, "swa", None)
        self.full_allocator: StandardAllocator | PagedAllocator
        self.swa_allocator: StandardAllocator | PagedAllocator
        if page_size == 1:
            self.full_allocator = StandardAllocator(size, pool=full_pool, **checks)
            self.swa_allocator = StandardAllocator(swa_size, pool=swa_pool, **checks)
        else:
            self.full_allocator = PagedAllocator(size, page_size, pool=full_pool, **checks)
            self.swa_allocator = PagedAllocator(swa_size, page_size, pool=swa_pool, **checks)
        self.swa_size = swa_size
        self.sliding_window_size = sliding_window_size
        self.full_to_swa_index_mapping = torch.zeros(
            size + page_size, dtype=torch.int64, device=self.device
        )
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)

    @classmethod
    def from_geometry(cls, geometry: PoolGeometry, options: SWAAllocatorOptions) -> SWAAllocator:
        """Build a hybrid pool (full + window) and the allocator over it."""
        if options.swa_capacity_tokens % geometry.page_size:
            raise ValueError(
                f"swa_capacity_tokens={options.swa_capacity_tokens} is not a multiple of "
                f"page_size={geometry.page_size}"
            )
        swa_ids = options.swa_layer_ids
        if swa_ids is None:
            swa_ids = default_swa_layer_ids(geometry.num_layers, options.full_attention_interval)
        out_of_range = [i for i in swa_ids if i >= geometry.num_layers]
        if out_of_range:
            raise ValueError(
                f"swa_layer_ids {out_of_range} out of range: the model has "
                f"{geometry.num_layers} layer(s)"
            )
        full_ids = [i for i in range(geometry.num_layers) if i not in set(swa_ids)]
        pool = HybridSWAKVPool(
            geometry.capacity_tokens,
            options.swa_capacity_tokens,
            full_layer_ids=full_ids,
            swa_layer_ids=swa_ids,
            kv_heads=geometry.kv_heads,
            head_dim=geometry.head_dim,
            page_size=geometry.page_size,
            dtype=geometry.dtype,
            device=geometry.device,
            store_kv=geometry.store_kv,
        )
        return cls(
            geometry.capacity_tokens,
            options.swa_capacity_tokens,
            options.sliding_window_size,
            page_size=geometry.page_size,
            device=pool.device,
            pool=pool,
            debug_checks=options.debug_checks,
            check_bounds=options.check_bounds,
            ownership_checks=options.ownership_checks,
        )

    @property
    def size_full(self) -> int:
        return self.size

    def full_available_size(self) -> int:
        return self.full_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_allocator.available_size()

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    # -- allocation: both sides or neither -------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` full slots, each mapped to a new window slot; ``None`` if one is short."""
        n = check_size(need_size, "need_size")
        if n % self.page_size:
            raise ValueError(f"need_size={n} is not a multiple of page_size={self.page_size}")
        if n > self.full_available_size() or n > self.swa_available_size():
            return None
        full, swa = self.full_allocator.alloc(n), self.swa_allocator.alloc(n)
        assert full is not None and swa is not None  # both sides had room
        return self._map(full, swa)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """The ``paged`` allocator's ``alloc_extend`` on both sides; ``last_loc`` are full slots.

        Each request's window side continues the window page of its last full slot, which must
        still be mapped when that page is partial. Returns full slots, or ``None`` when either
        side is short (nothing taken).
        """
        swa_last = self._window_last_loc(last_loc)
        return self._both(
            lambda a, last: a.alloc_extend(prefix_lens, seq_lens, last, extend_num_tokens),
            last_loc,
            swa_last,
        )

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """The ``paged`` allocator's ``alloc_decode`` on both sides (see ``alloc_extend``)."""
        swa_last = self._window_last_loc(last_loc)
        return self._both(lambda a, last: a.alloc_decode(seq_lens, last), last_loc, swa_last)

    def _both(
        self, alloc: Callable[[Any, Any], torch.Tensor | None], full_last: Any, swa_last: Any
    ) -> torch.Tensor | None:
        """Allocate on the full side, then the window side; undo the first if the second fails."""
        full_side = self.full_allocator
        mark = full_side.alloc_mark()  # allocations only pop: moving the top back undoes them
        full = alloc(self.full_allocator, full_last)
        if full is None:
            return None
        try:
            swa = alloc(self.swa_allocator, swa_last)
        except Exception:
            full_side.rollback_alloc(mark)
            raise
        if swa is None:
            full_side.rollback_alloc(mark)
            return None
        return self._map(full, swa)

    def _window_last_loc(self, last_loc: torch.Tensor) -> torch.Tensor:
        """Window slots of the requests' last full slots; -1 stays -1 (an empty prefix)."""
        self._batch(last_loc=last_loc)
        if self.page_size == 1:
            return last_loc  # single-slot pages: there is no partial page to continue
        last = last_loc.to(torch.int64)
        inside = (last >= 0) & (last <= self._high)
        window = self.full_to_swa_index_mapping.index_select(0, torch.where(inside, last, 0))
        return torch.where(inside, window, -1)

    def _map(self, full: torch.Tensor, swa: torch.Tensor) -> torch.Tensor:
        self.full_to_swa_index_mapping.scatter_(0, full, swa)
        return full

    # -- freeing ---------------------------------------------------------------------------------
    # index_select / scatter_ / index_fill_ / masked_select rather than ``map[idx]`` and
    # ``x[mask]``: same results, several times faster on the CPU for large batches.
    def _page_slots(self, indices: torch.Tensor) -> torch.Tensor:
        """Every slot of the pages ``indices`` touch: freeing works on whole pages."""
        if self.page_size == 1:
            return indices
        assert isinstance(self.full_allocator, PagedAllocator)  # page_size > 1
        pages: torch.Tensor = self.full_allocator.pages_of(indices)
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def release(self, indices: torch.Tensor) -> None:
        slots = self._page_slots(indices)
        swa = self.full_to_swa_index_mapping.index_select(0, slots)
        mapped = torch.masked_select(swa, swa > 0)
        self.full_allocator.release(indices)  # raises (changing nothing) on a debug double free
        self.swa_allocator.release(mapped)
        self.full_to_swa_index_mapping.index_fill_(0, slots, 0)

    def _owner_stack(self) -> tuple[FreeIdStack, int]:
        return self.full_allocator._owner_stack()

    def _set_owner(self, indices: torch.Tensor, state: int) -> None:
        """Both pools: the full slots and the window slots they still map to."""
        swa = self.full_to_swa_index_mapping.index_select(0, indices)
        self.full_allocator._set_owner(indices, state)
        self.swa_allocator._set_owner(torch.masked_select(swa, swa > 0), state)

    def move_swa(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Give full slots ``dst`` (whose window side was freed) the window slots of ``src``.

        A swa_radix cache revives a window tombstone that a running request still reads in
        full from that request's fresh window KV (SGLang's recovery with a locked full side):
        ``dst`` keeps its full slots and gains ``src``'s window slots, ``src`` loses them (so a
        later ``free(src)`` frees only its full side). Slot for slot; checked before anything
        changes: the same length, ``dst`` unmapped, ``src`` mapped (one host sync).
        """
        src = self._check_indices(src, values=False)
        dst = self._check_indices(dst, values=False)
        if src.numel() != dst.numel():
            raise ValueError(f"move_swa: {src.numel()} source slots but {dst.numel()} targets")
        if src.numel() == 0:
            return
        self._check_values(torch.cat([src, dst]))
        window = self.full_to_swa_index_mapping.index_select(0, src)
        unmapped_src, mapped_dst = torch.stack(
            [(window <= 0).sum(), (self.full_to_swa_index_mapping.index_select(0, dst) > 0).sum()]
        ).tolist()
        if unmapped_src or mapped_dst:
            raise ValueError(
                f"move_swa: {unmapped_src} source slot(s) have no window slot and "
                f"{mapped_dst} target slot(s) still have one"
            )
        self.full_to_swa_index_mapping.index_fill_(0, src, 0)
        self.full_to_swa_index_mapping.scatter_(0, dst, window)

    def free_swa(self, indices: torch.Tensor) -> None:
        """Free only the window slots (pages) of these full slots: tokens that left the window."""
        indices = self._check_indices(indices)
        if indices.numel() == 0:
            return
        slots = self._page_slots(indices)
        swa = self.full_to_swa_index_mapping.index_select(0, slots)
        self.swa_allocator.release(torch.masked_select(swa, swa > 0))
        self.full_to_swa_index_mapping.index_fill_(0, slots, 0)

    def translate_loc_from_full_to_swa(self, indices: torch.Tensor) -> torch.Tensor:
        """Window slots of full slots (0, the window padding slot, where unmapped). One gather.

        ``-1`` (no previous location, as SGLang's kernels pass) maps to ``-1``. The tensor's type
        and device are always checked; with ``check_bounds`` (the default) other values outside
        ``0..size + page_size - 1`` are an error (one host sync, like ``free``'s range check),
        never an out-of-bounds device read.
        """
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
        check_index_tensor(indices.reshape(-1), self.device)
        flat = indices.reshape(-1).to(torch.int64)
        if flat.numel() and (self.check_bounds or self.tracks_ownership):
            lo, hi = torch.stack(torch.aminmax(flat)).tolist()
            for value in (lo, hi):
                if not -1 <= value <= self._high:
                    raise ValueError(
                        f"slot {value} out of range: full slots are 0..{self._high} (or -1)"
                    )
        missing = flat < 0
        mapped = self.full_to_swa_index_mapping.index_select(0, flat.clamp(min=0))
        return torch.where(missing, -1, mapped).view(indices.shape)

    def shortfall(self, num_tokens: int) -> EvictParams | None:
        """Per-pool shortfall: ``n - full_available``, ``n - swa_available``, clipped at 0.

        Each is rounded up to whole pages; None when both are 0.
        """
        n = check_size(num_tokens, "num_tokens")
        ps = self.page_size
        full = -(-max(0, n - self.full_available_size()) // ps) * ps
        swa = -(-max(0, n - self.swa_available_size()) // ps) * ps
        if full == 0 and swa == 0:
            return None
        return EvictParams(num_tokens=full, swa_num_tokens=swa)

    def clear(self) -> None:
        """Both pools free again, the map emptied; an open free group is dropped."""
        self.full_allocator.clear()
        self.swa_allocator.clear()
        self.full_to_swa_index_mapping.zero_()
        self._free_group = None

    def __repr__(self) -> str:
        return (
            f"SWAAllocator(size={self.size}, swa_size={self.swa_size}, page_size={self.page_size}, "
            f"sliding_window_size={self.sliding_window_size}, "
            f"full_available={self.full_available_size()}, "
            f"swa_available={self.swa_available_size()}, device={self.device})"
        )
