"""The compiled kernels (``kvplug._speedups``) against their Python reference (``kvplug.speedups``).

Each kernel is run both ways on the same input and must give the same result, raise the same
error, and leave the same state (a refused lock walk changes nothing). The radix cache and the
allocator suites run on both kernels too (the ``both_kernels`` fixture in ``tests/conftest.py``).
"""

from __future__ import annotations

import copy
import hashlib
import os
import random
import shutil
import subprocess
import sys
import sysconfig
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug import speedups
from kvplug.caches.radix import RadixCache, RadixNode
from kvplug_hookspecs import CacheKey, MatchResult
from tests.cache_helpers import make_allocator

KERNELS = ("python", "native")


def run(kernel: str, name: str, *args):
    """Call kernel ``name`` with the Python or the compiled implementation."""
    if kernel == "native" and not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    was = speedups.native_enabled()
    speedups.use_native(kernel == "native")
    try:
        return getattr(speedups, name)(*args)
    finally:
        speedups.use_native(was)


def outcome(kernel: str, name: str, *args):
    """The result, or the exception's type and message."""
    try:
        return ("ok", run(kernel, name, *args))
    except (TypeError, ValueError, AttributeError) as exc:
        return (type(exc).__name__, str(exc))


def test_native_is_built_and_used_where_a_compiler_exists():
    """``pip install`` builds the extension whenever the machine has a C compiler (a silent
    fallback on a machine that could build it would hide a broken build)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) on this machine")
    assert speedups.NATIVE_AVAILABLE
    if os.environ.get("KVPLUG_PURE_PYTHON", "") not in ("", "0"):  # CI's pure-Python run
        assert not speedups.native_enabled()
        return
    assert speedups.native_enabled()
    from kvplug import _speedups

    assert speedups.walk is _speedups.walk


def test_use_native_switches_every_kernel():
    if not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    was = speedups.native_enabled()
    try:
        assert speedups.use_native(False) is False
        assert not speedups.native_enabled()
        assert speedups.check_slots.__module__ == "kvplug.speedups"
        assert speedups.use_native(True) is True
        assert speedups.lock_path.__module__ != "kvplug.speedups"
    finally:
        speedups.use_native(was)


# -- trees -------------------------------------------------------------------------------------


def node(key: tuple[int, ...], parent: RadixNode | None, page: int, extra_key=None) -> RadixNode:
    """A bare node under ``parent``, keyed as the radix cache keys it."""
    n = RadixNode(0)
    n.key = key
    n.num_tokens = len(key)
    n.parent = parent
    if parent is not None:
        first = key[0] if page == 1 else key[:page]
        parent.children[(extra_key, first) if parent.parent is None else first] = n
    return n


def tree(page: int):
    """root -> [1,2,3,4] -> {[5,6], [7,8,9,10]}; root -> ("ns", [1,2]) -> [3,3]."""
    root = RadixNode(0)
    root.parent = None
    a = node((1, 2, 3, 4), root, page)
    b = node((5, 6), a, page)
    c = node((7, 8, 9, 10), a, page)
    d = node((1, 2), root, page, extra_key="ns")
    e = node((3, 3), d, page)
    return root, a, b, c, d, e


@pytest.mark.parametrize("kernel", KERNELS)
def test_walk_full_partial_and_inside_an_edge(kernel):
    root, a, _b, c, d, e = tree(1)
    ids = (1, 2, 3, 4, 7, 8, 9, 10, 11)
    assert run(kernel, "walk", root, root, ids, 0, 9, 1, None) == (c, 8, [a, c], None)
    assert run(kernel, "walk", root, root, ids, 0, 6, 1, None) == (a, 4, [a], c)  # ends in c
    assert run(kernel, "walk", root, a, ids, 4, 8, 1, None) == (c, 8, [c], None)  # from a node
    assert run(kernel, "walk", root, root, ids, 0, 0, 1, None) == (root, 0, [], None)
    # a mismatch inside an edge: 1,2,9 -> the match ends in a
    assert run(kernel, "walk", root, root, (1, 2, 9), 0, 3, 1, None) == (root, 0, [], a)
    # the namespace keys the root's children only
    assert run(kernel, "walk", root, root, (1, 2, 3, 3), 0, 4, 1, "ns") == (e, 4, [d, e], None)
    assert run(kernel, "walk", root, root, (5,), 0, 1, 1, None) == (root, 0, [], None)


@pytest.mark.parametrize("kernel", KERNELS)
def test_walk_by_pages(kernel):
    root, a, b, c, _, _ = tree(2)
    assert run(kernel, "walk", root, root, (1, 2, 3, 4, 5, 6), 0, 6, 2, None) == (
        b,
        6,
        [a, b],
        None,
    )
    assert run(kernel, "walk", root, root, (1, 2, 3, 9), 0, 4, 2, None) == (root, 0, [], a)
    assert run(kernel, "walk", root, root, (1, 2, 3, 4, 7, 8, 0, 0), 0, 8, 2, None) == (
        a,
        4,
        [a],
        c,
    )
    # a first page no child starts with: no mismatch to split, the walk just stops
    assert run(kernel, "walk", root, root, (1, 2, 3, 4, 7, 0), 0, 6, 2, None) == (a, 4, [a], None)


@pytest.mark.parametrize("kernel", KERNELS)
def test_walk_refuses_bad_arguments(kernel):
    root, *_ = tree(1)
    assert outcome(kernel, "walk", root, root, (1, 2), 0, 5, 1, None)[0] == "ValueError"
    assert outcome(kernel, "walk", root, root, (1, 2), 0, 2, 0, None)[0] == "ValueError"


@pytest.mark.parametrize("kernel", KERNELS)
def test_walk_reads_an_int64_array_as_the_tuple_of_its_tokens(kernel):
    """SGLang's ``array('q')`` of a request's tokens is walked in place: the same node, length,
    path and split point as the tuple of the same tokens, at page 1 and by pages."""
    root, a, _b, c, d, e = tree(1)
    ids = array("q", (1, 2, 3, 4, 7, 8, 9, 10, 11))
    assert run(kernel, "walk", root, root, ids, 0, 9, 1, None) == (c, 8, [a, c], None)
    assert run(kernel, "walk", root, root, ids, 0, 6, 1, None) == (a, 4, [a], c)
    assert run(kernel, "walk", root, a, ids, 4, 8, 1, None) == (c, 8, [c], None)
    assert run(kernel, "walk", root, root, array("q", (1, 2, 9)), 0, 3, 1, None) == (
        root,
        0,
        [],
        a,
    )
    assert run(kernel, "walk", root, root, array("q", (1, 2, 3, 3)), 0, 4, 1, "ns") == (
        e,
        4,
        [d, e],
        None,
    )
    root, a, b, c, _, _ = tree(2)
    assert run(kernel, "walk", root, root, array("q", (1, 2, 3, 4, 5, 6)), 0, 6, 2, None) == (
        b,
        6,
        [a, b],
        None,
    )
    assert run(kernel, "walk", root, root, array("q", (1, 2, 3, 4, 7, 8, 0)), 0, 6, 2, None) == (
        a,
        4,
        [a],
        c,
    )
    # a NumPy int64 vector is a 1-D int64 buffer too
    vector = np.array([1, 2, 3, 4, 5, 6], dtype=np.int64)
    assert run(kernel, "walk", root, root, vector, 0, 6, 2, None) == (b, 6, [a, b], None)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fanout", [3, 8, 9, 40])
def test_walk_of_an_array_finds_each_child_by_its_first_page(kernel, fanout):
    """Few children are compared in place, many are looked up by their page: the same child,
    under the root (namespaced) and below it."""
    root = RadixNode(0)
    root.parent = None
    top = node((5, 5), root, 2, extra_key="ns")
    leaves = [node((i, 7, i, 8), top, 2) for i in range(fanout)]
    for i, leaf in enumerate(leaves):
        ids = array("q", (5, 5, i, 7, i, 8, 1))
        assert run(kernel, "walk", root, root, ids, 0, 6, 2, "ns") == (leaf, 6, [top, leaf], None)
        assert run(kernel, "walk", root, root, ids, 0, 6, 2, None) == (root, 0, [], None)
        ids = array("q", (5, 5, i, 7, i, 9))  # the first page is the leaf's, the second is not
        assert run(kernel, "walk", root, root, ids, 0, 6, 2, "ns") == (top, 2, [top], leaf)
    ids = array("q", (5, 5, fanout, 7))
    assert run(kernel, "walk", root, root, ids, 0, 4, 2, "ns") == (top, 2, [top], None)


@pytest.mark.parametrize("kernel", KERNELS)
def test_walk_refuses_keys_that_are_not_int64(kernel):
    root, *_ = tree(1)
    message = "walk: ids must be a tuple or a 1-D int64 buffer"
    for ids in (
        [1, 2],
        array("i", (1, 2)),
        np.array([1, 2], dtype=np.int32),
        np.array([[1, 2]], dtype=np.int64),
        memoryview(array("q", (1, 2, 3, 4)))[::2],
        b"ab",
    ):
        assert outcome(kernel, "walk", root, root, ids, 0, 1, 1, None) == ("TypeError", message)
    assert outcome(kernel, "walk", root, root, array("q", (1, 2)), 0, 3, 1, None) == (
        "ValueError",
        "walk: bad page size or range",
    )


def random_tree(rng: random.Random, page: int):
    """A random radix tree over a tiny alphabet (many shared prefixes) and its key list."""
    root = RadixNode(0)
    root.parent = None
    keys = []
    for _ in range(30):
        length = rng.randint(1, 6) * page
        key = tuple(rng.randint(0, 2) for _ in range(length))
        keys.append(key)
        # insert by walking with the Python reference, splitting by hand-free construction:
        parent, pos = root, 0
        while True:
            first = key[pos] if page == 1 else key[pos : pos + page]
            ck = ("x", first) if parent is root else first
            child = parent.children.get(ck)
            if child is None:
                node(key[pos:], parent, page, extra_key="x")
                break
            common = 0
            while (
                common < child.num_tokens
                and pos + common < len(key)
                and child.key[common] == key[pos + common]
            ):
                common += 1
            common -= common % page
            if common == child.num_tokens:
                parent, pos = child, pos + common
                if pos == len(key):
                    break
                continue
            # split child at `common`
            del parent.children[ck]
            mid = node(child.key[:common], parent, page, extra_key="x")
            child.key = child.key[common:]
            child.num_tokens = len(child.key)
            child.parent = mid
            mid.children[child.key[0] if page == 1 else child.key[:page]] = child
            if pos + common < len(key):
                node(key[pos + common :], mid, page)
            break
    return root, keys


@pytest.mark.parametrize("page", [1, 2, 4])
def test_walk_agrees_on_random_trees(page):
    if not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    rng = random.Random(page)
    for _ in range(20):
        root, keys = random_tree(rng, page)
        for _ in range(40):
            ids = tuple(rng.randint(0, 2) for _ in range(rng.randint(0, 7) * page))
            if rng.random() < 0.5 and keys:
                base = rng.choice(keys)
                ids = base + ids
            end = rng.randint(0, len(ids))
            args = (root, root, ids, 0, end, page, "x")
            expected = run("python", "walk", *args)
            assert run("native", "walk", *args) == expected
            as_array = (root, root, array("q", ids), 0, end, page, "x")
            assert run("native", "walk", *as_array) == expected
            assert run("python", "walk", *as_array) == expected


# -- statistics and locks ----------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_stamp_hits_only_the_first_count_nodes(kernel):
    _root, a, b, c, *_ = tree(1)
    for n in (a, b, c):
        n.last_access_time, n.hit_count = 1, 2
    run(kernel, "stamp_hits", [a, c, b], 2, 9)
    assert [(n.last_access_time, n.hit_count) for n in (a, c, b)] == [(9, 3), (9, 3), (1, 2)]
    run(kernel, "stamp_hits", [a], 5, 10)  # a count past the end stops at the end
    assert (a.last_access_time, a.hit_count) == (10, 4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_lock_path_counts_the_tokens_that_change_state(kernel):
    root, a, b, c, *_ = tree(1)
    assert run(kernel, "lock_path", b, root, 1) == 6  # a and b become locked: 4 + 2
    assert run(kernel, "lock_path", c, root, 1) == 4  # only c: a is locked already
    assert (a.lock_ref, b.lock_ref, c.lock_ref) == (2, 1, 1)
    assert run(kernel, "lock_path", b, root, -1) == 2  # b unlocked; a still held by c
    assert run(kernel, "lock_path", c, root, -1) == 8
    assert (a.lock_ref, b.lock_ref, c.lock_ref) == (0, 0, 0)
    assert run(kernel, "lock_path", root, root, 1) == 0  # the root's path is empty


@pytest.mark.parametrize("kernel", KERNELS)
def test_lock_path_refusals_change_nothing(kernel):
    root, a, b, c, d, e = tree(1)
    run(kernel, "lock_path", c, root, 1)
    before = [(n.lock_ref) for n in (a, b, c, d, e)]
    # unlocking b would take b below zero (a is locked through c): refused, a untouched
    assert outcome(kernel, "lock_path", b, root, -1) == (
        "ValueError",
        "lock_path: a lock count would go negative",
    )
    # a node of another tree
    _other_root, x, *_ = tree(1)
    assert outcome(kernel, "lock_path", x, root, 1) == (
        "ValueError",
        "lock_path: the node is not under this root",
    )
    assert outcome(kernel, "lock_path", b, root, 2) == ("ValueError", "lock_path: delta is 1 or -1")
    assert [(n.lock_ref) for n in (a, b, c, d, e)] == before
    assert x.lock_ref == 0


# -- allocator checks --------------------------------------------------------------------------


def check(kernel: str, idx, state, div, require, low, high):
    scratch = np.zeros(high + 2, dtype=np.int64)
    idx = np.asarray(idx, dtype=np.int64)
    state = None if state is None else np.asarray(state, dtype=np.int8)
    return run(kernel, "check_slots", idx, state, div, require, low, high, scratch)


@pytest.mark.parametrize("kernel", KERNELS)
def test_check_slots_finds_range_duplicates_and_owner_state(kernel):
    state = [0, 1, 1, 2, 2, 0, 1, 0, 0]  # per slot: 0 free, 1 held, 2 cached
    assert check(kernel, [], state, 1, 1, 1, 8) == (0, -1, -1, -1)
    assert check(kernel, [1, 2, 6], state, 1, 1, 1, 8) == (1, 6, -1, -1)
    assert check(kernel, [1, 3, 2], state, 1, 1, 1, 8) == (1, 3, -1, 1)  # 3 is cached, not held
    assert check(kernel, [2, 6, 2, 1], state, 1, 1, 1, 8) == (1, 6, 0, -1)  # 2 again later
    assert check(kernel, [1, 5], state, 1, -1, 1, 8) == (1, 5, -1, 1)  # require: not free
    assert check(kernel, [3, 4], state, 1, -1, 1, 8) == (3, 4, -1, -1)
    # out of range: nothing else is read
    assert check(kernel, [0, 3], state, 1, 1, 1, 8) == (0, 3, -1, -1)
    assert check(kernel, [3, 9], state, 1, 1, 1, 8) == (3, 9, -1, -1)
    # no ownership tracking
    assert check(kernel, [1, 1], None, 1, 1, 1, 8) == (1, 1, -1, -1)
    # pages: slot // div is the unit
    assert check(kernel, [2, 3, 6, 7], [0, 1, 0, 1], 2, 1, 2, 7) == (2, 7, -1, -1)
    assert check(kernel, [2, 4], [0, 1, 0, 1], 2, 1, 2, 7) == (2, 4, -1, 1)


@settings(max_examples=200, deadline=None)
@given(
    idx=st.lists(st.integers(-2, 20), max_size=12),
    state=st.lists(st.integers(0, 2), min_size=10, max_size=10),
    div=st.sampled_from([1, 2]),
    require=st.sampled_from([-1, 1, 2]),
    tracked=st.booleans(),
)
def test_check_slots_agrees_on_random_input(idx, state, div, require, tracked):
    if not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    high = len(state) * div - 1
    args = (idx, state if tracked else None, div, require, 1, high)
    assert check("native", *args) == check("python", *args)


def test_native_check_slots_refuses_wrong_buffers():
    if not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    from kvplug import _speedups

    idx = np.array([1, 2], dtype=np.int32)  # not int64
    scratch = np.zeros(4, dtype=np.int64)
    state = np.zeros(4, dtype=np.int8)
    with pytest.raises(TypeError, match="8-byte items"):
        _speedups.check_slots(idx, state, 1, 1, 0, 3, scratch)
    with pytest.raises(ValueError, match="too short"):
        _speedups.check_slots(np.array([3], dtype=np.int64), state, 1, 1, 0, 9, scratch[:2])
    with pytest.raises(ValueError, match="div"):
        _speedups.check_slots(idx.astype(np.int64), state, 0, 1, 0, 3, scratch)


def test_pure_python_environment_variable_keeps_the_reference_kernels():
    code = "from kvplug import speedups; print(speedups.native_enabled())"
    env = {**os.environ, "KVPLUG_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("kernel", KERNELS)
def test_check_slots_sets_the_state_only_when_every_check_passed(kernel):
    scratch = np.zeros(10, dtype=np.int64)
    state = np.array([0, 1, 1, 2, 0, 0], dtype=np.int8)

    def change(ids):
        idx = np.array(ids, dtype=np.int64)
        return run(kernel, "check_slots", idx, state, 1, 1, 1, 5, scratch, 2)

    assert change([1, 3]) == (1, 3, -1, 1)  # 3 is not held: nothing set
    assert change([1, 2, 1]) == (1, 2, 0, -1)  # 1 twice: nothing set
    assert change([1, 9]) == (1, 9, -1, -1)  # out of range: nothing set
    assert state.tolist() == [0, 1, 1, 2, 0, 0]
    assert change([2, 1]) == (1, 2, -1, -1)
    assert state.tolist() == [0, 2, 2, 2, 0, 0]


@pytest.mark.parametrize("kernel", KERNELS)
def test_distinct_units_keeps_each_unit_once_in_order(kernel):
    scratch = np.zeros(8, dtype=np.int64)
    out = np.full(8, -7, dtype=np.int64)
    idx = np.array([16, 17, 40, 18, 33, 31], dtype=np.int64)  # pages of 16: 1, 1, 2, 1, 2, 1
    assert run(kernel, "distinct_units", idx, 16, scratch, out) == 2
    assert out[:2].tolist() == [2, 1]  # each at its last position: 33 (page 2), 31 (page 1)
    assert run(kernel, "distinct_units", idx, 1, np.zeros(41, dtype=np.int64), out) == 6
    assert out[:6].tolist() == idx.tolist()
    assert run(kernel, "distinct_units", idx[:0], 16, scratch, out) == 0
    assert outcome(kernel, "distinct_units", idx, 4, scratch, out)[0] == "ValueError"  # 40 // 4
    assert outcome(kernel, "distinct_units", idx, 16, scratch, out[:3])[0] == "ValueError"
    assert outcome(kernel, "distinct_units", idx, 0, scratch, out)[0] == "ValueError"


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 63), max_size=20), div=st.sampled_from([1, 2, 16]))
def test_distinct_units_agrees_on_random_input(ids, div):
    if not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    idx = np.array(ids, dtype=np.int64)
    results = []
    for kernel in KERNELS:
        out = np.zeros(len(ids), dtype=np.int64)
        k = run(kernel, "distinct_units", idx, div, np.zeros(64, dtype=np.int64), out)
        results.append(out[:k].tolist())
    assert results[0] == results[1]
    assert sorted(results[0]) == sorted({i // div for i in ids})


class Index:
    """Not an int, but usable as one (as NumPy integers are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"Index({self.value})"


@pytest.mark.parametrize("kernel", KERNELS)
def test_check_token_ids_names_the_first_bad_position(kernel):
    assert run(kernel, "check_token_ids", ()) is True
    assert run(kernel, "check_token_ids", (0, 5, 2**63 - 1, -(2**63))) is True  # exact ints
    assert (
        run(kernel, "check_token_ids", (0, 5, 2**63 - 1, -(2**63), Index(3), np.int64(4))) is False
    )
    assert outcome(kernel, "check_token_ids", (1, 2.0, "x")) == (
        "TypeError",
        "token ids must be ints: position 1 is 2.0 (float)",
    )
    assert outcome(kernel, "check_token_ids", (1, 2, 2**63)) == (
        "ValueError",
        f"token ids must fit in int64: position 2 is {2**63}",
    )
    assert outcome(kernel, "check_token_ids", (Index(-(2**64)),)) == (
        "ValueError",
        "token ids must fit in int64: position 0 is Index(-18446744073709551616)",
    )
    assert outcome(kernel, "check_token_ids", [1, 2])[0] == "TypeError"  # a tuple only
    assert outcome(kernel, "check_token_ids", (1, 2), [1, 2])[0] == "TypeError"


@pytest.mark.parametrize("kernel", KERNELS)
def test_check_token_ids_after_a_known_tuple_checks_what_differs(kernel):
    known = tuple(range(1000, 1008))  # ints above the small-int cache: distinct objects
    assert run(kernel, "check_token_ids", known) is True
    # the same objects first, then a bad one: found, at its position
    assert outcome(kernel, "check_token_ids", known + (2.5,), known) == (
        "TypeError",
        "token ids must be ints: position 8 is 2.5 (float)",
    )
    assert run(kernel, "check_token_ids", known + (7,), known) is True
    # equal values that are other objects are read and checked like any others
    other = tuple(int(str(v)) for v in known[:4]) + (2**63,)
    assert outcome(kernel, "check_token_ids", other, known) == (
        "ValueError",
        f"token ids must fit in int64: position 4 is {2**63}",
    )
    assert run(kernel, "check_token_ids", known[:3] + (Index(1),), known) is False


@pytest.mark.parametrize("kernel", KERNELS)
def test_expand_units_lists_every_slot_of_each_page(kernel):
    out = np.full(7, -1, dtype=np.int64)
    run(kernel, "expand_units", np.array([3, 1], dtype=np.int64), 3, out)
    assert out.tolist() == [9, 10, 11, 3, 4, 5, -1]
    run(kernel, "expand_units", np.array([], dtype=np.int64), 3, out)
    assert outcome(kernel, "expand_units", np.array([1, 2, 3], dtype=np.int64), 3, out)[0] == (
        "ValueError"
    )
    assert outcome(kernel, "expand_units", np.array([1], dtype=np.int64), 0, out)[0] == "ValueError"


def release(kernel: str, idx, state, div: int, ids, top: int, high: int = 15):
    """release_slots on fresh scratch; returns its result, the stack ids and the state after."""
    idx = np.asarray(idx, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64).copy()
    state = None if state is None else np.asarray(state, dtype=np.int8).copy()
    result = run(
        kernel,
        "release_slots",
        idx,
        state,
        div,
        div,
        high,
        np.zeros(high + 1, dtype=np.int64),
        np.zeros(high // div + 1, dtype=np.int64),
        np.zeros(max(idx.size, 1), dtype=np.int64),
        ids,
        top,
    )
    return result, ids.tolist(), None if state is None else state.tolist()


@pytest.mark.parametrize("kernel", KERNELS)
def test_release_slots_pushes_each_page_once_after_the_checks(kernel):
    # pages of 4 slots; pages 1..3; pages 2 and 3 are held, the stack [1 | 3 2 ...] has top 2
    state = [0, 0, 1, 1]
    ids = [3, 2, 1]
    # a whole page and part of another, each page once, in last-occurrence order
    assert release(kernel, [8, 9, 12, 10], state, 4, ids, 2) == (
        (8, 12, -1, -1, 2),
        [3, 2, 1],  # ids[0:2] = pages 3, 2
        [0, 0, 0, 0],
    )
    # a free page (1): refused, nothing changes
    assert release(kernel, [8, 4], state, 4, ids, 2) == ((4, 8, -1, 1, 0), [3, 2, 1], state)
    # a slot twice: refused
    assert release(kernel, [9, 9], state, 4, ids, 2) == ((9, 9, 0, -1, 0), [3, 2, 1], state)
    # out of range (slot 3 is in the padding page): nothing read
    assert release(kernel, [3, 8], state, 4, ids, 2) == ((3, 8, -1, -1, 0), [3, 2, 1], state)
    # untracked, more pages than are out: k > top, nothing changes
    assert release(kernel, [4, 8, 12], None, 4, ids, 2) == ((4, 12, -1, -1, 3), [3, 2, 1], None)
    # page size 1: every slot, in order
    assert release(kernel, [5, 7], [0] * 5 + [1, 0, 1], 1, [9, 9, 9], 3) == (
        (5, 7, -1, -1, 2),
        [9, 5, 7],
        [0] * 8,
    )


@settings(max_examples=200, deadline=None)
@given(
    idx=st.lists(st.integers(0, 17), max_size=10),
    state=st.lists(st.integers(0, 2), min_size=16, max_size=16),
    div=st.sampled_from([1, 4]),
    top=st.integers(0, 16),
    tracked=st.booleans(),
)
def test_release_slots_agrees_on_random_input(idx, state, div, top, tracked):
    if not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    ids = list(range(100, 116))
    args = (idx, state if tracked else None, div, ids, top)
    assert release("native", *args) == release("python", *args)


# -- page runs: the compiled checks step per page when slots come as runs of whole pages ------


def paged(kernel: str, name: str, idx, state, div: int, top: int = 0):
    """check_slots (require: held, 1) or release_slots over 64 slots, on fresh buffers; returns
    the result, the state after and, for release_slots, the stack ids."""
    idx = np.asarray(idx, dtype=np.int64)
    state = np.asarray(state, dtype=np.int8).copy()
    high = 63
    if name == "check_slots":
        scratch = np.zeros(high + 1, dtype=np.int64)
        result = run(kernel, name, idx, state, div, 1, div, high, scratch, 2)
        return result, state.tolist()
    result, ids, after = release(kernel, idx, state, div, range(100, 100 + 64), top, high)
    return result, after, ids


@pytest.mark.parametrize("kernel", KERNELS)
def test_page_runs_find_the_first_bad_slot_inside_a_run(kernel):
    # pages of 4 slots: pages 1 and 3 held (1), page 2 free (0); one run over pages 1-2 from
    # slot 6: the first slot of page 2 (8) is at position 2
    state = [0, 1, 0, 1] + [1] * 12
    assert paged(kernel, "check_slots", [6, 7, 8, 9], state, 4) == ((6, 9, -1, 2), state)
    # runs on distinct pages, all held: every page becomes cached (2), the rest unchanged
    after = [0, 2, 0, 2] + [1] * 12
    assert paged(kernel, "check_slots", [12, 13, 14, 15, 4, 5], state, 4) == (
        (4, 15, -1, -1),
        after,
    )
    # two runs on one page (slot 5 twice): the slot-by-slot scan names the duplicate
    assert paged(kernel, "check_slots", [4, 5, 12, 5], state, 4) == ((4, 12, 1, -1), state)
    # release: pages 3 then 1, in run order, pushed below top 4; both become free
    freed = [0, 0, 0, 0] + [1] * 12
    ids = [100, 101, 3, 1, *range(104, 164)]
    assert paged(kernel, "release_slots", [12, 13, 14, 15, 4], state, 4, top=4) == (
        (4, 15, -1, -1, 2),
        freed,
        ids,
    )
    # release of a run reaching the free page 2: refused at its first slot, nothing changes
    assert paged(kernel, "release_slots", [4, 5, 6, 7, 8], state, 4, top=4) == (
        (4, 8, -1, 4, 0),
        state,
        list(range(100, 164)),
    )


@settings(max_examples=300, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 63), st.integers(1, 12)), max_size=6),
    state=st.lists(st.integers(0, 2), min_size=32, max_size=32),
    div=st.sampled_from([2, 4, 16]),
    top=st.integers(0, 16),
)
def test_page_runs_agree_with_the_reference(runs, state, div, top):
    """Runs of consecutive slots (whole pages, parts of pages, overlapping or not, out of range
    at the end): the compiled page-run path and the reference agree on every result."""
    if not speedups.NATIVE_AVAILABLE:
        pytest.skip("kvplug._speedups was not built")
    idx = [slot for start, length in runs for slot in range(start, min(start + length, 70))]
    units = state[: 64 // div]  # one state per page of the 64 slots
    for name in ("check_slots", "release_slots"):
        args = (name, idx, units, div, top)
        assert paged("native", *args) == paged("python", *args)


# -- token arrays ------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
def test_common_prefix_of_two_token_arrays(kernel):
    a = array("q", range(1000, 1300))
    for cut in (0, 1, 15, 16, 17, 255, 299):
        b = array("q", a)
        b[cut] = -1
        assert run(kernel, "common_prefix", a, b, 300) == cut
        assert run(kernel, "common_prefix", a, b, cut) == cut
    assert run(kernel, "common_prefix", a, array("q", a), 300) == 300
    assert run(kernel, "common_prefix", a, np.arange(1000, 1010), 10) == 10
    assert run(kernel, "common_prefix", a, a, 0) == 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_common_prefix_refuses_short_or_foreign_buffers(kernel):
    a = array("q", (1, 2, 3))
    wrong = "common_prefix: a and b must be 1-D int64 buffers"
    for b in ((1, 2, 3), array("i", (1, 2, 3)), np.ones((1, 3), dtype=np.int64)):
        assert outcome(kernel, "common_prefix", a, b, 3) == ("TypeError", wrong)
        assert outcome(kernel, "common_prefix", b, a, 3) == ("TypeError", wrong)
    short = ("ValueError", "common_prefix: n must be within both buffers")
    assert outcome(kernel, "common_prefix", a, array("q", (1, 2)), 3) == short
    assert outcome(kernel, "common_prefix", a, a, -1) == short


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40),
    b=st.lists(st.integers(0, 2), max_size=40),
)
def test_common_prefix_agrees_on_random_arrays(a, b):
    x, y = array("q", a + b), array("q", a + b[::-1])
    n = min(len(x), len(y))
    expected = next((i for i in range(n) if x[i] != y[i]), n)
    assert run("python", "common_prefix", x, y, n) == expected
    assert run("native", "common_prefix", x, y, n) == expected


# -- the radix cache's probe over an int64 array -----------------------------------------------


def _shape(cache: RadixCache) -> list[tuple[int, int, tuple[int, ...]]]:
    return sorted((n.depth, n.num_tokens, n.key) for n in cache._nodes())


def _two_prompts(page: int) -> tuple[RadixCache, tuple[int, ...]]:
    """Two cached prompts of 16 tokens sharing their first 8: a node of 8 with two leaves."""
    allocator = make_allocator(128, page)
    cache = RadixCache(allocator, page_size=page)
    first = tuple(range(100, 116))
    cache.insert(first, allocator.alloc(16))
    shared = cache.match_prefix(first[:8]).device_indices
    cache.insert(first[:8] + tuple(range(200, 208)), torch.cat((shared, allocator.alloc(8))))
    return cache, first


@pytest.mark.parametrize("page", [1, 4])
def test_probe_prefix_of_an_array_is_the_probe_match_of_its_tuple(page):
    """``probe_prefix`` gives ``match_prefix(record_hit=False, gather=False)``'s node and
    length, splits where it splits, honours the length and the namespace, records nothing."""
    cache, first = _two_prompts(page)
    stats = cache.stats.as_dict()
    for tokens, length, extra_key, expected in (
        (first + (7, 7, 7), 19, None, 16),  # the first prompt and a tail nothing caches
        (first, 12, None, 12),  # cut by the length: ends inside the first prompt's leaf
        (first[:8] + (300, 301, 302, 303), 12, None, 8),  # ends where the prompts part
        (first[:6] + (9,) * 6, 12, None, 6 if page == 1 else 4),  # inside the shared node
        (first, 16, "lora", 0),  # another namespace: nothing cached there
        ((), 0, None, 0),
    ):
        twin = copy.deepcopy(cache)
        node, matched = cache.probe_prefix(array("q", tokens), length, extra_key)
        found = twin.match_prefix(
            CacheKey(tokens[:length], extra_key), record_hit=False, gather=False
        )
        assert matched == found.prefix_len == expected
        assert node.depth + node.num_tokens == expected
        assert (node.depth, node.key) == (found.last_node.depth, found.last_node.key)
        assert _shape(cache) == _shape(twin)
    assert cache.stats.as_dict() == stats


def test_probe_prefix_refuses_what_is_not_an_int64_array():
    cache, first = _two_prompts(1)
    before = _shape(cache)
    for args, error in (
        ((list(first), 4), TypeError),
        ((first, 4), TypeError),
        ((array("i", first), 4), TypeError),
        ((array("q", first), 17), ValueError),
        ((array("q", first), -1), ValueError),
        ((array("q", first), 4, 5), TypeError),
    ):
        with pytest.raises(error):
            cache.probe_prefix(*args)
    assert _shape(cache) == before


def test_an_insert_after_an_array_probe_that_split_a_node_gives_the_tuple_result():
    """A node split by an array probe has no path hash yet: an insert continuing from it walks
    from the root instead, with the same tree and the same cached length."""
    cache, first = _two_prompts(1)
    twin = copy.deepcopy(cache)
    tokens = first[:6] + (9, 9)
    node, length = cache.probe_prefix(array("q", tokens), 8)
    found = twin.match_prefix(CacheKey(tokens), record_hit=False, gather=False)
    assert (length, node.path_hash) == (6, 0)
    for tree, last in ((cache, node), (twin, found.last_node)):
        slots = tree.path_indices(last)
        prev = MatchResult(slots[:0], last, 6)
        assert tree.insert(tokens, torch.cat((slots, tree.allocator.alloc(2))), prev=prev) == 6
    assert _shape(cache) == _shape(twin)


def test_probe_prefix_with_storage_tiers_is_the_probe_match():
    """With a storage hierarchy the probe is ``match_prefix``'s (the tiers key pages by the
    tuple): the device prefix only, the tiers' pages located and not loaded."""
    import kvplug
    from kvplug import EvictParams

    stack = kvplug.build(
        {
            "allocator": "paged",
            "pool": {"capacity_tokens": 64, "page_size": 4, "device": "cpu", "store_kv": False},
            "storage": {"tiers": [{"name": "host"}], "background": False},
        }
    )
    cache, allocator = stack.prefix_cache, stack.allocator
    head, tail = list(range(8)), list(range(8, 16))
    first = allocator.alloc(8)
    cache.insert(CacheKey(head), first)
    cache.insert(CacheKey(head + tail), torch.cat([first, allocator.alloc(8)]))
    cache.match_prefix(CacheKey(head + tail))  # its pages get their digests
    assert cache.evict(EvictParams(num_tokens=8)).num_tokens == 8  # the tail goes to the host
    free = allocator.available_size()
    node, length = cache.probe_prefix(array("q", head + tail + [99]), 17)
    assert (length, node.depth + node.num_tokens) == (8, 8)
    assert allocator.available_size() == free  # located only: nothing loaded
    assert cache.match_prefix(CacheKey(head + tail + [99])).prefix_len == 16  # a match loads


# -- page digests --------------------------------------------------------------------------------


def _hashlib_chain(parent: bytes, data: bytes, start: int, count: int, size: int) -> list[bytes]:
    out, digest = [], parent
    for i in range(start, start + count):
        digest = hashlib.sha256(digest + data[i * size : (i + 1) * size]).digest()
        out.append(digest)
    return out


@pytest.mark.parametrize("kernel", KERNELS)
def test_sha256_chain_equals_hashlib_across_block_boundaries(kernel):
    """Pages whose message (32 bytes of parent + the page) ends just before, at and after the
    64-byte block and padding boundaries (55, 56, 64 bytes...) hash as hashlib does."""
    parent = hashlib.sha256(b"kvplug-none").digest()
    for size in (0, 8, 23, 24, 31, 32, 33, 88, 96, 128, 1024):
        data = bytes(range(256)) * (size * 5 // 256 + 1)
        expected = _hashlib_chain(parent, data, 1, 3, size)
        assert run(kernel, "sha256_chain", parent, data, 1, 3, size) == expected
    assert run(kernel, "sha256_chain", parent, b"\x01" * 16, 0, 0, 8) == []
    # the first page of kvplug's chain: the seed, then token 7 as int64
    assert run(kernel, "sha256_chain", parent, array("q", [7]).tobytes(), 0, 1, 8) == [
        hashlib.sha256(parent + array("q", [7]).tobytes()).digest()
    ]


@pytest.mark.parametrize("kernel", KERNELS)
def test_sha256_chain_refuses_pages_outside_the_data_or_a_short_parent(kernel):
    wrong = ("ValueError", "sha256_chain: parent must be 32 bytes and the pages within data")
    parent = bytes(32)
    assert outcome(kernel, "sha256_chain", parent, bytes(16), 1, 2, 8) == wrong
    assert outcome(kernel, "sha256_chain", parent, bytes(16), 0, 3, 8) == wrong
    assert outcome(kernel, "sha256_chain", parent, bytes(16), -1, 1, 8) == wrong
    assert outcome(kernel, "sha256_chain", bytes(31), bytes(16), 0, 1, 8) == wrong


@settings(max_examples=200, deadline=None)
@given(
    parent=st.binary(min_size=32, max_size=32),
    data=st.binary(max_size=600),
    size=st.integers(0, 200),
    start=st.integers(0, 4),
    count=st.integers(0, 6),
)
def test_sha256_chain_agrees_on_random_input(parent, data, size, start, count):
    if size and (start + count) * size > len(data):
        count = max(0, len(data) // size - start)
        start = min(start, len(data) // size)
    expected = _hashlib_chain(parent, data, start, count, size)
    assert run("python", "sha256_chain", parent, data, start, count, size) == expected
    assert run("native", "sha256_chain", parent, data, start, count, size) == expected


class _Index:
    """Not an int, but has ``__index__`` (numpy's integers are like it): array('q') takes it."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize("kernel", KERNELS)
def test_pack_int64_gives_the_arrays_bytes_for_every_kind_of_token_sequence(kernel):
    """Tuples and lists element by element, int64 buffers by a copy, anything else by its
    slice; start and stop clamp as a slice's do."""
    ids = (0, 1, -1, 2**63 - 1, -(2**63), 50_000, 7)
    expected = array("q", ids).tobytes()
    for seq in (ids, list(ids), array("q", ids), np.array(ids, dtype=np.int64), ids[:]):
        assert run(kernel, "pack_int64", seq, 0, len(ids)) == expected
        assert run(kernel, "pack_int64", seq, 2, 5) == expected[16:40]
        assert run(kernel, "pack_int64", seq, 3, 100) == expected[24:]
        assert run(kernel, "pack_int64", seq, 6, 2) == b""
    assert run(kernel, "pack_int64", range(3, 9), 1, 4) == array("q", [4, 5, 6]).tobytes()
    assert run(kernel, "pack_int64", (True, _Index(9)), 0, 2) == array("q", [1, 9]).tobytes()
    assert run(kernel, "pack_int64", np.array([5, 6], dtype=np.int32), 0, 2) == (
        array("q", [5, 6]).tobytes()
    )


@pytest.mark.parametrize("kernel", KERNELS)
def test_pack_int64_refuses_what_the_array_refuses_with_its_words(kernel):
    assert outcome(kernel, "pack_int64", (1, "a"), 0, 2) == (
        "TypeError",
        "'str' object cannot be interpreted as an integer",
    )
    assert outcome(kernel, "pack_int64", [1, 2.0], 0, 2) == (
        "TypeError",
        "'float' object cannot be interpreted as an integer",
    )
    with pytest.raises(OverflowError, match="int too big to convert"):
        run(kernel, "pack_int64", (1, 2**63), 0, 2)
    with pytest.raises(OverflowError, match="int too big to convert"):
        run(kernel, "pack_int64", [-(2**63) - 1], 0, 1)
    assert run(kernel, "pack_int64", (1, "a"), 0, 1) == array("q", [1]).tobytes()  # not read
    wrong = ("ValueError", "pack_int64: start and stop must be >= 0")
    assert outcome(kernel, "pack_int64", (1, 2), -1, 2) == wrong
    assert outcome(kernel, "pack_int64", (1, 2), 0, -2) == wrong


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=80),
    start=st.integers(0, 90),
    stop=st.integers(0, 90),
)
def test_pack_int64_compiled_equals_the_reference(ids, start, stop):
    expected = array("q", ids[start:stop]).tobytes()
    for kernel in KERNELS:
        for seq in (tuple(ids), ids, array("q", ids)):
            assert run(kernel, "pack_int64", seq, start, stop) == expected


@pytest.mark.parametrize("kernel", KERNELS)
def test_common_items_counts_the_equal_leading_items_of_two_tuple_ranges(kernel):
    a, b = tuple(range(100)), tuple(range(100))  # equal values, different int objects past 256
    assert run(kernel, "common_items", a, 0, b, 0, 100) == 100
    assert run(kernel, "common_items", a, 10, b, 10, 50) == 50
    c = a[:37] + (-1,) + a[38:]
    assert run(kernel, "common_items", a, 0, c, 0, 100) == 37
    assert run(kernel, "common_items", a, 5, c, 5, 90) == 32
    assert run(kernel, "common_items", a, 1, a, 0, 5) == 0
    assert run(kernel, "common_items", a, 0, b, 0, 0) == 0
    wrong = ("ValueError", "common_items: the ranges must be within both tuples")
    assert outcome(kernel, "common_items", a, 90, b, 0, 20) == wrong
    assert outcome(kernel, "common_items", a, -1, b, 0, 1) == wrong
    assert outcome(kernel, "common_items", list(a), 0, b, 0, 1) == (
        "TypeError",
        "common_items: a and b must be tuples",
    )
