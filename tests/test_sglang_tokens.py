"""The SGLang adapter's token tuples (no SGLang needed): equal to ``tuple(ids[:n])`` always,
shared between arrays that start alike, never stale after an in-place change."""

from __future__ import annotations

import gc
from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.integrations.sglang.tokens import TokenTuples
from kvplug.speedups import common_prefix


def test_a_growing_array_is_extended_not_converted_again() -> None:
    tuples = TokenTuples()
    ids = array("q", range(1000, 1040))
    first = tuples.get(ids, 32)
    assert first == tuple(range(1000, 1032))
    assert tuples.get(ids, 32) is first  # the same array, the same tokens: the memo
    ids.extend([7, 8])
    longer = tuples.get(ids, 42)
    assert longer == tuple(ids) and longer[:32] == first and longer[0] is first[0]


def test_arrays_that_start_alike_share_the_int_objects() -> None:
    tuples = TokenTuples()
    system = list(range(5000, 5300))
    a = tuples.get(array("q", system + [1, 2, 3]), 303)
    b_ids = array("q", system + [9, 9])
    b = tuples.get(b_ids, 302)
    assert b == tuple(system + [9, 9])
    assert all(x is y for x, y in zip(a[:300], b[:300], strict=True))  # the same objects


def test_an_array_changed_in_place_gets_fresh_tokens() -> None:
    tuples = TokenTuples()
    ids = array("q", range(2000, 2050))
    assert tuples.get(ids, 50) == tuple(range(2000, 2050))
    ids[10] = 1
    assert tuples.get(ids, 50) == tuple(ids)
    assert tuples.get(ids, 20) == tuple(ids[:20])


def test_entries_die_with_their_array_and_lists_are_not_memoised() -> None:
    tuples = TokenTuples()
    ids = array("q", range(100))
    tuples.get(ids, 100)
    assert len(tuples._memo) == 1
    del ids
    gc.collect()
    assert tuples._memo == {}
    assert tuples.get([1, 2, 3], 2) == (1, 2)


def test_common_prefix() -> None:
    a = array("q", range(500))
    for cut in (0, 1, 15, 16, 17, 255, 499):
        b = array("q", a)
        b[cut] = -1
        assert common_prefix(a, b, 500) == cut
    assert common_prefix(a, array("q", a), 500) == 500


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # which array
            st.lists(st.integers(0, 3), max_size=40),  # tokens to append (a small alphabet)
            st.integers(0, 60),  # length asked
            st.booleans(),  # overwrite one token in place first
        ),
        max_size=40,
    )
)
def test_every_answer_is_the_plain_tuple(steps: list[tuple[int, list[int], int, bool]]) -> None:
    tuples = TokenTuples(capacity=3)
    arrays = [array("q", [5] * 20) for _ in range(4)]
    for which, extra, length, poke in steps:
        ids = arrays[which]
        ids.extend(extra)
        if poke and len(ids):
            ids[length % len(ids)] += 1
        n = min(length, len(ids))
        assert tuples.get(ids, n) == tuple(ids[:n])
