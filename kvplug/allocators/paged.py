"""The ``paged`` allocator: whole pages of slots, like SGLang's PagedTokenToKVPoolAllocator.

Page ``p`` holds slots ``p * page_size .. p * page_size + page_size - 1``; page 0 is the padding
page. A request's tokens fill its pages in order, so its last page may be partial: extend and
decode allocation continue that page (found from the request's last slot) before taking new
ones. SGLang does this with Triton kernels (``alloc_extend_kernel``/``alloc_decode_kernel``);
here the same layout comes from a handful of batched torch ops, no loop over requests or tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvplug_hookspecs import PoolGeometry

from .. import speedups
from ..pools import MHAKVPool
from .base import AllocatorCheckOptions, BaseAllocator, FreeIdStack, check_size

__all__ = ["PagedAllocator", "PagedAllocatorOptions"]


class PagedAllocatorOptions(AllocatorCheckOptions):
    """Options of the ``paged`` allocator (the page size comes from the pool geometry)."""


class PagedAllocator(BaseAllocator):
    """Hands out whole pages; ``available_size()`` and ``shortfall`` count tokens.

    ``free(indices)`` frees every page that one of the given slots lies in (each page once).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        *,
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
        self.num_pages = size // page_size
        self._page_owner = torch.zeros(self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._stack = FreeIdStack(
            1,
            self.num_pages,
            self.device,
            track=self.tracks_ownership,
            unit="page",
            host=self._host,
        )
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        # the NumPy path's scratch for distinct pages (a CPU device; see base.py)
        self._unit_scratch_np = np.zeros(self.num_pages + 1, dtype=np.int64)

    @classmethod
    def from_geometry(
        cls, geometry: PoolGeometry, options: PagedAllocatorOptions | None = None
    ) -> PagedAllocator:
        """Build the MHA pool a geometry describes and a paged allocator over it."""
        options = options or PagedAllocatorOptions()
        pool = MHAKVPool.from_geometry(geometry)
        return cls(
            geometry.capacity_tokens,
            geometry.page_size,
            device=pool.device,
            pool=pool,
            **options.model_dump(),
        )

    def available_size(self) -> int:
        return len(self._stack) * self.page_size

    def available_pages(self) -> int:
        return len(self._stack)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """The slots of ``need_size // page_size`` whole pages, or ``None`` when short."""
        n = check_size(need_size, "need_size")
        if n % self.page_size:
            raise ValueError(f"need_size={n} is not a multiple of page_size={self.page_size}")
        num_pages = n // self.page_size
        if num_pages > len(self._stack):
            return None
        if self._host:
            return torch.from_numpy(self._slots_np(self._stack.pop_np(num_pages)))
        pages = self._stack.pop(num_pages)
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def _slots_np(self, pages: np.ndarray) -> np.ndarray:
        """Every slot of these pages, in order (the NumPy path of a CPU device)."""
        slots = np.empty(pages.size * self.page_size, dtype=np.int64)
        speedups.expand_units(pages, self.page_size, slots)
        return slots

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Slots for tokens ``prefix_lens[i]..seq_lens[i]-1`` of each request, concatenated.

        ``last_loc[i]`` is the slot of request ``i``'s last prefix token (anything, e.g. -1, when
        its prefix is empty or ends on a page boundary). Each request first fills the rest of
        that page, then takes new pages. Returns ``None`` (taking nothing) when pages are short.
        One host sync reads the batch totals.
        """
        ps = self.page_size
        pre, seq, last = self._batch(prefix_lens=prefix_lens, seq_lens=seq_lens, last_loc=last_loc)
        total = check_size(extend_num_tokens, "extend_num_tokens")
        if pre.numel() == 1:
            return self._alloc_extend_one(pre, seq, last, total)
        ext = seq - pre
        pages_before = (pre + ps - 1) // ps
        new_pages = (seq + ps - 1) // ps - pages_before
        # tokens that continue the prefix's last partial page
        in_last_page = torch.minimum(seq, pages_before * ps) - pre
        misplaced = (pre % ps != 0) & self._not_page_tail(last, pre)
        if pre.numel() == 0:
            stats = [0, 0, 0, 0]
        else:
            stats = torch.stack([ext.sum(), new_pages.sum(), ext.min(), misplaced.sum()]).tolist()
        ext_sum, num_new_pages, ext_min, num_misplaced = stats
        if ext_min < 0:
            raise ValueError("seq_lens must be >= prefix_lens for every request")
        if ext_sum != total:
            raise ValueError(f"extend_num_tokens={total} but sum(seq_lens - prefix_lens)={ext_sum}")
        if num_misplaced:
            raise ValueError(
                f"{num_misplaced} request(s) have a last_loc that is not a usable slot at offset "
                "(prefix_len - 1) % page_size of its page"
            )
        if num_new_pages > len(self._stack):
            return None
        pages = self._stack.pop(num_new_pages)
        if total == 0:
            return pages  # empty int64 tensor

        # per output token: its request, its position j in the request's extension, and k, its
        # position among the request's tokens that go into new pages (< 0: the old partial page)
        req = torch.repeat_interleave(
            torch.arange(pre.numel(), device=self.device), ext, output_size=total
        )
        j = torch.arange(total, device=self.device) - (torch.cumsum(ext, 0) - ext).index_select(
            0, req
        )
        k = j - in_last_page.index_select(0, req)
        out = last.index_select(0, req) + 1 + j
        if num_new_pages:
            first_page = (torch.cumsum(new_pages, 0) - new_pages).index_select(0, req)
            kk = k.clamp(min=0)
            page = pages.index_select(0, (first_page + kk // ps).clamp(max=num_new_pages - 1))
            out = torch.where(k >= 0, page * ps + kk % ps, out)
        return out

    def _alloc_extend_one(
        self, pre_t: torch.Tensor, seq_t: torch.Tensor, last_t: torch.Tensor, total: int
    ) -> torch.Tensor | None:
        """``alloc_extend`` for one request, with the same checks and result in a handful of
        torch calls instead of two dozen: a simulator or a one-request step pays per call."""
        ps = self.page_size
        pre, seq, last = torch.cat([pre_t, seq_t, last_t]).tolist()
        if seq < pre:
            raise ValueError("seq_lens must be >= prefix_lens for every request")
        if seq - pre != total:
            raise ValueError(
                f"extend_num_tokens={total} but sum(seq_lens - prefix_lens)={seq - pre}"
            )
        if pre % ps and ((last + 1) % ps != pre % ps or not self._low <= last <= self._high):
            raise ValueError(
                "1 request(s) have a last_loc that is not a usable slot at offset "
                "(prefix_len - 1) % page_size of its page"
            )
        pages_before = -(-pre // ps)
        num_new_pages = -(-seq // ps) - pages_before
        if num_new_pages > len(self._stack):
            return None
        pages = self._stack.pop(num_new_pages)
        if total == 0:
            return pages  # empty int64 tensor
        in_last_page = min(seq, pages_before * ps) - pre  # continues the prefix's partial page
        parts = []
        if in_last_page:
            parts.append(torch.arange(last + 1, last + 1 + in_last_page, device=self.device))
        if num_new_pages:
            slots = (pages[:, None] * ps + self._offsets).reshape(-1)
            parts.append(slots[: total - in_last_page])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for its token ``seq_lens[i] - 1`` (the one being decoded).

        The slot after ``last_loc[i]`` when that stays inside the page, else the first slot of a
        new page. Returns ``None`` (taking nothing) when pages are short. One host sync.
        """
        ps = self.page_size
        seq, last = self._batch(seq_lens=seq_lens, last_loc=last_loc)
        pre = seq - 1
        needs_page = pre % ps == 0
        bad = (seq < 1) | (~needs_page & self._not_page_tail(last, pre))
        if seq.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        num_new_pages, num_bad = torch.stack([needs_page.sum(), bad.sum()]).tolist()
        if num_bad:
            raise ValueError(
                f"{num_bad} request(s) have seq_lens < 1 or a last_loc that is not a usable slot "
                "at offset (seq_len - 2) % page_size of its page"
            )
        if num_new_pages > len(self._stack):
            return None
        pages = self._stack.pop(num_new_pages)
        if not num_new_pages:
            return last + 1
        rank = (torch.cumsum(needs_page, 0) - 1).clamp(0, num_new_pages - 1)
        return torch.where(needs_page, pages.index_select(0, rank) * ps, last + 1)

    def _not_page_tail(self, last: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Where ``last`` cannot be the slot of token ``length - 1``: wrong offset or not usable."""
        ps = self.page_size
        return ((last + 1) % ps != length % ps) | (last < self._low) | (last > self._high)

    def alloc_mark(self) -> int:
        return self._stack.top

    def rollback_alloc(self, mark: int) -> None:
        self._stack.rollback(mark)

    def release(self, indices: torch.Tensor) -> None:
        if self._host:
            self._stack.push_np(self._pages_np(indices.numpy()))
            return
        self._stack.push(self.pages_of(indices))

    def _owner_stack(self) -> tuple[FreeIdStack, int]:
        return self._stack, self.page_size

    def pages_of(self, indices: torch.Tensor) -> torch.Tensor:
        """The distinct pages that slots ``indices`` lie in, in O(n) and without a sort.

        Every position writes its own number into its page's cell of a scratch tensor; exactly
        one write per page survives, so keeping the positions that read their own number back
        keeps each page once (``torch.unique`` would sort: several times slower for big frees).
        """
        if self._host:
            return torch.from_numpy(self._pages_np(indices.numpy()))
        pages = indices // self.page_size
        positions = torch.arange(pages.numel(), device=self.device)
        self._page_owner.scatter_(0, pages, positions)
        return torch.masked_select(pages, self._page_owner.index_select(0, pages) == positions)

    def _pages_np(self, indices: np.ndarray) -> np.ndarray:
        """``pages_of`` on a NumPy view: one pass (``speedups.distinct_units``)."""
        out = np.empty(indices.size, dtype=np.int64)
        k = speedups.distinct_units(indices, self.page_size, self._unit_scratch_np, out)
        return out[:k]

    def clear(self) -> None:
        """Every page free again; an open free group is dropped."""
        self._stack.reset()
        self._free_group = None
