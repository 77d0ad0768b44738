"""Slot ownership (on by default): every bad free or take is an error naming the slot, and the
allocator is exactly as before (free count, free order, every slot's owner state)."""

from __future__ import annotations

import pytest
import torch

from kvplug.allocators import CACHED, FREE, HELD, PagedAllocator, StandardAllocator, SWAAllocator


def t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make(kind: str):
    if kind == "standard":
        return StandardAllocator(16, device="cpu")
    if kind == "paged":
        return PagedAllocator(16, 4, device="cpu")
    return SWAAllocator(16, 16, 4, device="cpu")


def snapshot(a) -> tuple:
    """Free count, the next slots alloc would hand out (undone), every slot's owner."""
    states = a.owner_state(torch.arange(a.page_size, a.size + a.page_size))
    window = a.full_to_swa_index_mapping.tolist() if hasattr(a, "swa_size") else None
    swa = a.swa_allocator.owner_state(torch.arange(1, 17)).tolist() if window else None
    return a.available_size(), tuple(states.tolist()), window, swa


KINDS = ["standard", "paged", "swa"]


@pytest.mark.parametrize("kind", KINDS)
def test_alloc_holds_take_caches_free_frees(kind):
    a = make(kind)
    slots = a.alloc(8)
    assert bool((a.owner_state(slots) == HELD).all())
    a.take_ownership(slots[:4])
    assert a.owner_state(slots).tolist() == [CACHED] * 4 + [HELD] * 4
    a.release_ownership(slots[:4])
    assert bool((a.owner_state(slots) == HELD).all())
    a.take_ownership(slots[:4])
    a.free(slots)  # held and cached slots alike
    assert bool((a.owner_state(slots) == FREE).all()) and a.available_size() == 16


def _bad_frees(a, held, cached, freed):
    return [
        (freed, "already free"),  # a double free
        (torch.cat([held[:1], freed]), "already free"),  # one bad slot among good ones
        (t(a.size + a.page_size - 1) if a.available_size() else freed, "already free"),
        (torch.cat([held[:2], held[:1]]), "twice in one call"),
        (torch.cat([cached[:1], cached[:1]]), "twice in one call"),
        (t(0), "padding"),
        (t(a.size + a.page_size), "out of range"),
    ]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", range(7))
def test_a_bad_free_is_an_error_and_changes_nothing(kind, case):
    a = make(kind)
    held = a.alloc(8)
    cached, held = held[:4], held[4:]
    a.take_ownership(cached)
    freed = a.alloc(4)
    a.free(freed)
    indices, match = _bad_frees(a, held, cached, freed)[case]
    before = snapshot(a)
    with pytest.raises(ValueError, match=match):
        a.free(indices)
    assert snapshot(a) == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "which, match",
    [
        ("cached", "owned by the cache, expected held"),
        ("free", "is free, expected held"),
        ("duplicate", "given twice in one call"),
        ("padding", "padding"),
    ],
)
def test_take_ownership_needs_slots_the_caller_holds(kind, which, match):
    a = make(kind)
    slots = a.alloc(8)
    a.take_ownership(slots[:4])
    freed = a.alloc(4)
    a.free(freed)
    indices = {
        "cached": torch.cat([slots[4:], slots[:4]]),  # the second key's slots, then the first's
        "free": freed,
        "duplicate": torch.cat([slots[4:6], slots[4:6]]),
        "padding": t(0),
    }[which]
    before = snapshot(a)
    with pytest.raises(ValueError, match=match):
        a.take_ownership(indices)
    assert snapshot(a) == before


@pytest.mark.parametrize("kind", KINDS)
def test_release_ownership_needs_cached_slots(kind):
    a = make(kind)
    slots = a.alloc(8)
    before = snapshot(a)
    with pytest.raises(ValueError, match="held by a request, expected owned by the cache"):
        a.release_ownership(slots)
    assert snapshot(a) == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("debug", [False, True])
def test_a_bad_free_in_a_group_releases_nothing_of_the_group(kind, debug):
    a = {
        "standard": StandardAllocator(16, device="cpu", debug_checks=debug),
        "paged": PagedAllocator(16, 4, device="cpu", debug_checks=debug),
        "swa": SWAAllocator(16, 16, 4, device="cpu", debug_checks=debug),
    }[kind]
    held = a.alloc(8)
    before = snapshot(a)
    a.free_group_begin()
    a.free(held[:4])
    a.free(held[:1])  # the same slot again, in another call of the group
    with pytest.raises(ValueError, match="twice in one call"):
        a.free_group_end()
    assert not a.in_free_group
    assert snapshot(a) == before


def test_paged_ownership_is_per_page():
    a = PagedAllocator(16, 4, device="cpu")
    slots = a.alloc(8)
    a.take_ownership(slots[:4])  # page 1
    assert a.owner_state(t(4, 7, 8)).tolist() == [CACHED, CACHED, HELD]
    a.free(t(5))  # one slot frees its page
    with pytest.raises(ValueError, match="page 1 is already free"):
        a.free(t(6))
    assert a.available_size() == 12


def test_swa_ownership_covers_both_pools():
    a = SWAAllocator(16, 16, 4, device="cpu")
    slots = a.alloc(4)
    window = a.translate_loc_from_full_to_swa(slots)
    a.take_ownership(slots)
    assert bool((a.swa_allocator.owner_state(window) == CACHED).all())
    a.free_swa(slots[:2])
    assert a.swa_allocator.owner_state(window).tolist() == [FREE, FREE, CACHED, CACHED]
    a.free(slots)
    assert bool((a.owner_state(slots) == FREE).all())
    assert bool((a.swa_allocator.owner_state(window) == FREE).all())
    assert (a.full_available_size(), a.swa_available_size()) == (16, 16)


def test_without_ownership_checks_the_caller_is_trusted():
    a = StandardAllocator(8, device="cpu", ownership_checks=False)
    slots = a.alloc(4)
    a.take_ownership(slots)  # a no-op
    a.take_ownership(slots)
    a.free(slots[:2])
    a.free(slots[:2])  # not detected: the documented price of the opt-out
    assert a.available_size() == 8
    with pytest.raises(RuntimeError, match="ownership is not tracked"):
        a.owner_state(slots)


def test_translate_maps_minus_one_to_minus_one_and_checks_its_input():
    a = SWAAllocator(16, 16, 4, device="cpu")
    slots = a.alloc(2)
    window = a.translate_loc_from_full_to_swa(slots)
    assert a.translate_loc_from_full_to_swa(torch.cat([t(-1), slots])).tolist() == [
        -1,
        *window.tolist(),
    ]
    assert a.translate_loc_from_full_to_swa(t(-1, -1).view(2, 1)).tolist() == [[-1], [-1]]
    with pytest.raises(ValueError, match="out of range"):
        a.translate_loc_from_full_to_swa(t(-2))
    with pytest.raises(ValueError, match="out of range"):
        a.translate_loc_from_full_to_swa(t(17))
    with pytest.raises(TypeError, match="dtype"):
        a.translate_loc_from_full_to_swa(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        a.translate_loc_from_full_to_swa([1, 2])


def test_move_swa_checks_before_it_moves():
    a = SWAAllocator(16, 16, 4, device="cpu")
    src, dst = a.alloc(2), a.alloc(2)
    a.free_swa(dst)
    window = a.translate_loc_from_full_to_swa(src).tolist()
    mapped = a.alloc(2)
    before = a.full_to_swa_index_mapping.clone()
    with pytest.raises(ValueError, match="2 source slots but 1 targets"):
        a.move_swa(src, dst[:1])
    with pytest.raises(ValueError, match="still have one"):
        a.move_swa(src, mapped)
    with pytest.raises(ValueError, match="twice in one call"):
        a.move_swa(src, src)
    assert torch.equal(a.full_to_swa_index_mapping, before)
    a.move_swa(src, dst)
    assert a.translate_loc_from_full_to_swa(dst).tolist() == window
    assert a.translate_loc_from_full_to_swa(src).tolist() == [0, 0]


@pytest.mark.parametrize("kind", ["standard", "paged", "swa"])
def test_each_check_path_is_the_one_in_use(kind: str, check_path: str) -> None:
    """The conftest's two runs really take the two paths (NumPy views only on the host path)."""
    a = make(kind)
    inner = a.full_allocator if kind == "swa" else a
    assert a._host is (check_path == "host")
    assert (inner._stack.state_np is not None) is (check_path == "host")
    held = a.alloc(8)
    a.free(held[:4])
    with pytest.raises(ValueError, match="already free"):
        a.free(held[:1])
