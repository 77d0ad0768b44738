"""Hypothesis state machines: random alloc/free/free_swa/free-group/clear sequences per allocator.

After every step each machine checks against a plain-Python model: free + held == capacity, the
free ids (read by allocating everything on a copy) are exactly the ones not held, no id is held
twice, the padding slot/page never appears, and ``shortfall`` equals the arithmetic of its
contract. Together the machines run several thousand steps per allocator.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvplug.allocators import PagedAllocator, StandardAllocator, SWAAllocator
from kvplug_hookspecs import EvictParams

STEPS = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],  # CI machines are slow and noisy
)


def extend_requests(reqs, batch, slots, exts, new_slots) -> None:
    """The model's side of an ``alloc_extend``: request ``batch[k]`` (or a new one when it is
    negative) grows from ``slots[k]`` by its ``exts[k]`` consecutive slots of ``new_slots``."""
    pos = 0
    for i, s, e in zip(batch, slots, exts):
        grown = s + list(new_slots[pos : pos + e])
        pos += e
        if i >= 0:
            reqs[i] = grown
        else:
            reqs.append(grown)


def tensor(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def free_ids(allocator, unit: int = 1) -> list[int]:
    """The ids the allocator would hand out, read from a copy (the original is untouched)."""
    probe = copy.deepcopy(allocator)
    return probe.alloc(probe.available_size()).tolist()[::unit]


# ===========================================================================================
# standard
# ===========================================================================================


class StandardMachine(RuleBasedStateMachine):
    SIZE = 24
    DEBUG = True

    def __init__(self) -> None:
        super().__init__()
        self.a = StandardAllocator(self.SIZE, device="cpu", debug_checks=self.DEBUG)
        self.held: list[list[int]] = []  # allocations, each still held in full
        self.pending: list[int] = []  # freed inside the open free group
        self.grouped = False

    def held_slots(self) -> list[int]:
        return [s for block in self.held for s in block]

    @rule(n=st.integers(0, SIZE + 2))
    def alloc(self, n):
        free_before = self.a.available_size()
        out = self.a.alloc(n)
        if n > free_before:
            assert out is None
            return
        slots = out.tolist()
        assert out.dtype is torch.int64 and len(slots) == n == len(set(slots))
        assert not set(slots) & set(self.held_slots() + self.pending)
        self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_part(self, data):
        i = data.draw(st.integers(0, len(self.held) - 1))
        k = data.draw(st.integers(0, len(self.held[i])))
        freed, self.held[i] = self.held[i][:k], self.held[i][k:]
        self.a.free(tensor(freed))
        if self.grouped:
            self.pending += freed

    @precondition(lambda self: self.DEBUG and not self.grouped)
    @rule(data=st.data())
    def double_free_is_rejected(self, data):
        free = sorted(set(range(1, self.SIZE + 1)) - set(self.held_slots()))
        if not free:
            return
        slot = data.draw(st.sampled_from(free))
        before = free_ids(self.a)
        with pytest.raises(ValueError, match=f"slot {slot} is already free|freeing 1 slot"):
            self.a.free(tensor([slot]))
        assert free_ids(self.a) == before

    @precondition(lambda self: self.DEBUG or not self.grouped)  # else checked at the group's end
    @rule(slot=st.sampled_from([0, -1, SIZE + 1]))
    def out_of_range_is_rejected(self, slot):
        before = self.a.available_size()
        with pytest.raises(ValueError, match=f"slot {slot}"):
            self.a.free(tensor([slot]))
        assert self.a.available_size() == before

    @precondition(lambda self: not self.grouped)
    @rule()
    def begin_group(self):
        self.a.free_group_begin()
        self.grouped = True

    @precondition(lambda self: self.grouped)
    @rule()
    def end_group(self):
        self.a.free_group_end()
        self.grouped, self.pending = False, []

    @rule()
    def clear(self):
        self.a.clear()
        self.held, self.pending, self.grouped = [], [], False

    @rule(n=st.integers(0, 2 * SIZE))
    def shortfall(self, n):
        missing = n - self.a.available_size()
        assert self.a.shortfall(n) == (EvictParams(num_tokens=missing) if missing > 0 else None)

    @invariant()
    def conservation(self):
        held = self.held_slots() + self.pending
        assert len(held) == len(set(held)), "a slot is held twice"
        assert 0 not in held
        assert self.a.available_size() + len(held) == self.SIZE
        free = free_ids(self.a)
        assert 0 not in free and len(free) == len(set(free))
        assert sorted(free + held) == list(range(1, self.SIZE + 1))
        assert self.a.in_free_group == self.grouped


# ===========================================================================================
# paged
# ===========================================================================================


class PagedMachine(RuleBasedStateMachine):
    PS = 4
    PAGES = 12

    def __init__(self) -> None:
        super().__init__()
        self.a = PagedAllocator(self.PAGES * self.PS, self.PS, device="cpu", debug_checks=True)
        self.reqs: list[list[int]] = []  # each request's slots, in token order
        self.pending: set[int] = set()  # pages freed inside the open group
        self.grouped = False

    def pages_of(self, slots) -> set[int]:
        return {s // self.PS for s in slots}

    def held_pages(self) -> list[int]:
        return [p for r in self.reqs for p in sorted(self.pages_of(r))]

    def next_pages(self, n: int) -> list[int]:
        return [s // self.PS for s in free_ids(self.a, self.PS)[:n]]

    def reference(self, pages: list[int], slots: list[int], count: int) -> list[int]:
        out, last = [], slots[-1] if slots else -1
        for pos in range(len(slots), len(slots) + count):
            last = pages.pop(0) * self.PS if pos % self.PS == 0 else last + 1
            out.append(last)
        return out

    @rule(pages=st.integers(0, PAGES + 1))
    def alloc_pages(self, pages):
        free = self.a.available_pages()
        out = self.a.alloc(pages * self.PS)
        if pages > free:
            assert out is None
            return
        self.reqs.append(out.tolist())

    @rule(data=st.data())
    def alloc_extend(self, data):
        batch = data.draw(st.lists(st.integers(-1, len(self.reqs) - 1), max_size=4, unique=True))
        exts = data.draw(
            st.lists(st.integers(0, 3 * self.PS), min_size=len(batch), max_size=len(batch))
        )
        slots = [self.reqs[i] if i >= 0 else [] for i in batch]
        pre = [len(s) for s in slots]
        seq = [p + e for p, e in zip(pre, exts)]
        need = sum(-(-s // self.PS) - -(-p // self.PS) for p, s in zip(pre, seq))
        pages = self.next_pages(need) if need <= self.a.available_pages() else []
        out = self.a.alloc_extend(
            tensor(pre), tensor(seq), tensor(s[-1] if s else -1 for s in slots), sum(exts)
        )
        if need > len(pages):
            assert out is None
            return
        expected = []
        for s, e in zip(slots, exts):
            expected += self.reference(pages, s, e)
        assert out.tolist() == expected
        extend_requests(self.reqs, batch, slots, exts, expected)

    @precondition(lambda self: any(self.reqs))
    @rule(data=st.data())
    def alloc_decode(self, data):
        live = [i for i, r in enumerate(self.reqs) if r]
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True))
        need = sum(1 for i in batch if len(self.reqs[i]) % self.PS == 0)
        pages = self.next_pages(need) if need <= self.a.available_pages() else []
        out = self.a.alloc_decode(
            tensor(len(self.reqs[i]) + 1 for i in batch), tensor(self.reqs[i][-1] for i in batch)
        )
        if need > len(pages):
            assert out is None
            return
        for i, slot in zip(batch, out.tolist()):
            assert slot == self.reference(pages, self.reqs[i], 1)[0]
            self.reqs[i].append(slot)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_tail(self, data):
        """Free a request's pages from page ``keep`` on (all of them when keep is 0)."""
        i = data.draw(st.integers(0, len(self.reqs) - 1))
        r = self.reqs[i]
        keep = data.draw(st.integers(0, -(-len(r) // self.PS))) * self.PS
        freed = r[keep:]
        self.a.free(tensor(freed))
        if self.grouped:
            self.pending |= self.pages_of(freed)
        if keep:
            self.reqs[i] = r[:keep]
        else:
            del self.reqs[i]

    @precondition(lambda self: not self.grouped)
    @rule()
    def begin_group(self):
        self.a.free_group_begin()
        self.grouped = True

    @precondition(lambda self: self.grouped)
    @rule()
    def end_group(self):
        self.a.free_group_end()
        self.grouped, self.pending = False, set()

    @rule()
    def clear(self):
        self.a.clear()
        self.reqs, self.pending, self.grouped = [], set(), False

    @rule(n=st.integers(0, 2 * PAGES * PS))
    def shortfall(self, n):
        missing = n - self.a.available_size()
        expected = EvictParams(num_tokens=-(-missing // self.PS) * self.PS) if missing > 0 else None
        assert self.a.shortfall(n) == expected

    @invariant()
    def conservation(self):
        held = self.held_pages() + sorted(self.pending)
        assert len(held) == len(set(held)), "a page is held twice"
        assert 0 not in held
        assert self.a.available_size() == self.a.available_pages() * self.PS
        assert self.a.available_pages() + len(held) == self.PAGES
        free = free_ids(self.a, self.PS)
        assert all(p % self.PS == 0 for p in free)
        assert sorted([p // self.PS for p in free] + held) == list(range(1, self.PAGES + 1))
        for r in self.reqs:  # token i of a request sits at offset i % PS of its page
            assert [s % self.PS for s in r] == [i % self.PS for i in range(len(r))]
            assert all(r[i + 1] == r[i] + 1 for i in range(len(r) - 1) if (i + 1) % self.PS)


# ===========================================================================================
# swa
# ===========================================================================================


class SWAMachine(RuleBasedStateMachine):
    SIZE = 24
    SIZE_SWA = 10

    def __init__(self) -> None:
        super().__init__()
        self.a = SWAAllocator(self.SIZE, self.SIZE_SWA, 4, device="cpu", debug_checks=True)
        self.reqs: list[list[int]] = []  # full slots of each request, in token order
        self.window: dict[int, int] = {}  # full slot -> window slot, for mapped slots
        self.pending: list[int] = []  # full slots freed inside the open group
        self.grouped = False

    @rule(n=st.integers(0, SIZE_SWA + 2))
    def alloc(self, n):
        full_free, swa_free = self.a.full_available_size(), self.a.swa_available_size()
        out = self.a.alloc(n)
        if n > min(full_free, swa_free):
            assert out is None
            return
        full = out.tolist()
        win = self.a.translate_loc_from_full_to_swa(out).tolist()
        assert len(set(full)) == n and len(set(win)) == n and 0 not in win
        assert not set(win) & set(self.window.values())
        self.window.update(zip(full, win))
        self.reqs.append(full)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_swa_slid_out(self, data):
        """Tokens at the start of a request left the window: free their window slots."""
        r = data.draw(st.sampled_from(self.reqs))
        k = data.draw(st.integers(0, len(r)))
        self.a.free_swa(tensor(r[:k]))
        for s in r[:k]:
            self.window.pop(s, None)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_part(self, data):
        i = data.draw(st.integers(0, len(self.reqs) - 1))
        k = data.draw(st.integers(0, len(self.reqs[i])))
        freed, self.reqs[i] = self.reqs[i][:k], self.reqs[i][k:]
        self.a.free(tensor(freed))
        if self.grouped:
            self.pending += freed
        else:
            for s in freed:
                self.window.pop(s, None)

    @precondition(lambda self: not self.grouped)
    @rule()
    def begin_group(self):
        self.a.free_group_begin()
        self.grouped = True

    @precondition(lambda self: self.grouped)
    @rule()
    def end_group(self):
        self.a.free_group_end()
        for s in self.pending:
            self.window.pop(s, None)
        self.grouped, self.pending = False, []

    @rule()
    def clear(self):
        self.a.clear()
        self.reqs, self.window, self.pending, self.grouped = [], {}, [], False

    @rule(n=st.integers(0, 2 * SIZE))
    def shortfall(self, n):
        full = max(0, n - self.a.full_available_size())
        swa = max(0, n - self.a.swa_available_size())
        expected = EvictParams(num_tokens=full, swa_num_tokens=swa) if full or swa else None
        assert self.a.shortfall(n) == expected

    @invariant()
    def conservation(self):
        held = [s for r in self.reqs for s in r] + self.pending
        assert len(held) == len(set(held)) and 0 not in held
        assert self.a.full_available_size() + len(held) == self.SIZE
        assert self.a.swa_available_size() + len(self.window) == self.SIZE_SWA
        assert self.a.available_size() == min(
            self.a.full_available_size(), self.a.swa_available_size()
        )
        free_full = free_ids(self.a.full_allocator)
        assert sorted(free_full + held) == list(range(1, self.SIZE + 1))
        assert not self.a.translate_loc_from_full_to_swa(tensor(free_full)).any(), (
            "a free slot stays mapped"
        )
        mapped = sorted(self.window.values())
        assert sorted(free_ids(self.a.swa_allocator) + mapped) == list(range(1, self.SIZE_SWA + 1))
        if held:
            expected = [self.window.get(s, 0) for s in held]
            assert self.a.translate_loc_from_full_to_swa(tensor(held)).tolist() == expected


class PagedSWAMachine(RuleBasedStateMachine):
    """The swa allocator with pages: requests grow by extend/decode, pages leave the window."""

    PS = 4
    PAGES = 12
    SWA_PAGES = 6

    def __init__(self) -> None:
        super().__init__()
        self.a = SWAAllocator(
            self.PAGES * self.PS,
            self.SWA_PAGES * self.PS,
            8,
            page_size=self.PS,
            device="cpu",
            debug_checks=True,
        )
        self.reqs: list[list[int]] = []  # full slots of each request, in token order
        self.window: dict[int, int] = {}  # full page -> window page, for pages still in the window
        self.pending: dict[
            int, int | None
        ] = {}  # full pages freed in the open group -> window page
        self.grouped = False

    def learn_new(self, slots: list[int]) -> None:
        """Check and record the window pages of newly allocated full slots."""
        win = self.a.translate_loc_from_full_to_swa(tensor(slots)).tolist()
        in_use = set(self.window.values()) | {w for w in self.pending.values() if w}
        for f, w in zip(slots, win):
            assert w % self.PS == f % self.PS and w >= self.PS, "window slot at another page offset"
            page, wpage = f // self.PS, w // self.PS
            if page in self.window:
                assert self.window[page] == wpage, "one full page maps to two window pages"
            else:
                assert wpage not in in_use, "a window page is mapped twice"
                self.window[page] = wpage
                in_use.add(wpage)

    def pages_needed(self, pre: list[int], seq: list[int]) -> int:
        return sum(-(-s // self.PS) - -(-p // self.PS) for p, s in zip(pre, seq))

    @rule(data=st.data())
    def alloc_extend(self, data):
        batch = data.draw(st.lists(st.integers(-1, len(self.reqs) - 1), max_size=3, unique=True))
        exts = data.draw(
            st.lists(st.integers(0, 2 * self.PS), min_size=len(batch), max_size=len(batch))
        )
        slots = [self.reqs[i] if i >= 0 else [] for i in batch]
        pre = [len(s) for s in slots]
        seq = [p + e for p, e in zip(pre, exts)]
        need = self.pages_needed(pre, seq)
        fits = need * self.PS <= min(self.a.full_available_size(), self.a.swa_available_size())
        before = (self.a.full_available_size(), self.a.swa_available_size())
        out = self.a.alloc_extend(
            tensor(pre), tensor(seq), tensor(s[-1] if s else -1 for s in slots), sum(exts)
        )
        if not fits:
            assert out is None
            assert (self.a.full_available_size(), self.a.swa_available_size()) == before
            return
        assert before[0] - self.a.full_available_size() == need * self.PS
        out = out.tolist()
        self.learn_new(out)
        extend_requests(self.reqs, batch, slots, exts, out)

    @precondition(lambda self: any(self.reqs))
    @rule(data=st.data())
    def alloc_decode(self, data):
        live = [i for i, r in enumerate(self.reqs) if r]
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        need = sum(1 for i in batch if len(self.reqs[i]) % self.PS == 0)
        fits = need * self.PS <= min(self.a.full_available_size(), self.a.swa_available_size())
        out = self.a.alloc_decode(
            tensor(len(self.reqs[i]) + 1 for i in batch), tensor(self.reqs[i][-1] for i in batch)
        )
        if not fits:
            assert out is None
            return
        out = out.tolist()
        self.learn_new(out)
        for i, slot in zip(batch, out):
            self.reqs[i].append(slot)

    @precondition(lambda self: any(len(r) > self.PS for r in self.reqs))
    @rule(data=st.data())
    def free_swa_slid_out(self, data):
        """Whole pages before a request's last page leave the window."""
        r = data.draw(st.sampled_from([r for r in self.reqs if len(r) > self.PS]))
        k = data.draw(st.integers(0, (len(r) - 1) // self.PS)) * self.PS
        self.a.free_swa(tensor(r[:k]))
        for s in r[:k]:
            self.window.pop(s // self.PS, None)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_tail(self, data):
        i = data.draw(st.integers(0, len(self.reqs) - 1))
        r = self.reqs[i]
        keep = data.draw(st.integers(0, -(-len(r) // self.PS))) * self.PS
        freed_pages = sorted({s // self.PS for s in r[keep:]})
        self.a.free(tensor(r[keep:]))
        for page in freed_pages:
            if self.grouped:
                self.pending[page] = self.window.pop(page, None)
            else:
                self.window.pop(page, None)
        if keep:
            self.reqs[i] = r[:keep]
        else:
            del self.reqs[i]

    @precondition(lambda self: not self.grouped)
    @rule()
    def begin_group(self):
        self.a.free_group_begin()
        self.grouped = True

    @precondition(lambda self: self.grouped)
    @rule()
    def end_group(self):
        self.a.free_group_end()
        self.grouped, self.pending = False, {}

    @rule()
    def clear(self):
        self.a.clear()
        self.reqs, self.window, self.pending, self.grouped = [], {}, {}, False

    @rule(n=st.integers(0, 2 * PAGES * PS))
    def shortfall(self, n):
        def pages(missing: int) -> int:
            return -(-max(0, missing) // self.PS) * self.PS

        full, swa = pages(n - self.a.full_available_size()), pages(n - self.a.swa_available_size())
        expected = EvictParams(num_tokens=full, swa_num_tokens=swa) if full or swa else None
        assert self.a.shortfall(n) == expected

    @invariant()
    def conservation(self):
        held = sorted({s // self.PS for r in self.reqs for s in r} | set(self.pending))
        assert len(held) == sum(-(-len(r) // self.PS) for r in self.reqs) + len(self.pending)
        assert 0 not in held
        assert self.a.full_available_size() + len(held) * self.PS == self.PAGES * self.PS
        mapped = list(self.window.values()) + [w for w in self.pending.values() if w]
        assert len(mapped) == len(set(mapped))
        assert self.a.swa_available_size() + len(mapped) * self.PS == self.SWA_PAGES * self.PS
        free_full = free_ids(self.a.full_allocator)
        assert sorted({s // self.PS for s in free_full} | set(held)) == list(
            range(1, self.PAGES + 1)
        )
        assert not self.a.translate_loc_from_full_to_swa(tensor(free_full)).any(), (
            "a free slot stays mapped"
        )
        free_win = {s // self.PS for s in free_ids(self.a.swa_allocator)}
        assert sorted(free_win | set(mapped)) == list(range(1, self.SWA_PAGES + 1))
        for r in self.reqs:
            win = self.a.translate_loc_from_full_to_swa(tensor(r)).tolist()
            expected = [
                self.window[s // self.PS] * self.PS + s % self.PS
                if s // self.PS in self.window
                else 0
                for s in r
            ]
            assert win == expected


class StandardMachineNoDebug(StandardMachine):
    """The default options: bounds checked per call, or once per free group."""

    DEBUG = False


TestStandardAllocatorStateful = StandardMachine.TestCase
TestStandardAllocatorStateful.settings = STEPS
TestStandardAllocatorNoDebugStateful = StandardMachineNoDebug.TestCase
TestStandardAllocatorNoDebugStateful.settings = settings(STEPS, max_examples=40)
TestPagedAllocatorStateful = PagedMachine.TestCase
TestPagedAllocatorStateful.settings = STEPS
TestSWAAllocatorStateful = SWAMachine.TestCase
TestSWAAllocatorStateful.settings = STEPS
TestPagedSWAAllocatorStateful = PagedSWAMachine.TestCase
TestPagedSWAAllocatorStateful.settings = STEPS
