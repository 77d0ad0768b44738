"""What the built-in allocators share: a device free-id stack, index checks, free groups, shortfall.

Cost model (documented in the README): ``alloc``/``free`` are a few device ops each and never
reallocate. Checks that only read tensor metadata (type, dtype, rank, device) always run, at the
call. The value checks of freed indices reduce them on the device and read a few numbers back:
one host sync per ``free`` call, or per free group, whose indices are checked together at
``free_group_end``. They are the range check (``check_bounds``) and, by default, the ownership
check (``ownership_checks``): a device int8 state per slot (per page when paged), ``FREE`` ->
``HELD`` on alloc, ``HELD`` -> ``CACHED`` when a prefix cache takes the slot
(``take_ownership``), back to ``FREE`` on free. A double free, a free of a slot never allocated
or a slot given twice in one call is then an error and nothing changes; it costs one scatter per
alloc and free and two gathers per free, inside the same sync. Turn both off where a sync would
stall an overlap scheduler and the engine proves ownership itself. ``debug_checks`` checks every
call of a free group at once instead of at its end.

On a CPU device the free-id stack, the owner state and these checks run through NumPy views of
the same tensors (zero-copy): the same memory and results, without torch's per-call dispatch,
which costs more than the work itself for the few hundred slots of one request (a check is
about 5x cheaper). Other devices use the torch ops; both paths are tested to agree.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from pydantic import Field

from kvplug_hookspecs import EvictParams, FrozenModel

from .. import speedups
from ..pools import check_index_tensor, resolve_device

__all__ = [
    "CACHED",
    "FREE",
    "HELD",
    "AllocatorCheckOptions",
    "BaseAllocator",
    "FreeIdStack",
    "check_size",
]

# Owner of a slot (or page) in the ownership state: free, held by the caller that allocated it,
# or cached (owned by the prefix cache).
FREE, HELD, CACHED = 0, 1, 2
_NO_SCRATCH = np.zeros(0, dtype=np.int64)  # a kernel argument it does not read in that call
_STATE_NAMES = {FREE: "free", HELD: "held by a request", CACHED: "owned by the cache"}


@functools.lru_cache(maxsize=4096)
def _full_shortfall(num_tokens: int) -> EvictParams:
    """One validated ``EvictParams(num_tokens=n)`` per count: the model is frozen, so a shortfall
    asked for again (every request of a full cache asks for one) is shared, not re-validated."""
    return EvictParams(num_tokens=num_tokens)


class AllocatorCheckOptions(FrozenModel):
    """Safety checks every built-in allocator offers."""

    ownership_checks: bool = Field(
        True,
        strict=True,
        description="track each slot's owner (free / held / cached) on the device: reject double "
        "frees, frees of never-allocated slots, duplicates within one call, and a cache taking "
        "slots the caller does not hold; turn off only when the engine proves ownership itself",
    )
    debug_checks: bool = Field(
        False,
        strict=True,
        description="check every free of a free group at the call (also tracks ownership)",
    )
    check_bounds: bool = Field(
        True,
        strict=True,
        description="range-check freed indices (one host sync per free call or free group)",
    )


def check_size(value: Any, what: str) -> int:
    """A non-negative integer count (``alloc(-1)``, ``shortfall(2.5)`` are errors, not clamps)."""
    if type(value) is int and value >= 0:  # the common case, without operator.index
        return value
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
    ``track=True`` keeps ``state``, a device int8 owner per id (``FREE``/``HELD``/``CACHED``);
    ``pop`` marks ids ``HELD`` and ``push`` marks them ``FREE`` (callers check before pushing).
    """

    def __init__(
        self,
        first: int,
        count: int,
        device: torch.device,
        *,
        track: bool,
        unit: str,
        host: bool = True,
    ) -> None:
        self.first, self.count, self.unit = first, count, unit
        self._ids = torch.empty(count, dtype=torch.int64, device=device)
        self.state = torch.empty(first + count, dtype=torch.int8, device=device) if track else None
        # zero-copy host views of the same memory on a CPU device (see the module docstring)
        self._ids_np: np.ndarray | None = None
        self.state_np: np.ndarray | None = None
        self.use_host(host)
        self.top = 0
        self.reset()

    def use_host(self, enabled: bool) -> None:
        """Run ``pop``/``push``/``set_state`` through NumPy views (CPU tensors only)."""
        host = enabled and self._ids.device.type == "cpu"
        self._ids_np = self._ids.numpy() if host else None
        self.state_np = self.state.numpy() if host and self.state is not None else None

    def reset(self) -> None:
        """Every id free again, in ascending order (the first ``pop`` returns ``first, ...``)."""
        torch.arange(self.first, self.first + self.count, out=self._ids)
        self.top = 0
        if self.state is not None:
            self.state.fill_(FREE)

    def __len__(self) -> int:
        return self.count - self.top

    def overfull(self, n: int) -> ValueError:
        """The error of pushing ``n`` ids when fewer than ``n`` are allocated."""
        return ValueError(
            f"freeing {n} {self.unit}(s) but only {self.top} are allocated: some are freed twice"
        )

    def pop(self, n: int) -> torch.Tensor:
        """Take ``n <= len(self)`` ids as a new tensor (callers check the count first)."""
        if self._ids_np is not None:
            return torch.from_numpy(self.pop_np(n))
        out = self._ids[self.top : self.top + n].clone()
        self.top += n
        if self.state is not None:
            self.state.index_fill_(0, out, HELD)
        return out

    def rollback(self, top: int) -> None:
        """Undo the pops made since ``top`` was read, when nothing was pushed in between.

        ``pop`` leaves the ids in place below the new top, so moving the top back restores them.
        """
        if self.state is not None and top < self.top:
            self.set_state(self._ids[top : self.top], FREE)
        self.top = top

    def push(self, ids: torch.Tensor) -> None:
        """Return ids to the stack; raises (changing nothing) when more are pushed than held.

        Ownership was checked by the caller (``BaseAllocator._check_values``).
        """
        if self._ids_np is not None:
            self.push_np(ids.numpy())
            return
        n = ids.numel()
        if n > self.top:
            raise self.overfull(n)
        self._ids[self.top - n : self.top] = ids
        self.top -= n
        if self.state is not None:
            self.state.index_fill_(0, ids, FREE)

    def pop_np(self, n: int) -> np.ndarray:
        """``pop`` on the host views (a CPU stack in host mode): a new NumPy array."""
        assert self._ids_np is not None
        ids: np.ndarray = self._ids_np[self.top : self.top + n].copy()
        self.top += n
        if self.state_np is not None:
            self.state_np[ids] = HELD
        return ids

    def push_np(self, ids: np.ndarray) -> None:
        """``push`` on the host views (a CPU stack in host mode)."""
        assert self._ids_np is not None
        n = ids.size
        if n > self.top:
            raise self.overfull(n)
        self._ids_np[self.top - n : self.top] = ids
        if self.state_np is not None:
            self.state_np[ids] = FREE
        self.top -= n

    def set_state(self, ids: torch.Tensor, value: int) -> None:
        """Mark ids with an owner state (a no-op when ownership is not tracked)."""
        if self.state_np is not None:
            self.state_np[ids.numpy()] = value
        elif self.state is not None:
            self.state.index_fill_(0, ids, value)


class BaseAllocator:
    """Free groups, index checks and the shortfall contract of the built-in allocators.

    ``prefer_host_path`` (class-wide, default on) picks the NumPy path on a CPU device; tests
    turn it off to run the device path on the CPU.

    Subclasses set ``_low``/``_high`` (the valid slot range) and implement ``available_size``,
    ``alloc``, ``clear``, ``release`` (free already-checked indices; raise before changing
    anything), the ``alloc_mark`` / ``rollback_alloc`` pair (undo allocations exactly) and
    ``_owner_stack`` (the stack that holds the slots' owner state, and slots per unit).
    """

    prefer_host_path: bool = True
    # One FreeIdStack holds the free ids and the owner state of every slot (standard, paged):
    # then, on the NumPy path, a free and an ownership change are each one kernel call.
    # False where _set_owner and release do more (swa: the window pool too).
    _one_stack: bool = True

    def __init__(
        self,
        size: int,
        page_size: int,
        *,
        device: str | torch.device,
        pool: Any,
        debug_checks: bool,
        check_bounds: bool,
        ownership_checks: bool = True,
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
        self.ownership_checks = bool(ownership_checks)
        self.tracks_ownership = self.ownership_checks or self.debug_checks
        self._low, self._high = page_size, size + page_size - 1
        self._free_group: list[torch.Tensor] | None = None
        # scratch for the duplicate check: every position writes its number into its slot's cell
        self._dup_scratch = self._positions = None
        if self.tracks_ownership:
            self._dup_scratch = torch.zeros(size + page_size, dtype=torch.int64, device=self.device)
            self._positions = torch.arange(size + page_size, device=self.device)
        # the NumPy check path on a CPU device (module docstring); tests switch it off to run
        # the device path on the CPU
        self._dup_scratch_np: np.ndarray | None = None
        self._unit_scratch_np = _NO_SCRATCH  # a page's cell per page (paged sets it)
        self.use_host_path(self.prefer_host_path)

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

    def _owner_stack(self) -> tuple[FreeIdStack, int]:
        """The stack that tracks the owner of the slots, and how many slots share one unit."""
        raise NotImplementedError

    def _owner_units(self, indices: torch.Tensor) -> tuple[FreeIdStack, torch.Tensor]:
        """The stack that tracks these (in-range) slots' owner, and their ids in it."""
        stack, div = self._owner_stack()
        return stack, indices // div if div != 1 else indices

    def _owner_units_np(self, indices: np.ndarray) -> tuple[FreeIdStack, np.ndarray]:
        """``_owner_units`` on a NumPy view (the CPU path)."""
        stack, div = self._owner_stack()
        return stack, indices // div if div != 1 else indices

    # -- ownership -----------------------------------------------------------------------------
    def take_ownership(self, indices: torch.Tensor) -> None:
        """A prefix cache now owns these slots: each must be held by the caller (``HELD`` ->
        ``CACHED``). Raises naming the first bad slot, changing nothing; so the same slots
        inserted under a second key are rejected. A no-op without ownership tracking."""
        self._change_owner(indices, HELD, CACHED)

    def release_ownership(self, indices: torch.Tensor) -> None:
        """Hand cached slots back to the caller (``CACHED`` -> ``HELD``), e.g. an adapter
        whose engine frees them itself. Raises naming the first slot not cached, changing
        nothing."""
        self._change_owner(indices, CACHED, HELD)

    def owner_state(self, indices: torch.Tensor) -> torch.Tensor:
        """The owner state (``FREE``/``HELD``/``CACHED``, int8) of each in-range slot: for
        checks and tests. Raises when ownership is not tracked."""
        if not self.tracks_ownership:
            raise RuntimeError("ownership is not tracked (ownership_checks=False)")
        indices = self._check_indices(indices, values=False)
        if indices.numel():
            lo, hi = torch.stack(torch.aminmax(indices)).tolist()
            if lo < self._low or hi > self._high:
                raise ValueError(f"slots must be in {self._low}..{self._high}, got {lo}..{hi}")
        stack, units = self._owner_units(indices)
        assert stack.state is not None
        return stack.state.index_select(0, units)

    def _change_owner(self, indices: torch.Tensor, old: int, new: int) -> None:
        indices = self._check_indices(indices, values=False)
        if not self.tracks_ownership or indices.numel() == 0:
            return
        if self._host and self._one_stack:
            self._check_values_host(indices, old, set_to=new)  # checked, then set: one call
            return
        self._check_values(indices, require=old)
        self._set_owner(indices, new)

    def _set_owner(self, indices: torch.Tensor, state: int) -> None:
        if self._host:
            stack, units_np = self._owner_units_np(indices.numpy())
            if stack.state_np is not None:
                stack.state_np[units_np] = state
                return
        stack, units = self._owner_units(indices)
        stack.set_state(units, state)

    # -- freeing ------------------------------------------------------------------------------
    def free(self, indices: torch.Tensor) -> None:
        """Return slots to the allocator (deferred to ``free_group_end`` inside a free group)."""
        if self._host and self._one_stack and self._free_group is None:
            self._free_host(indices)
            return
        indices = self._check_indices(indices, values=self._free_group is None or self.debug_checks)
        if indices.numel() == 0:
            return
        if self._free_group is not None:
            self._free_group.append(indices)
        else:
            self.release(indices)

    def _free_host(self, indices: torch.Tensor) -> None:
        """``free`` on the NumPy path of a one-stack allocator: the range and ownership checks,
        the distinct pages and the push in one call (``speedups.release_slots``); the same
        checks, errors and result as ``_check_values`` + ``release``."""
        indices = self._check_indices(indices, values=False)
        n = indices.numel()
        stack, div = self._owner_stack()
        if (
            n == 0
            or not (self.tracks_ownership or self.check_bounds)
            or (div == 1 and n > stack.top)
        ):
            self._check_values(indices)  # none, or the page-1 count error first, as before
            if n:
                self.release(indices)
            return
        assert stack._ids_np is not None
        scratch = self._dup_scratch_np
        lo, hi, first_dup, first_bad, k = speedups.release_slots(
            indices.numpy(),
            stack.state_np if self.tracks_ownership else None,
            div,
            self._low,
            self._high,
            scratch if scratch is not None else _NO_SCRATCH,
            self._unit_scratch_np,
            np.empty(n, dtype=np.int64) if div > 1 else _NO_SCRATCH,
            stack._ids_np,
            stack.top,
        )
        if lo < self._low or hi > self._high:
            self._raise_range(lo, hi)
        if first_dup >= 0 or first_bad >= 0:
            self._raise_ownership(indices, None, first_dup, first_bad)
        if k > stack.top:
            raise stack.overfull(k)
        stack.top -= k

    def free_group_begin(self) -> None:
        """Start collecting frees; ``free_group_end`` releases them with one call."""
        if self._free_group is not None:
            raise RuntimeError("free_group_begin() called inside a free group (groups do not nest)")
        self._free_group = []

    def free_group_end(self) -> None:
        """Release everything freed since ``free_group_begin`` at once, after one range check.

        The group is closed even if a check fails (an index out of range, a double free, a slot
        freed twice within the group): then nothing of the group is freed.
        """
        if self._free_group is None:
            raise RuntimeError("free_group_end() called without free_group_begin()")
        group, self._free_group = self._free_group, None
        if group:
            indices = group[0] if len(group) == 1 else torch.cat(group)
            self._check_values(indices)  # the group as a whole: duplicates across calls
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
        if indices.dtype != torch.int64:
            indices = indices.to(torch.int64)
        if values:
            self._check_values(indices)
        return indices

    def use_host_path(self, enabled: bool) -> None:
        """Use the NumPy path on a CPU device (the default) or the device's torch ops (tests
        run both on the CPU to prove they agree)."""
        self._host = enabled and self.device.type == "cpu"
        scratch = self._dup_scratch
        self._dup_scratch_np = scratch.numpy() if self._host and scratch is not None else None
        for value in vars(self).values():
            if isinstance(value, FreeIdStack):
                value.use_host(enabled)
            elif isinstance(value, BaseAllocator) and value is not self:
                value.use_host_path(enabled)

    def _check_values(self, indices: torch.Tensor, *, require: int | None = None) -> None:
        """Range and ownership checks of slot indices, with one host sync for all of them.

        ``require=None`` (a free): no slot may be ``FREE``; else every slot must be in state
        ``require``. A slot given twice in one call is an error either way.
        """
        track = self.tracks_ownership
        if indices.numel() == 0 or not (track or self.check_bounds):
            return
        if self._host:
            self._check_values_host(indices, require)
            return
        parts = list(torch.aminmax(indices))
        bad = dup = None
        if track:
            safe = indices.clamp(self._low, self._high)  # out-of-range ones fail the range check
            stack, units = self._owner_units(safe)
            assert stack.state is not None and self._dup_scratch is not None
            assert self._positions is not None
            state = stack.state.index_select(0, units)
            bad = state == FREE if require is None else state != require
            n = safe.numel()
            if n > self._positions.numel():  # more indices than slots: some repeat
                positions = torch.arange(n, device=safe.device)
            else:
                positions = self._positions[:n]
            self._dup_scratch.scatter_(0, safe, positions)
            dup = self._dup_scratch.index_select(0, safe) != positions
            parts.append((bad | dup).sum())
        lo, hi, *problems = torch.stack(parts).tolist()
        self._check_range(indices, lo, hi, require)
        if not track:
            return
        assert bad is not None and dup is not None
        if problems[0]:
            first_dup = int(torch.nonzero(dup)[0]) if bool(dup.any()) else None
            first_bad = int(torch.nonzero(bad)[0]) if bool(bad.any()) else None
            self._raise_ownership(indices, require, first_dup, first_bad)

    def _check_values_host(
        self, indices: torch.Tensor, require: int | None, *, set_to: int = -1
    ) -> None:
        """``_check_values`` on NumPy views of CPU tensors, one pass (``speedups.check_slots``):
        the same checks and messages. ``set_to >= 0``: then, in the same call, the slots' owner
        state becomes ``set_to`` (only when every check passed)."""
        track = self.tracks_ownership
        stack, div = self._owner_stack()
        scratch = self._dup_scratch_np
        lo, hi, first_dup, first_bad = speedups.check_slots(
            indices.numpy(),
            stack.state_np if track else None,
            div,
            -1 if require is None else require,
            self._low,
            self._high,
            scratch if scratch is not None else _NO_SCRATCH,
            set_to,
        )
        self._check_range(indices, lo, hi, require)
        if first_dup >= 0 or first_bad >= 0:
            self._raise_ownership(indices, require, first_dup, first_bad)

    def _check_range(self, indices: torch.Tensor, lo: int, hi: int, require: int | None) -> None:
        """Raise when the smallest or largest slot is not a usable one, or (a free at page
        size 1) when more slots are freed than are allocated at all."""
        if lo < self._low or hi > self._high:
            self._raise_range(lo, hi)
        if require is None and self.page_size == 1:
            held = self.size - self.available_size()
            if indices.numel() > held:  # more than is held at all
                raise ValueError(
                    f"freeing {indices.numel()} slot(s) but only {held} are allocated: "
                    "some are freed twice"
                )

    def _raise_range(self, lo: int, hi: int) -> None:
        """Name the smallest or largest slot that is not a usable one."""
        for value in (lo, hi):
            if 0 <= value < self._low:
                raise ValueError(
                    f"slot {value} is in the reserved padding page (slots 0..{self._low - 1}) "
                    "and is never allocated"
                )
            if not self._low <= value <= self._high:
                raise ValueError(
                    f"slot {value} out of range: valid slots are {self._low}..{self._high}"
                )

    def _raise_ownership(
        self,
        indices: torch.Tensor,
        require: int | None,
        first_dup: int | None,
        first_bad: int | None,
    ) -> None:
        """Name the first problem: a slot twice in one call, else the first slot in a wrong
        state (positions; ``None`` or ``-1``: none found)."""
        verb = "freed" if require is None else "given"
        if first_dup is not None and first_dup >= 0:
            i = first_dup
            raise ValueError(f"slot {int(indices[i])} is {verb} twice in one call (position {i})")
        assert first_bad is not None and first_bad >= 0
        i = first_bad
        stack, units = self._owner_units(indices[i : i + 1])
        assert stack.state is not None
        unit, got = int(units[0]), int(stack.state[units[0]])
        if require is None:
            raise ValueError(
                f"{stack.unit} {unit} is already free (position {i}): a double free, or "
                "never allocated"
            )
        raise ValueError(
            f"slot {int(indices[i])} (position {i}) is {_STATE_NAMES[got]}, expected "
            f"{_STATE_NAMES[require]}: nothing changed"
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
        return _full_shortfall(-(-deficit // self.page_size) * self.page_size)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, page_size={self.page_size}, "
            f"available={self.available_size()}, device={self.device})"
        )
