"""Unit tests of the standard, paged and swa allocators: every method and error, exact numbers."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvplug.allocators import (
    PagedAllocator,
    PagedAllocatorOptions,
    StandardAllocator,
    StandardAllocatorOptions,
    SWAAllocator,
    SWAAllocatorOptions,
    default_swa_layer_ids,
)
from kvplug.pools import HybridSWAKVPool, MHAKVPool
from kvplug_hookspecs import (
    ComponentSelection,
    EvictParams,
    PoolGeometry,
    SWATokenAllocator,
    TokenAllocator,
)

CPU = torch.device("cpu")


def t(*values: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def std(size: int = 8, **kw) -> StandardAllocator:
    return StandardAllocator(size, device="cpu", **kw)


def snapshot(alloc) -> tuple:
    """Everything observable: free count and the order the next allocation would hand out."""
    probe = copy.deepcopy(alloc)
    return probe.available_size(), probe.alloc(probe.available_size()).tolist()


# ===========================================================================================
# standard
# ===========================================================================================


def test_standard_fresh_state():
    a = std(8)
    assert (a.size, a.page_size, a.device, a.pool) == (8, 1, CPU, None)
    assert a.available_size() == 8
    assert isinstance(a, TokenAllocator)


def test_standard_alloc_hands_out_distinct_slots_from_1_never_0():
    a = std(8)
    first = a.alloc(3)
    assert first.tolist() == [1, 2, 3]
    assert first.dtype is torch.int64 and first.device == CPU
    assert a.alloc(5).tolist() == [4, 5, 6, 7, 8]
    assert a.available_size() == 0
    assert a.alloc(1) is None


def test_standard_alloc_returns_a_new_tensor_the_caller_may_modify():
    a = std(4)
    out = a.alloc(2)
    out.fill_(0)
    assert a.alloc(2).tolist() == [3, 4]
    a.free(t(1, 2))
    assert a.alloc(2).tolist() == [1, 2]


def test_standard_alloc_zero_is_an_empty_tensor_and_changes_nothing():
    a = std(4)
    out = a.alloc(0)
    assert out.shape == (0,) and out.dtype is torch.int64
    assert a.available_size() == 4
    assert a.alloc(1).tolist() == [1]


def test_standard_alloc_more_than_free_is_none_without_partial_allocation():
    a = std(8)
    a.alloc(6)
    before = snapshot(a)
    assert a.alloc(3) is None
    assert a.alloc(9) is None
    assert snapshot(a) == before == (2, [7, 8])


def test_standard_free_returns_slots_and_reuses_most_recent_first():
    a = std(8)
    held = a.alloc(5)
    a.free(held[1:3])  # slots 2, 3
    assert a.available_size() == 5
    assert a.alloc(3).tolist() == [2, 3, 6]


def test_standard_free_accepts_int32_and_empty():
    a = std(4, debug_checks=True)
    a.alloc(4)
    a.free(t(4, 2, dtype=torch.int32))
    a.free(t())
    assert a.available_size() == 2
    out = a.alloc(2)
    assert out.dtype is torch.int64 and out.tolist() == [4, 2]


@pytest.mark.parametrize(
    "need, error, match",
    [
        (-1, ValueError, "need_size must be >= 0, got -1"),
        (1.5, TypeError, "need_size must be an int, got float"),
        (True, TypeError, "need_size must be an int, got bool"),
        ("2", TypeError, "need_size must be an int, got str"),
    ],
)
def test_standard_bad_alloc_sizes(need, error, match):
    a = std(4)
    with pytest.raises(error, match=match):
        a.alloc(need)
    assert snapshot(a) == (4, [1, 2, 3, 4])


@pytest.mark.parametrize(
    "indices, error, match",
    [
        (t(0), ValueError, r"slot 0 is in the reserved padding page \(slots 0..0\)"),
        (t(2, 0), ValueError, "slot 0 is in the reserved padding page"),
        (t(9), ValueError, r"slot 9 out of range: valid slots are 1..8"),
        (t(-3, 2), ValueError, "slot -3 out of range"),
        ([1, 2], TypeError, "indices must be a torch.Tensor, got list"),
        (
            torch.tensor([1.0]),
            TypeError,
            "indices has dtype torch.float32; expected torch.int64 or torch.int32",
        ),
        (torch.tensor([1], dtype=torch.int16), TypeError, "dtype torch.int16"),
        (torch.tensor([[1, 2]]), ValueError, r"indices must be 1-D, got shape \(1, 2\)"),
        (torch.tensor(1), ValueError, "indices must be 1-D"),
        (torch.tensor([1], device="meta"), ValueError, "indices are on meta, expected cpu"),
    ],
)
def test_standard_bad_free_is_rejected_and_changes_nothing(indices, error, match):
    a = std(8)
    a.alloc(8)
    a.free(t(5, 6))
    before = snapshot(a)
    with pytest.raises(error, match=match):
        a.free(indices)
    assert snapshot(a) == before == (2, [5, 6])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_standard_free_rejects_indices_on_another_device():
    a = std(8)
    a.alloc(2)
    with pytest.raises(ValueError, match="indices are on cuda"):
        a.free(t(1).cuda())
    assert a.available_size() == 6


def test_standard_double_free_is_caught_in_debug_mode():
    a = std(8, debug_checks=True)
    a.alloc(4)
    a.free(t(2))
    before = snapshot(a)
    with pytest.raises(ValueError, match="slot 2 is already free"):
        a.free(t(3, 2))
    with pytest.raises(ValueError, match="slot 7 is already free"):
        a.free(t(7))
    with pytest.raises(ValueError, match="slot 3 is freed twice in one call"):
        a.free(t(3, 1, 3))
    assert snapshot(a) == before == (5, [2, 5, 6, 7, 8])


def test_standard_freeing_more_than_is_held_is_caught_without_debug_mode():
    a = std(8)
    a.alloc(2)
    with pytest.raises(ValueError, match=r"freeing 3 slot\(s\) but only 2 are allocated"):
        a.free(t(1, 2, 1))
    assert a.available_size() == 6


def test_standard_debug_mode_checks_bounds_even_when_check_bounds_is_off():
    a = std(4, debug_checks=True, check_bounds=False)
    a.alloc(4)
    with pytest.raises(ValueError, match="slot 0 is in the reserved padding page"):
        a.free(t(0))
    assert a.available_size() == 0


def test_standard_without_bounds_checks_does_not_range_check():
    a = std(4, check_bounds=False)
    a.alloc(4)
    a.free(t(3))  # the metadata checks still run; the value check is skipped
    with pytest.raises(TypeError):
        a.free(t(3, dtype=torch.float32))
    assert a.available_size() == 1


def test_standard_free_group_defers_and_batches_frees():
    a = std(8)
    held = a.alloc(6)
    a.free_group_begin()
    assert a.in_free_group
    a.free(held[:2])
    a.free(held[4:])
    a.free(t())
    assert a.available_size() == 2
    a.free_group_end()
    assert not a.in_free_group
    assert a.available_size() == 6
    assert a.alloc(6).tolist() == [1, 2, 5, 6, 7, 8]


def test_standard_free_group_context_manager_frees_even_on_error():
    a = std(8)
    held = a.alloc(4)
    with pytest.raises(KeyError), a.free_group():
        a.free(held[:3])
        assert a.available_size() == 4
        raise KeyError("boom")
    assert a.available_size() == 7
    with a.free_group():
        pass
    assert a.available_size() == 7


def test_standard_free_group_misuse_is_an_error():
    a = std(4)
    with pytest.raises(RuntimeError, match="without free_group_begin"):
        a.free_group_end()
    a.free_group_begin()
    with pytest.raises(RuntimeError, match="do not nest"):
        a.free_group_begin()
    a.free_group_end()


def test_standard_free_group_checks_each_call_and_double_frees_at_the_end():
    a = std(8, debug_checks=True)
    a.alloc(4)
    a.free_group_begin()
    a.free(t(1))
    with pytest.raises(ValueError, match="slot 0"):
        a.free(t(0))
    a.free(t(1))
    with pytest.raises(ValueError, match="slot 1 is freed twice in one call"):
        a.free_group_end()
    assert not a.in_free_group
    assert a.available_size() == 4  # nothing of the rejected group was freed


def test_standard_free_group_range_checks_once_at_the_end_without_debug_mode():
    a = std(8)
    held = a.alloc(4)
    a.free_group_begin()
    a.free(held[:2])
    a.free(t(0))  # accepted for now: a group pays one range check (one host sync), at its end
    with pytest.raises(TypeError, match="dtype torch.float32"):
        a.free(t(1, dtype=torch.float32))  # metadata is checked at the call
    with pytest.raises(ValueError, match="slot 0 is in the reserved padding page"):
        a.free_group_end()
    assert not a.in_free_group
    assert snapshot(a) == (4, [5, 6, 7, 8])  # nothing of the rejected group was freed


def test_standard_clear_frees_everything_and_drops_an_open_group():
    a = std(4, debug_checks=True)
    a.alloc(3)
    a.free_group_begin()
    a.free(t(1))
    a.clear()
    assert not a.in_free_group
    assert snapshot(a) == (4, [1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"freeing 1 slot\(s\) but only 0 are allocated"):
        a.free(t(1))


@pytest.mark.parametrize(
    "size, error, match",
    [
        (0, ValueError, r"size \(capacity in tokens\) must be > 0, got 0"),
        (-4, ValueError, "got -4"),
        (2.0, TypeError, "size must be an int"),
    ],
)
def test_standard_bad_capacity(size, error, match):
    with pytest.raises(error, match=match):
        StandardAllocator(size, device="cpu")


# -- shortfall: the seed bug ----------------------------------------------------------------


def test_shortfall_is_the_missing_tokens_not_the_request():
    a = std(100)
    a.alloc(95)
    assert a.available_size() == 5
    assert a.shortfall(20) == EvictParams(num_tokens=15)


def test_shortfall_is_none_when_enough_is_free():
    a = std(100)
    a.alloc(70)
    assert a.available_size() == 30
    assert a.shortfall(20) is None
    assert a.shortfall(30) is None
    assert a.shortfall(31) == EvictParams(num_tokens=1)
    assert a.shortfall(0) is None


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (2.5, TypeError), (None, TypeError)])
def test_shortfall_rejects_bad_sizes(bad, error):
    with pytest.raises(error, match="num_tokens"):
        std(4).shortfall(bad)


# -- building --------------------------------------------------------------------------------


def test_standard_from_geometry_builds_its_pool():
    g = PoolGeometry(
        capacity_tokens=32, num_layers=2, kv_heads=2, head_dim=8, dtype="float32", device="cpu"
    )
    a = StandardAllocator.from_geometry(g, StandardAllocatorOptions(debug_checks=True))
    assert isinstance(a.pool, MHAKVPool)
    assert (a.size, a.device, a.debug_checks, a.check_bounds) == (32, CPU, True, True)
    assert a.pool.get_k(1).shape == (33, 2, 8)
    slots = a.alloc(2)
    a.pool.set_kv(0, slots, torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    assert a.pool.get_k(0)[slots].sum().item() == 32.0


def test_standard_from_geometry_rejects_pages():
    g = PoolGeometry(capacity_tokens=32, page_size=4, device="cpu")
    with pytest.raises(ValueError, match="page_size 1.*got page_size=4; use the 'paged' allocator"):
        StandardAllocator.from_geometry(g, StandardAllocatorOptions())


def test_options_reject_unknown_and_non_bool_fields():
    with pytest.raises(ValidationError, match="debug_check"):
        StandardAllocatorOptions(debug_check=True)
    with pytest.raises(ValidationError, match="check_bounds"):
        PagedAllocatorOptions(check_bounds="yes")


# ===========================================================================================
# paged
# ===========================================================================================


def paged(size: int = 32, page_size: int = 4, **kw) -> PagedAllocator:
    return PagedAllocator(size, page_size, device="cpu", **kw)


def test_paged_alloc_hands_out_whole_pages_from_page_1():
    a = paged(32, 4)
    assert (a.size, a.page_size, a.num_pages, a.available_size(), a.available_pages()) == (
        32,
        4,
        8,
        32,
        8,
    )
    assert a.alloc(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert a.available_size() == 24
    assert a.alloc(0).tolist() == []
    assert a.alloc(28) is None
    assert a.available_size() == 24


def test_paged_alloc_size_must_be_page_aligned():
    a = paged(32, 4)
    with pytest.raises(ValueError, match="need_size=6 is not a multiple of page_size=4"):
        a.alloc(6)
    with pytest.raises(ValueError, match="need_size must be >= 0"):
        a.alloc(-4)
    assert a.available_size() == 32


def test_paged_free_frees_each_touched_page_once():
    a = paged(32, 4)
    a.alloc(16)  # pages 1..4 = slots 4..19
    a.free(t(9, 5, 6))  # slots of pages 2 and 1
    assert a.available_size() == 24
    assert a.alloc(8).tolist() == [8, 9, 10, 11, 4, 5, 6, 7]  # reused in the order freed


def test_standard_offers_the_paged_extend_and_decode_api():
    a = std(8)
    assert a.alloc_extend(t(0, 3), t(2, 5), t(-1, 7), 4).tolist() == [1, 2, 3, 4]
    assert a.alloc_decode(t(3, 6), t(2, 4)).tolist() == [5, 6]
    assert a.alloc_extend(t(0), t(3), t(-1), 3) is None
    with pytest.raises(ValueError, match="batch tensors differ in length"):
        a.alloc_extend(t(0, 1), t(3), t(-1), 3)
    with pytest.raises(TypeError, match="seq_lens has dtype"):
        a.alloc_decode(torch.tensor([1.0]), t(1))
    assert a.available_size() == 2


def test_paged_free_accepts_int32():
    a = paged(32, 4, debug_checks=True)
    a.alloc(8)
    a.free(t(5, 9, dtype=torch.int32))
    assert a.available_size() == 32


def test_paged_free_group_merges_slots_of_the_same_page():
    a = paged(32, 4, debug_checks=True)
    a.alloc(8)
    with a.free_group():
        a.free(t(4, 5))
        a.free(t(6, 7, 8))
    assert a.available_size() == 32


@pytest.mark.parametrize(
    "indices, match",
    [
        (t(3), r"slot 3 is in the reserved padding page \(slots 0..3\)"),
        (t(36), r"slot 36 out of range: valid slots are 4..35"),
    ],
)
def test_paged_free_bounds(indices, match):
    a = paged(32, 4)
    a.alloc(32)
    with pytest.raises(ValueError, match=match):
        a.free(indices)
    assert a.available_size() == 0


def test_paged_double_free_in_debug_mode():
    a = paged(32, 4, debug_checks=True)
    a.alloc(8)
    a.free(t(4))
    with pytest.raises(ValueError, match="page 1 is already free"):
        a.free(t(7))
    assert a.available_size() == 28


def test_paged_shortfall_rounds_up_to_whole_pages():
    a = paged(32, 4)
    a.alloc(24)
    assert a.available_size() == 8
    assert a.shortfall(8) is None
    assert a.shortfall(9) == EvictParams(num_tokens=4)
    assert a.shortfall(13) == EvictParams(num_tokens=8)
    assert a.shortfall(16) == EvictParams(num_tokens=8)
    with pytest.raises(ValueError):
        a.shortfall(-1)


def test_paged_extend_continues_partial_pages_then_takes_new_ones():
    a = paged(32, 4)
    a.alloc(8)  # pages 1, 2
    out = a.alloc_extend(
        prefix_lens=t(0, 2, 4, 5),
        seq_lens=t(5, 3, 9, 6),
        last_loc=t(-1, 5, 7, 8),
        extend_num_tokens=12,
    )
    # req 0: new pages 3, 4; req 1: slot after 5; req 2: new pages 5, 6; req 3: slot after 8
    assert out.tolist() == [12, 13, 14, 15, 16, 6, 20, 21, 22, 23, 24, 9]
    assert out.dtype is torch.int64
    assert a.available_size() == 8


def test_paged_extend_accepts_int32_batches():
    a = paged(16, 4)
    out = a.alloc_extend(
        t(0, dtype=torch.int32), t(3, dtype=torch.int32), t(-1, dtype=torch.int32), 3
    )
    assert out.tolist() == [4, 5, 6] and out.dtype is torch.int64


def test_paged_extend_short_of_pages_is_none_and_takes_nothing():
    a = paged(16, 4)
    a.alloc(8)
    before = snapshot(a)
    assert a.alloc_extend(t(0, 0), t(4, 5), t(-1, -1), 9) is None
    assert snapshot(a) == before
    assert a.alloc_extend(t(0, 0), t(4, 4), t(-1, -1), 8).tolist() == [
        12,
        13,
        14,
        15,
        16,
        17,
        18,
        19,
    ]


def test_paged_extend_of_an_empty_batch():
    a = paged(16, 4)
    assert a.alloc_extend(t(), t(), t(), 0).tolist() == []
    assert a.available_size() == 16


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((t(3), t(2), t(6), 0), ValueError, "seq_lens must be >= prefix_lens"),
        (
            (t(0), t(3), t(-1), 4),
            ValueError,
            r"extend_num_tokens=4 but sum\(seq_lens - prefix_lens\)=3",
        ),
        (
            (t(2), t(4), t(6), 2),
            ValueError,
            r"last_loc that is not a usable slot at offset \(prefix_len - 1\)",
        ),
        (
            (t(3), t(4), t(2), 1),
            ValueError,
            "1 request.s. have a last_loc that is not a usable slot",
        ),
        ((t(3), t(4), t(38), 1), ValueError, "last_loc that is not a usable slot"),
        (
            (t(0, 1), t(3), t(-1), 3),
            ValueError,
            "batch tensors differ in length: prefix_lens=2, seq_lens=1",
        ),
        ((t(0), torch.tensor([3.0]), t(-1), 3), TypeError, "seq_lens has dtype torch.float32"),
        ((t(0), t(3), t(-1), -3), ValueError, "extend_num_tokens must be >= 0"),
    ],
)
def test_paged_extend_bad_input(args, error, match):
    a = paged(16, 4)
    with pytest.raises(error, match=match):
        a.alloc_extend(*args)
    assert snapshot(a) == (16, list(range(4, 20)))


def test_paged_decode_takes_a_new_page_only_on_page_boundaries():
    a = paged(32, 4)
    a.alloc(12)  # pages 1..3
    # seq 4: token 3 continues after slot 6; seq 5: token 4 starts a page; seq 1: a new request
    out = a.alloc_decode(seq_lens=t(4, 5, 1, 2), last_loc=t(6, 11, -1, 8))
    assert out.tolist() == [7, 16, 20, 9]
    assert a.available_size() == 12


def test_paged_decode_short_and_bad_input():
    a = paged(8, 4)
    a.alloc(8)
    assert a.alloc_decode(t(5), t(7)) is None
    assert a.alloc_decode(t(3), t(5)).tolist() == [6]
    with pytest.raises(ValueError, match="seq_lens < 1 or a last_loc"):
        a.alloc_decode(t(0), t(-1))
    with pytest.raises(
        ValueError, match=r"not a usable slot at offset \(seq_len - 2\) % page_size"
    ):
        a.alloc_decode(t(3), t(6))
    with pytest.raises(ValueError, match="not a usable slot"):
        a.alloc_decode(t(3), t(1))  # offset fits, but slot 1 is in the padding page
    assert a.alloc_decode(t(), t()).tolist() == []
    assert a.available_size() == 0


def fill_pages(pages: list[int], page_size: int, start: int, count: int, last: int) -> list[int]:
    """Reference: slots for positions start..start+count-1 of one request, one token at a time."""
    out = []
    for pos in range(start, start + count):
        last = pages.pop(0) * page_size if pos % page_size == 0 else last + 1
        out.append(last)
    return out


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 8]),
    requests=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=6),
)
def test_paged_extend_and_decode_match_a_token_by_token_reference(page_size, requests):
    a = paged(300 * page_size, page_size, debug_checks=True)  # room for 6 requests of 41 tokens
    # give each request its prefix first
    prefix_lens = [pre for pre, _ in requests]
    prefix = a.alloc_extend(
        t(*[0] * len(requests)), t(*prefix_lens), t(*[-1] * len(requests)), sum(prefix_lens)
    )
    ends = torch.cumsum(t(*prefix_lens), 0)
    last_loc = [int(prefix[e - 1]) if pre else -1 for pre, e in zip(prefix_lens, ends.tolist())]

    seq_lens = [pre + ext for pre, ext in requests]
    new_pages = sum(-(-s // page_size) - -(-p // page_size) for p, s in zip(prefix_lens, seq_lens))
    pages = (
        copy.deepcopy(a)
        .alloc(new_pages * page_size)[::page_size]
        .div(page_size, rounding_mode="floor")
        .tolist()
    )
    expected = []
    for pre, seq, last in zip(prefix_lens, seq_lens, last_loc):
        expected += fill_pages(pages, page_size, pre, seq - pre, last)
    free_before = a.available_size()
    out = a.alloc_extend(
        t(*prefix_lens), t(*seq_lens), t(*last_loc), sum(seq_lens) - sum(prefix_lens)
    )
    assert out.tolist() == expected
    assert a.available_size() == free_before - new_pages * page_size

    # then one decode step for every request
    ends = list(torch.cumsum(t(*(s - p for p, s in zip(prefix_lens, seq_lens))), 0).tolist())
    last_loc = [
        int(out[e - 1]) if s > p else last
        for p, s, e, last in zip(prefix_lens, seq_lens, ends, last_loc)
    ]
    dec_pages = sum(1 for s in seq_lens if s % page_size == 0)
    pages = (
        copy.deepcopy(a)
        .alloc(dec_pages * page_size)[::page_size]
        .div(page_size, rounding_mode="floor")
        .tolist()
    )
    expected = [fill_pages(pages, page_size, s, 1, last)[0] for s, last in zip(seq_lens, last_loc)]
    out = a.alloc_decode(t(*(s + 1 for s in seq_lens)), t(*last_loc))
    assert out.tolist() == expected


@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_extend_of_one_request_equals_the_batched_path(page_size):
    """One request takes a shortcut (a few torch calls); it must give the batched result."""
    for pre in (0, 1, 3, 4, 5, 8):
        for ext in (0, 1, 3, 4, 5, 9):
            one, two = paged(24 * page_size, page_size), paged(24 * page_size, page_size)
            one.alloc(3 * page_size), two.alloc(3 * page_size)  # pages 1..3 are taken
            last = -1
            if pre:
                prefix = one.alloc_extend(t(0), t(pre), t(-1), pre)
                assert two.alloc_extend(t(0, 0), t(pre, 0), t(-1, -1), pre).equal(prefix)
                last = int(prefix[-1])
            out = one.alloc_extend(t(pre), t(pre + ext), t(last), ext)
            # an empty second request puts the same call on the batched path
            assert out.equal(two.alloc_extend(t(pre, 0), t(pre + ext, 0), t(last, -1), ext))
            assert one.available_size() == two.available_size()


def test_paged_from_geometry():
    g = PoolGeometry(
        capacity_tokens=64, page_size=16, num_layers=1, kv_heads=1, head_dim=4, device="cpu"
    )
    a = PagedAllocator.from_geometry(g, PagedAllocatorOptions())
    assert (a.size, a.page_size, a.num_pages) == (64, 16, 4)
    assert a.pool.get_k(0).shape == (80, 1, 4)
    assert a.alloc(16).tolist() == list(range(16, 32))


@pytest.mark.parametrize(
    "size, page_size, match",
    [
        (30, 4, "size=30 is not a multiple of page_size=4"),
        (32, 0, "page_size must be a positive int"),
        (0, 4, "must be > 0"),
    ],
)
def test_paged_bad_construction(size, page_size, match):
    with pytest.raises(ValueError, match=match):
        PagedAllocator(size, page_size, device="cpu")


# ===========================================================================================
# swa
# ===========================================================================================


def swa(size: int = 16, swa_size: int = 4, window: int = 4, **kw) -> SWAAllocator:
    return SWAAllocator(size, swa_size, window, device="cpu", **kw)


def test_swa_fresh_state_and_protocol():
    a = swa(16, 4, 8)
    assert (a.size, a.size_full, a.swa_size, a.sliding_window_size, a.page_size) == (
        16,
        16,
        4,
        8,
        1,
    )
    assert (a.full_available_size(), a.swa_available_size(), a.available_size()) == (16, 4, 4)
    assert isinstance(a, SWATokenAllocator)


def test_swa_alloc_takes_both_sides_and_maps_them():
    a = swa(16, 4)
    a.full_allocator.alloc(2)  # make the two sides differ
    full = a.alloc(3)
    assert full.tolist() == [3, 4, 5]
    assert a.translate_loc_from_full_to_swa(full).tolist() == [1, 2, 3]
    assert a.translate_loc_from_full_to_swa(t(1, 6)).tolist() == [0, 0]
    assert (a.full_available_size(), a.swa_available_size(), a.available_size()) == (11, 1, 1)


def test_swa_alloc_is_none_when_either_side_is_short():
    a = swa(8, 4)
    assert a.alloc(5) is None  # window short
    full = a.alloc(4)
    assert a.alloc(1) is None
    a.free_swa(full)
    assert a.alloc(5) is None  # full short (4 left), window has 4
    assert (a.full_available_size(), a.swa_available_size()) == (4, 4)


def test_swa_free_frees_both_sides():
    a = swa(16, 4)
    full = a.alloc(3)
    a.free(full[1:])
    assert (a.full_available_size(), a.swa_available_size()) == (15, 3)
    assert a.translate_loc_from_full_to_swa(full).tolist() == [1, 0, 0]


def test_swa_free_swa_frees_only_the_window_side_then_free_only_the_full_side():
    a = swa(16, 4, debug_checks=True)
    full = a.alloc(4)
    a.free_swa(full[:3])
    assert (a.full_available_size(), a.swa_available_size()) == (12, 3)
    assert a.translate_loc_from_full_to_swa(full).tolist() == [0, 0, 0, 4]
    a.free_swa(full[:1])  # already unmapped: nothing more to free
    assert a.swa_available_size() == 3
    a.free(full)
    assert (a.full_available_size(), a.swa_available_size()) == (16, 4)


def test_swa_accepts_int32_and_translates_any_shape():
    a = swa(16, 4, debug_checks=True)
    full = a.alloc(4)
    assert a.translate_loc_from_full_to_swa(full.view(2, 2).int()).tolist() == [[1, 2], [3, 4]]
    a.free_swa(full[:1].int())
    a.free(full.int())
    assert (a.full_available_size(), a.swa_available_size()) == (16, 4)


def test_swa_free_group_defers_both_sides():
    a = swa(16, 4)
    full = a.alloc(4)
    with a.free_group():
        a.free(full[:2])
        a.free_swa(full[2:3])  # immediate, even inside the group
        assert (a.full_available_size(), a.swa_available_size()) == (12, 1)
        a.free(full[2:])
    assert (a.full_available_size(), a.swa_available_size()) == (16, 4)


def test_swa_shortfall_per_pool():
    a = swa(20, 13)
    a.alloc(10)
    assert (a.full_available_size(), a.swa_available_size()) == (10, 3)
    assert a.shortfall(8) == EvictParams(num_tokens=0, swa_num_tokens=5)
    assert a.shortfall(12) == EvictParams(num_tokens=2, swa_num_tokens=9)
    assert a.shortfall(3) is None
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        a.shortfall(-1)


def test_swa_bad_free_changes_nothing():
    a = swa(8, 4, debug_checks=True)
    full = a.alloc(2)
    for bad, match in [
        (t(0), "slot 0"),
        (t(9), "slot 9 out of range"),
        (t(5), "slot 5 is already free"),
    ]:
        with pytest.raises(ValueError, match=match):
            a.free(bad)
    with pytest.raises(ValueError, match="slot 0"):
        a.free_swa(t(0))
    assert (a.full_available_size(), a.swa_available_size()) == (6, 2)
    assert a.translate_loc_from_full_to_swa(full).tolist() == [1, 2]


def test_swa_clear():
    a = swa(8, 4)
    a.alloc(3)
    a.clear()
    assert (a.full_available_size(), a.swa_available_size()) == (8, 4)
    assert not a.full_to_swa_index_mapping.any()


def test_swa_bad_construction():
    with pytest.raises(ValueError, match="sliding_window_size must be a positive int"):
        swa(8, 4, 0)
    with pytest.raises(ValueError, match="must be > 0, got 0"):
        swa(8, 0, 4)


def test_default_swa_layer_split():
    assert default_swa_layer_ids(6, 2) == (0, 2, 4)
    assert default_swa_layer_ids(12, 6) == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert default_swa_layer_ids(1, 2) == (0,)


def test_swa_from_geometry_builds_a_hybrid_pool():
    g = PoolGeometry(
        capacity_tokens=32, num_layers=6, kv_heads=1, head_dim=4, dtype="float32", device="cpu"
    )
    a = SWAAllocator.from_geometry(
        g, SWAAllocatorOptions(swa_capacity_tokens=8, sliding_window_size=4)
    )
    assert isinstance(a.pool, HybridSWAKVPool)
    assert a.pool.swa_layer_ids == (0, 2, 4) and a.pool.full_layer_ids == (1, 3, 5)
    assert (a.size, a.swa_size) == (32, 8)
    assert a.full_allocator.pool is a.pool.full and a.swa_allocator.pool is a.pool.swa
    full = a.alloc(2)
    a.pool.set_kv(
        0, a.translate_loc_from_full_to_swa(full), torch.ones(2, 1, 4), torch.ones(2, 1, 4)
    )
    a.pool.set_kv(1, full, torch.full((2, 1, 4), 2.0), torch.ones(2, 1, 4))
    assert a.pool.swa.get_k(0)[1:3].sum().item() == 8.0
    assert a.pool.full.get_k(0)[1:3].sum().item() == 16.0

    explicit = SWAAllocator.from_geometry(
        g, SWAAllocatorOptions(swa_capacity_tokens=8, sliding_window_size=4, swa_layer_ids=[5, 0])
    )
    assert explicit.pool.swa_layer_ids == (0, 5) and explicit.pool.full_layer_ids == (1, 2, 3, 4)


def test_paged_swa_from_geometry():
    g = PoolGeometry(capacity_tokens=64, page_size=4, num_layers=2, head_dim=4, device="cpu")
    a = SWAAllocator.from_geometry(
        g, SWAAllocatorOptions(swa_capacity_tokens=16, sliding_window_size=8)
    )
    assert (a.page_size, a.full_allocator.page_size, a.swa_allocator.page_size) == (4, 4, 4)
    assert type(a.full_allocator) is PagedAllocator
    assert a.pool.full.get_k(0).shape == (68, 1, 4) and a.pool.swa.get_k(0).shape == (20, 1, 4)


def paged_swa(**kw) -> SWAAllocator:
    return SWAAllocator(32, 16, 8, page_size=4, device="cpu", debug_checks=True, **kw)


def test_paged_swa_alloc_maps_whole_pages():
    a = paged_swa()
    a.full_allocator.alloc(8)  # make the two sides differ
    full = a.alloc(4)
    assert full.tolist() == [12, 13, 14, 15]
    assert a.translate_loc_from_full_to_swa(full).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="need_size=3 is not a multiple of page_size=4"):
        a.alloc(3)
    assert a.alloc(16) is None  # window has 12 left
    assert (a.full_available_size(), a.swa_available_size()) == (20, 12)


def test_paged_swa_extend_and_decode_continue_pages_on_both_sides():
    a = paged_swa()
    a.full_allocator.alloc(4)  # full page 1 taken: full page p maps to window page p - 1
    x = a.alloc_extend(t(0, 0), t(5, 3), t(-1, -1), 8)
    assert x.tolist() == [8, 9, 10, 11, 12, 16, 17, 18]
    assert a.translate_loc_from_full_to_swa(x).tolist() == [4, 5, 6, 7, 8, 12, 13, 14]
    y = a.alloc_decode(t(6, 4), t(12, 18))
    assert y.tolist() == [13, 19]
    assert a.translate_loc_from_full_to_swa(y).tolist() == [9, 15]
    assert (a.full_available_size(), a.swa_available_size()) == (16, 4)


def test_paged_swa_allocation_short_on_one_side_takes_nothing_on_either():
    a = paged_swa()
    x = a.alloc_extend(t(0), t(13), t(-1), 13)  # 4 pages each side; window has 0 pages left
    before = (snapshot(a.full_allocator), snapshot(a.swa_allocator))
    assert (
        a.alloc_extend(t(13), t(17), x[-1:], 4) is None
    )  # continues page 4, then needs a new page
    assert a.alloc_decode(t(17), t(int(x[-1]) + 3)) is None
    assert (snapshot(a.full_allocator), snapshot(a.swa_allocator)) == before
    assert a.alloc_extend(t(13), t(16), x[-1:], 3).tolist() == [17, 18, 19]  # stays in its page


def test_paged_swa_extend_after_the_window_page_was_freed_is_an_error_and_takes_nothing():
    a = paged_swa()
    x = a.alloc_extend(t(0), t(6), t(-1), 6)
    a.free_swa(x[-1:])  # the partial last page leaves the window
    before = (snapshot(a.full_allocator), snapshot(a.swa_allocator))
    with pytest.raises(ValueError, match="last_loc that is not a usable slot"):
        a.alloc_extend(t(6), t(12), x[-1:], 6)
    assert (snapshot(a.full_allocator), snapshot(a.swa_allocator)) == before


def test_paged_swa_frees_whole_pages_on_each_side():
    a = paged_swa()
    x = a.alloc(12)
    a.free_swa(x[1:2])  # one slot of the first page: its whole window page goes
    assert a.translate_loc_from_full_to_swa(x).tolist() == [
        0,
        0,
        0,
        0,
        8,
        9,
        10,
        11,
        12,
        13,
        14,
        15,
    ]
    assert (a.full_available_size(), a.swa_available_size()) == (20, 8)
    a.free(x[5:6])  # one slot of the second page: both sides of that page go
    assert a.translate_loc_from_full_to_swa(x[4:8]).tolist() == [0, 0, 0, 0]
    assert (a.full_available_size(), a.swa_available_size()) == (24, 12)
    a.free(t(4, 12))
    assert (a.full_available_size(), a.swa_available_size()) == (32, 16)


def test_paged_swa_shortfall_rounds_each_side_to_pages():
    a = paged_swa()
    a.alloc(12)
    assert (a.full_available_size(), a.swa_available_size()) == (20, 4)
    assert a.shortfall(6) == EvictParams(num_tokens=0, swa_num_tokens=4)
    assert a.shortfall(21) == EvictParams(num_tokens=4, swa_num_tokens=20)
    assert a.shortfall(4) is None


def test_swa_from_geometry_errors():
    g = PoolGeometry(capacity_tokens=32, num_layers=4, device="cpu")
    opts = {"swa_capacity_tokens": 8, "sliding_window_size": 4}
    with pytest.raises(
        ValueError, match=r"swa_layer_ids \[4, 7\] out of range: the model has 4 layer"
    ):
        SWAAllocator.from_geometry(g, SWAAllocatorOptions(**opts, swa_layer_ids=[1, 4, 7]))
    with pytest.raises(ValueError, match="swa_capacity_tokens=10 is not a multiple of page_size=4"):
        SWAAllocator.from_geometry(
            PoolGeometry(capacity_tokens=32, page_size=4, device="cpu"),
            SWAAllocatorOptions(swa_capacity_tokens=10, sliding_window_size=4),
        )


@pytest.mark.parametrize(
    "options, match",
    [
        ({"sliding_window_size": 4}, "swa_capacity_tokens"),
        ({"swa_capacity_tokens": 0, "sliding_window_size": 4}, "swa_capacity_tokens"),
        ({"swa_capacity_tokens": 8, "sliding_window_size": -1}, "sliding_window_size"),
        (
            {"swa_capacity_tokens": 8, "sliding_window_size": 4, "swa_layer_ids": [1, 1]},
            "distinct non-negative",
        ),
        (
            {"swa_capacity_tokens": 8, "sliding_window_size": 4, "swa_layer_ids": []},
            "swa_layer_ids is empty",
        ),
        (
            {"swa_capacity_tokens": 8, "sliding_window_size": 4, "full_attention_interval": 0},
            "full_attention_interval",
        ),
        ({"swa_capacity_tokens": "8", "sliding_window_size": 4}, "swa_capacity_tokens"),
    ],
)
def test_swa_options_validation(options, match):
    with pytest.raises(ValidationError, match=match):
        SWAAllocatorOptions(**options)


# ===========================================================================================
# through the registry and kvplug.build
# ===========================================================================================


@pytest.mark.parametrize(
    "name, options, page_size, cls",
    [
        ("standard", {}, 1, StandardAllocator),
        ("token", {"debug_checks": True}, 1, StandardAllocator),
        ("paged", {}, 4, PagedAllocator),
        ("swa", {"swa_capacity_tokens": 16, "sliding_window_size": 8}, 1, SWAAllocator),
    ],
)
def test_registered_allocators_build_from_a_selection(name, options, page_size, cls):
    from kvplug.registry import get_registry

    resolved = get_registry().resolve("allocator", ComponentSelection(name=name, options=options))
    geometry = PoolGeometry(capacity_tokens=64, page_size=page_size, num_layers=2, device="cpu")
    allocator = resolved.registration.factory(geometry, resolved.options)
    assert type(allocator) is cls
    assert allocator.available_size() == (16 if cls is SWAAllocator else 64)
    assert allocator.alloc(page_size) is not None


def test_bad_allocator_options_are_a_validation_error_naming_the_field():
    from kvplug.registry import get_registry

    with pytest.raises(ValidationError, match="swa_capacity_tokens"):
        get_registry().resolve(
            "allocator", ComponentSelection(name="swa", options={"sliding_window_size": 8})
        )


SWA_OPTIONS = {"swa_capacity_tokens": 16, "sliding_window_size": 8}


@pytest.mark.parametrize(
    "allocator, cache, page_size, cls",
    [
        ("standard", "radix", 1, StandardAllocator),
        ("paged", "radix", 4, PagedAllocator),
        ("paged", "block_hash", 4, PagedAllocator),
        ({"name": "swa", "options": SWA_OPTIONS}, "swa_radix", 1, SWAAllocator),
        ({"name": "swa", "options": SWA_OPTIONS}, "swa_radix", 4, SWAAllocator),
    ],
)
def test_kvplug_build_returns_a_working_allocator_and_pool(allocator, cache, page_size, cls):
    import kvplug

    stack = kvplug.build(
        {
            "allocator": allocator,
            "prefix_cache": cache,
            "pool": {
                "capacity_tokens": 64,
                "page_size": page_size,
                "num_layers": 2,
                "device": "cpu",
            },
        }
    )
    assert type(stack.allocator) is cls and stack.prefix_cache.allocator is stack.allocator
    assert stack.pool is stack.allocator.pool
    slots = stack.allocator.alloc(2 * page_size)
    assert slots.device == CPU and slots.numel() == 2 * page_size
    k = torch.ones(slots.numel(), 1, 64, dtype=torch.float16)
    stack.pool.set_kv(1, slots, k, k)  # layer 1 is a full-attention layer in every case
    assert stack.pool.get_k(1)[slots].sum().item() == slots.numel() * 64
    stack.allocator.free(slots)
    available = stack.allocator.available_size()
    assert stack.allocator.shortfall(available + 5) is not None
    assert stack.allocator.shortfall(available) is None
