"""What the built-in allocators share: a device free-id stack, index checks, free groups, shortfall.

Cost model (documented in the README): ``alloc``/``free`` are a few device ops each and never
reallocate. Checks that only read tensor metadata (type, dtype, rank, device) always run, at the
call. The range check of freed indices (``check_bounds``, on by default) reduces the indices and
reads two numbers back: one host sync per ``free`` call, or per free group, whose indices are
checked together at ``free_group_end``. Turn it off where a sync would stall an overlap
scheduler. ``debug_checks`` checks every call at once and adds a device mask of free ids that
catches double frees.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import Field

from kvplug_hookspecs import EvictParams, FrozenModel

from ..pools import check_index_tensor, resolve_device

__all__ = ["AllocatorCheckOptions", "BaseAllocator", "FreeIdStack", "check_size"]


class AllocatorCheckOptions(FrozenModel):
    """Safety checks every built-in allocator offers."""

    debug_checks: bool = Field(
        False, strict=True, description="track free slots on the device and reject double frees"
    )
    check_bounds: bool = Field(
        True,
        strict=True,
        description="range-check freed indices (one host sync per free call or free group)",
    )


def check_size(value: Any, what: str) -> int:
    """A non-negative integer count (``alloc(-1)``, ``shortfall(2.5)`` are errors, not clamps)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    return n


class FreeIdStack:
    """Free ids (slots or pages) kept in a preallocated int64 device tensor used as a stack.

    The free ids are ``ids[top:]``: ``pop(n)`` hands out ``ids[top:top + n]`` and ``push``
    writes just below ``top``. Each is one slice copy, with no ``torch.cat`` and no
    reallocation (vLLM's O(1) free list, on a device tensor); recently freed ids are reused first.
    ``track=True`` keeps a device bool mask ``is_free`` that rejects double frees (debug mode).
    """

    def __init__(
        self, first: int, count: int, device: torch.device, *, track: bool, unit: str
    ) -> None:
        self.first, self.count, self.unit = first, count, unit
        self._ids = torch.empty(count, dtype=torch.int64, device=device)
        self.is_free = (
            torch.empty(first + count, dtype=torch.bool, device=device) if track else None
        )
        self.top = 0
        self.reset()

    def reset(self) -> None:
        """Every id free again, in ascending order (the first ``pop`` returns ``first, ...``)."""
        torch.arange(self.first, self.first + self.count, out=self._ids)
        self.top = 0
        if self.is_free is not None:
            self.is_free.fill_(True)
            self.is_free[: self.first] = False

    def __len__(self) -> int:
        return self.count - self.top

    def pop(self, n: int) -> torch.Tensor:
        """Take ``n <= len(self)`` ids as a new tensor (callers check the count first)."""
        out = self._ids[self.top : self.top + n].clone()
        self.top += n
        if self.is_free is not None:
            self.is_free.index_fill_(0, out, False)
        return out

    def rollback(self, top: int) -> None:
        """Undo the pops made since ``top`` was read, when nothing was pushed in between.

        ``pop`` leaves the ids in place below the new top, so moving the top back restores them.
        """
        if self.is_free is not None and top < self.top:
            self.is_free.index_fill_(0, self._ids[top : self.top], True)
        self.top = top

    def push(self, ids: torch.Tensor) -> None:
        """Return ids to the stack; raises (changing nothing) on a detectable double free."""
        n = ids.numel()
        if n > self.top:
            raise ValueError(
                f"freeing {n} {self.unit}(s) but only {self.top} are allocated: "
                "some are freed twice"
            )
        if self.is_free is not None:
            self._check_not_free(ids)
        self._ids[self.top - n : self.top] = ids
        self.top -= n
        if self.is_free is not None:
            self.is_free.index_fill_(0, ids, True)

    def _check_not_free(self, ids: torch.Tensor) -> None:
        assert self.is_free is not None
        already = self.is_free.index_select(0, ids)
        if bool(already.any()):
            raise ValueError(f"{self.unit} {int(ids[already][0])} is already free (double free)")
        if ids.numel() > 1:
            s = torch.sort(ids).values
            dup = s[1:] == s[:-1]
            if bool(dup.any()):
                raise ValueError(f"{self.unit} {int(s[1:][dup][0])} is freed twice in one call")


class BaseAllocator:
    """Free groups, index checks and the shortfall contract of the built-in allocators.

    Subclasses set ``_low``/``_high`` (the valid slot range) and implement ``available_size``,
    ``alloc``, ``clear``, ``release`` (free already-checked indices; raise before changing
    anything) and the ``alloc_mark`` / ``rollback_alloc`` pair (undo allocations exactly).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        *,
        device: str | torch.device,
        pool: Any,
        debug_checks: bool,
        check_bounds: bool,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size must be an int, got {type(size).__name__}")
        if size <= 0:
            raise ValueError(f"size (capacity in tokens) must be > 0, got {size}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if size % page_size:
            raise ValueError(f"size={size} is not a multiple of page_size={page_size}")
        self.size = size
        self.page_size = page_size
        self.device = resolve_device(device)
        self.pool = pool
        self.debug_checks = bool(debug_checks)
        self.check_bounds = bool(check_bounds)
        self._low, self._high = page_size, size + page_size - 1
        self._free_group: list[torch.Tensor] | None = None

    # -- to implement -------------------------------------------------------------------------
    def available_size(self) -> int:
        raise NotImplementedError

    def release(self, indices: torch.Tensor) -> None:
        """Free indices that already passed ``free``'s checks (a composite allocator's call)."""
        raise NotImplementedError

    def alloc_mark(self) -> int:
        """A mark to pass to ``rollback_alloc``: allocations after it can be undone exactly."""
        raise NotImplementedError

    def rollback_alloc(self, mark: int) -> None:
        """Undo the allocations made since ``alloc_mark()`` (nothing may be freed in between)."""
        raise NotImplementedError

    # -- freeing ------------------------------------------------------------------------------
    def free(self, indices: torch.Tensor) -> None:
        """Return slots to the allocator (deferred to ``free_group_end`` inside a free group)."""
        indices = self._check_indices(indices, values=self._free_group is None or self.debug_checks)
        if indices.numel() == 0:
            return
        if self._free_group is not None:
            self._free_group.append(indices)
        else:
            self.release(indices)

    def free_group_begin(self) -> None:
        """Start collecting frees; ``free_group_end`` releases them with one call."""
        if self._free_group is not None:
            raise RuntimeError("free_group_begin() called inside a free group (groups do not nest)")
        self._free_group = []

    def free_group_end(self) -> None:
        """Release everything freed since ``free_group_begin`` at once, after one range check.

        The group is closed even if a check fails (an index out of range, a debug-mode double
        free): then nothing of the group is freed.
        """
        if self._free_group is None:
            raise RuntimeError("free_group_end() called without free_group_begin()")
        group, self._free_group = self._free_group, None
        if group:
            indices = group[0] if len(group) == 1 else torch.cat(group)
            if not self.debug_checks:  # debug mode checked every call already
                self._check_values(indices)
            self.release(indices)

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """``with allocator.free_group(): ...`` frees once at the end of the block."""
        self.free_group_begin()
        try:
            yield
        finally:
            self.free_group_end()

    @property
    def in_free_group(self) -> bool:
        return self._free_group is not None

    def _batch(self, **tensors: torch.Tensor) -> list[torch.Tensor]:
        """Metadata checks of the per-request tensors of ``alloc_extend``/``alloc_decode``."""
        sizes = set()
        for name, t in tensors.items():
            check_index_tensor(t, self.device, name)
            sizes.add(t.numel())
        if len(sizes) > 1:
            raise ValueError(
                "batch tensors differ in length: "
                + ", ".join(f"{n}={t.numel()}" for n, t in tensors.items())
            )
        return [t.to(torch.int64) for t in tensors.values()]

    def _check_indices(self, indices: torch.Tensor, *, values: bool = True) -> torch.Tensor:
        """Check freed indices (metadata, and their range when ``values``); return them as int64."""
        check_index_tensor(indices, self.device)
        indices = indices.to(torch.int64)
        if values:
            self._check_values(indices)
        return indices

    def _check_values(self, indices: torch.Tensor) -> None:
        """Range check (one host sync), skipped when neither check option asks for it."""
        if not (self.check_bounds or self.debug_checks) or indices.numel() == 0:
            return
        lo, hi = torch.stack(torch.aminmax(indices)).tolist()
        for bad in (lo, hi):
            if 0 <= bad < self._low:
                raise ValueError(
                    f"slot {bad} is in the reserved padding page (slots 0..{self._low - 1}) "
                    "and is never allocated"
                )
            if not self._low <= bad <= self._high:
                raise ValueError(
                    f"slot {bad} out of range: valid slots are {self._low}..{self._high}"
                )

    # -- eviction contract --------------------------------------------------------------------
    def shortfall(self, num_tokens: int) -> EvictParams | None:
        """Tokens a cache must evict so ``num_tokens`` slots can be allocated, or None.

        ``num_tokens - available_size()`` rounded up to whole pages; never ``num_tokens``.
        """
        n = check_size(num_tokens, "num_tokens")
        deficit = n - self.available_size()
        if deficit <= 0:
            return None
        return EvictParams(num_tokens=-(-deficit // self.page_size) * self.page_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()}, device={self.device})"
        )
