"""``LazyHeap``: the learning policies' heap, against a plain dict of keys."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.policies.heap import LazyHeap
from kvplug_hookspecs import CandidateStats


def candidates(n: int) -> list[CandidateStats]:
    out = []
    for i in range(n):
        c = CandidateStats(0, num_tokens=1)
        c.node_id = i
        out.append(c)
    return out


def test_fill_orders_as_pushes_do_and_keeps_present_members() -> None:
    c = candidates(5)
    heap = LazyHeap()
    heap.push(c[0], 7)
    heap.push(c[1], 1)
    heap.remove(c[1])  # a stale entry the fill drops
    heap.fill([(c[2], 3), (c[3], 3), (c[4], 0), (c[0], 5)])  # c[0] re-keyed from 7 to 5
    assert len(heap) == 4
    assert heap.key_of(c[0]) == 5
    assert [heap.pop() for _ in range(5)] == [c[4], c[2], c[3], c[0], None]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 15), st.integers(0, 9)),
        st.tuples(st.just("remove"), st.integers(0, 15), st.just(0)),
        st.tuples(st.just("pop"), st.just(0), st.just(0)),
        st.tuples(
            st.just("fill"),
            st.lists(st.tuples(st.integers(0, 15), st.integers(0, 9)), max_size=6),
            st.just(0),
        ),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_matches_a_dict_of_keys(steps: list[tuple[object, object, int]]) -> None:
    c = candidates(16)
    heap, ref = LazyHeap(), {}
    for op, a, b in steps:
        if op == "push":
            heap.push(c[a], b)  # type: ignore[index]
            ref[a] = b
        elif op == "remove":
            assert heap.remove(c[a]) == (ref.pop(a, None) is not None)  # type: ignore[index]
        elif op == "fill":
            pairs = list(a)  # type: ignore[call-overload]
            heap.fill((c[i], k) for i, k in pairs)
            ref.update(dict(pairs))
        else:
            expected = min(ref, key=lambda i: (ref[i], i)) if ref else None
            got = heap.pop()
            assert (got.node_id if got is not None else None) == expected
            if expected is not None:
                del ref[expected]
        assert len(heap) == len(ref)
    assert sorted(x.node_id for x in heap.members()) == sorted(ref)
