"""The hot-path kernels of the radix cache, the allocators' checks and the vLLM free list, compiled
when possible.

Each function here is the reference: plain Python that defines the behaviour. When the C
extension ``kvplug._speedups`` was built (``pip install`` compiles it with the system's C
compiler; a failed build is not an error), :func:`use_native` puts its versions of the same
functions in their place. ``KVPLUG_PURE_PYTHON=1`` in the environment keeps the Python ones.
The test suite runs the radix cache and allocator tests on both.

Callers look the functions up on this module at call time (``speedups.walk(...)``), so
switching takes effect everywhere at once. Nothing here touches a policy or an allocator: the
kernels only walk, compare and count, and every one checks before it changes anything.
"""

from __future__ import annotations

import hashlib
import operator
import os
from array import array
from typing import Any

import numpy as np

__all__ = [
    "NATIVE_AVAILABLE",
    "bind_node_type",
    "check_slots",
    "check_token_ids",
    "common_items",
    "common_prefix",
    "distinct_units",
    "expand_units",
    "free_list_append",
    "free_list_popleft",
    "free_list_touch",
    "lock_path",
    "native_enabled",
    "native_type",
    "pack_int64",
    "release_slots",
    "sha256_chain",
    "stamp_hits",
    "use_native",
    "walk",
]


def _load_native() -> Any:
    try:
        from . import _speedups
    except ImportError:  # not built (no compiler at install time): the Python versions serve
        return None
    return _speedups


_native = _load_native()

NATIVE_AVAILABLE = _native is not None
_bound: list[type] = []  # the node class given to bind_node_type


def bind_node_type(cls: type) -> None:
    """Declare the node class the kernels walk (its fields must be ``__slots__``; one class)."""
    if _bound and _bound[0] is not cls:
        raise RuntimeError(f"kvplug.speedups walks {_bound[0].__name__} nodes already")
    _bound[:] = [cls]
    if native_enabled():
        _native.bind_node_type(cls)


def walk(
    root: Any, node: Any, ids: Any, pos: int, end: int, page: int, extra_key: Any
) -> tuple[Any, int, list[Any], Any]:
    """Descend from ``node`` (whose path ends at ``pos``) along ``ids[pos:end]``.

    ``ids`` is a tuple of ints or a 1-D int64 buffer (an ``array('q')``, SGLang's token
    arrays: read in place, so a probe needs no tuple of the whole prompt). A child is keyed by
    its first token (``page == 1``) or first page, under the root by ``(extra_key, first)``.
    Returns ``(last, pos, path, mismatch)``: the last node whose whole edge matched, where it
    ends, the nodes walked, and the child where the match ends inside an edge (the caller
    splits it) or ``None``. Changes nothing.
    """
    ids = _token_tuple(ids)
    if page < 1 or pos < 0 or end > len(ids):
        raise ValueError("walk: bad page size or range")
    path: list[Any] = []
    if pos >= end:
        return node, pos, path, None
    first = ids[pos] if page == 1 else ids[pos : pos + page]
    child = node.children.get((extra_key, first) if node is root else first)
    while child is not None:
        nxt = pos + child.num_tokens
        if nxt > end or ids[pos:nxt] != child.key:
            return node, pos, path, child
        path.append(child)
        node, pos = child, nxt
        if pos >= end:
            break
        child = node.children.get(ids[pos] if page == 1 else ids[pos : pos + page])
    return node, pos, path, None


def _token_tuple(ids: Any) -> tuple[int, ...]:
    """``walk``'s key as a tuple: a tuple as it is, a 1-D int64 buffer converted."""
    if isinstance(ids, tuple):
        return ids
    return tuple(_int64_view(ids, "walk: ids must be a tuple or a 1-D int64 buffer").tolist())


def stamp_hits(path: list[Any], count: int, now: int) -> None:
    """``path[:count]`` gets the time ``now`` and one more hit each (a match's inner nodes)."""
    for node in path[:count]:
        node.last_access_time = now
        node.hit_count += 1


def lock_path(node: Any, root: Any, delta: int) -> int:
    """Add ``delta`` (1: lock, -1: unlock) to ``lock_ref`` of every node from ``node`` up to,
    not including, ``root``. Returns the tokens whose nodes became locked (or unlocked).

    Checked first (every node is under ``root``; no count goes negative): a failure changes
    nothing.
    """
    if delta not in (1, -1):
        raise ValueError("lock_path: delta is 1 or -1")
    up = node
    while up is not root:
        if up is None:
            raise ValueError("lock_path: the node is not under this root")
        if delta < 0 and up.lock_ref < 1:
            raise ValueError("lock_path: a lock count would go negative")
        up = up.parent
    moved = 0
    was = 0 if delta > 0 else 1
    while node is not root:
        if node.lock_ref == was:
            moved += node.num_tokens
        node.lock_ref += delta
        node = node.parent
    return moved


def check_slots(
    idx: np.ndarray,
    state: np.ndarray | None,
    div: int,
    require: int,
    low: int,
    high: int,
    scratch: np.ndarray,
    set_to: int = -1,
) -> tuple[int, int, int, int]:
    """Range, duplicate and owner-state scan of slot ids ``idx`` (int64), in one pass.

    Returns ``(lo, hi, first_dup, first_bad)``: the smallest and largest id; when either is
    outside ``low..high`` (or ``state`` is ``None``: no ownership tracking), the other two are
    ``-1`` and nothing else is read. ``first_dup``: the first position whose id appears again
    later; ``first_bad``: the first position whose unit ``id // div`` is free (``require < 0``)
    or not in state ``require``; ``-1``: none. ``scratch`` (int64, longer than the largest id)
    is overwritten. ``set_to >= 0``: when every check passed, each unit's state becomes
    ``set_to`` (a checked ownership change in the same call).
    """
    n = idx.size
    if n == 0:
        return 0, -1, -1, -1
    lo, hi = int(idx.min()), int(idx.max())
    if lo < low or hi > high or state is None:
        return lo, hi, -1, -1
    positions = np.arange(n)
    scratch[idx] = positions
    dup = scratch[idx] != positions
    units = idx // div if div != 1 else idx
    owners = state[units]
    bad = owners == 0 if require < 0 else owners != require
    first_dup = int(dup.argmax()) if dup.any() else -1
    first_bad = int(bad.argmax()) if bad.any() else -1
    if set_to >= 0 and first_dup < 0 and first_bad < 0:
        state[units] = set_to
    return lo, hi, first_dup, first_bad


def release_slots(
    idx: np.ndarray,
    state: np.ndarray | None,
    div: int,
    low: int,
    high: int,
    scratch: np.ndarray,
    unit_scratch: np.ndarray,
    units_out: np.ndarray,
    ids: np.ndarray,
    top: int,
) -> tuple[int, int, int, int, int]:
    """A checked free of slots ``idx`` into a free-id stack (``ids``, its top ``top``), in one call.

    Returns ``(lo, hi, first_dup, first_bad, k)``. The checks are ``check_slots``'s with
    "not free" required (``state`` ``None``: range only). When every check passes, the ``k``
    distinct units ``idx // div`` (every slot, duplicates too, when ``div == 1``; each page once
    otherwise, via ``unit_scratch`` and ``units_out``) go to ``ids[top - k:top]`` and are marked
    free in ``state``, if ``k <= top``; the caller lowers its top by ``k``. A failed check or
    ``k > top`` changes nothing.
    """
    if div < 1 or top < 0:
        raise ValueError("release_slots: div must be >= 1 and top >= 0")
    lo, hi, first_dup, first_bad = check_slots(idx, state, div, -1, low, high, scratch)
    if idx.size == 0 or lo < low or hi > high or first_dup >= 0 or first_bad >= 0:
        return lo, hi, first_dup, first_bad, 0
    if div == 1:
        units = idx
    else:
        units = units_out[: distinct_units(idx, div, unit_scratch, units_out)]
    k = int(units.size)
    if k <= top:
        ids[top - k : top] = units
        if state is not None:
            state[units] = 0
    return lo, hi, first_dup, first_bad, k


def distinct_units(idx: np.ndarray, div: int, scratch: np.ndarray, out: np.ndarray) -> int:
    """Write the distinct units ``idx // div`` (e.g. the pages of slots) to ``out[:k]``; return
    ``k``. Each unit is kept at the last position it occurs, in position order, without a sort:
    every position writes its number into its unit's cell of ``scratch`` (overwritten) and the
    positions that read their own number back keep their unit.
    """
    if div < 1:
        raise ValueError("distinct_units: div must be >= 1")
    units = idx // div if div != 1 else idx
    if out.size < idx.size or (idx.size and (units.min() < 0 or units.max() >= scratch.size)):
        raise ValueError("distinct_units: an id is outside scratch, or out is short")
    positions = np.arange(idx.size)
    scratch[units] = positions
    kept = units[scratch[units] == positions]
    out[: kept.size] = kept
    return int(kept.size)


def expand_units(units: np.ndarray, div: int, out: np.ndarray) -> None:
    """The slots of units (pages of ``div`` slots), in order: ``out[i * div + j] = units[i] *
    div + j`` (``out`` holds at least ``len(units) * div``)."""
    if div < 1:
        raise ValueError("expand_units: div must be >= 1")
    n = units.size * div
    if out.size < n:
        raise ValueError("expand_units: out is short")
    out[:n] = (units[:, None] * div + np.arange(div)).reshape(-1)


def check_token_ids(ids: tuple[int, ...], known: tuple[int, ...] | None = None) -> bool:
    """Every token id is an int (or has ``__index__``, as ``array('q')`` accepts) that fits in
    int64; raises naming the first bad position. The common case is one C pass of ``array``.

    Returns whether every element is an exact ``int``. ``known``: a tuple that passed with
    ``True`` before; the leading positions of ``ids`` holding the very objects ``known`` holds
    there need no second look (an insert's key after its match's; the compiled kernel skips
    them with a pointer compare, this reference checks them again: the result is the same).
    """
    if not isinstance(ids, tuple):
        raise TypeError("check_token_ids takes a tuple")
    if known is not None and not isinstance(known, tuple):
        raise TypeError("check_token_ids: known must be a tuple or None")
    try:
        array("q", ids)
    except (TypeError, OverflowError):
        for pos, value in enumerate(ids):
            try:
                number = operator.index(value)
            except TypeError:
                raise TypeError(
                    f"token ids must be ints: position {pos} is {value!r} ({type(value).__name__})"
                ) from None
            if not -(2**63) <= number < 2**63:
                raise ValueError(
                    f"token ids must fit in int64: position {pos} is {value!r}"
                ) from None
        raise
    return set(map(type, ids)) <= {int}


def common_prefix(a: Any, b: Any, n: int) -> int:
    """The length of the common prefix of ``a[:n]`` and ``b[:n]``, two 1-D int64 buffers (e.g.
    SGLang's ``array('q')`` of a request's tokens) at least ``n`` long (see ``_equal_run``)."""
    wrong = "common_prefix: a and b must be 1-D int64 buffers"
    x, y = _int64_view(a, wrong), _int64_view(b, wrong)
    if n < 0 or n > len(x) or n > len(y):
        raise ValueError("common_prefix: n must be within both buffers")
    return _equal_run(x, 0, y, 0, n)


def common_items(a: tuple[Any, ...], i: int, b: tuple[Any, ...], j: int, n: int) -> int:
    """How many of ``a[i:i+n]`` equal ``b[j:j+n]`` from the start, ``a`` and ``b`` tuples (a
    radix node's key and a request's tokens). Here by ``_equal_run``; compiled, one pointer
    compare per item."""
    if not (type(a) is tuple and type(b) is tuple):
        raise TypeError("common_items: a and b must be tuples")
    if i < 0 or j < 0 or n < 0 or n > len(a) - i or n > len(b) - j:
        raise ValueError("common_items: the ranges must be within both tuples")
    return _equal_run(a, i, b, j, n)


def _equal_run(x: Any, i: int, y: Any, j: int, n: int) -> int:
    """How many of ``x[i:i+n]`` equal ``y[j:j+n]`` from the start (both sliceable, the ranges
    checked): galloping windows, then bisection inside the first unequal one, so O(log n)
    C-level slice compares and no Python loop per item."""
    lo, step = 0, 16
    while lo < n:
        hi = min(lo + step, n)
        if x[i + lo : i + hi] != y[j + lo : j + hi]:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if x[i + lo : i + mid] == y[j + lo : j + mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo, step = hi, step * 2
    return n


def _int64_view(buffer: Any, wrong: str) -> memoryview:
    """``buffer`` as a memoryview of a contiguous 1-D int64 vector, or ``TypeError(wrong)``."""
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(wrong) from None
    int64 = view.ndim == 1 and view.itemsize == 8 and view.format in ("q", "l")
    if not int64 or not view.c_contiguous:
        raise TypeError(wrong)
    return view


def pack_int64(ids: Any, start: int, stop: int) -> bytes:
    """``ids[start:stop]`` (token ids: a tuple, a list, an ``array('q')``) as int64s in machine
    byte order: the bytes page digests and page checksums cover. ``array`` takes about 27 ns an
    element from a tuple (14 µs for a 512-token page); the compiled version reads the ints
    directly."""
    if start < 0 or stop < 0:
        raise ValueError("pack_int64: start and stop must be >= 0")
    return array("q", ids[start:stop]).tobytes()


def sha256_chain(parent: bytes, data: bytes, start: int, count: int, size: int) -> list[bytes]:
    """The SHA-256 digests of pages ``start`` to ``start + count - 1`` of ``data`` (``size``
    bytes each), each of the previous digest followed by the page's bytes, the first chained
    from ``parent`` (32 bytes): kvplug's page digests (``kvplug.caches.block_hashing``)."""
    if (
        len(parent) != 32
        or start < 0
        or count < 0
        or size < 0
        or (size and (start + count) * size > len(data))
    ):
        raise ValueError("sha256_chain: parent must be 32 bytes and the pages within data")
    out: list[bytes] = []
    digest = parent
    for i in range(start, start + count):
        digest = hashlib.sha256(digest + data[i * size : (i + 1) * size]).digest()
        out.append(digest)
    return out


# -- a free-block list with a policy (vLLM's ``FreeKVCacheBlockQueue`` under kvplug) ----------
# The blocks are vLLM's ``KVCacheBlock`` objects, read and written by attribute name only
# (``block_id``, ``block_hash``, ``prev_free_block``, ``next_free_block``, ``ref_cnt``,
# ``is_null``); nothing here imports vLLM. The per-block state (``tracked``: a bytearray,
# ``last``/``hits``/``num_children``/``parent_of``/``parent_gen``/``gen``/``content``: lists)
# is the queue's (:class:`kvplug.integrations.vllm.block_pool.PolicyFreeBlockQueue` documents
# it); ``add``/``discard``/``pop``/``pushpop`` are its rank's methods.


def free_list_append(
    blocks: list[Any],
    tail: Any,
    tracked: bytearray,
    last: list[int],
    num_children: list[int],
    clock: int,
    add: Any,
) -> None:
    """Link ``blocks`` (non-empty) in order before the list's ``tail`` sentinel, as vLLM's
    ``append_n``; block ``i`` that holds a hash is tracked with recency ``clock + 1 + i``, and
    becomes a candidate (``add``) while it has no cached successor."""
    last_block = tail.prev_free_block
    for tick, block in enumerate(blocks, clock + 1):  # a tick each
        block.prev_free_block = last_block
        last_block.next_free_block = block
        last_block = block
        if block.block_hash is None:
            continue  # unhashed: reused in vLLM's order
        block_id = block.block_id
        tracked[block_id] = 1
        last[block_id] = tick
        if not num_children[block_id]:
            add(block_id)
    last_block.next_free_block = tail
    tail.prev_free_block = last_block


def free_list_popleft(
    head: Any,
    n: int,
    tracked: bytearray,
    blocks: list[Any],
    parent_of: list[int],
    parent_gen: list[int],
    gen: list[int],
    num_children: list[int],
    content: list[Any],
    pop: Any,
    pushpop: Any,
    add: Any,
) -> list[Any]:
    """Unlink and return ``n`` blocks (the list holds at least ``n``): the one after the
    ``head`` sentinel while it is not tracked, else the rank's victim (``pop``; the head again
    when the rank has none). A taken block's content goes (``content`` entry ``None``): its
    children's links become stale (``gen`` ticks), and a tracked parent whose last cached child
    it was becomes a candidate (``pushpop`` at the next choice, or ``add`` at the end)."""
    carry = -1  # a parent that just became a candidate (added at the next pop, or at the end)
    taken: list[Any] = []
    keep = taken.append
    for _ in range(n):
        victim = head.next_free_block
        block_id = victim.block_id
        if tracked[block_id]:
            if carry >= 0:
                chosen = pushpop(carry)
                carry = -1
            else:
                chosen = pop()
            if chosen >= 0:
                block_id = chosen
                victim = blocks[chosen]
            tracked[block_id] = 0
        # unlink from vLLM's list (what its remove() does, without the call)
        before, after = victim.prev_free_block, victim.next_free_block
        before.next_free_block = after
        after.prev_free_block = before
        victim.prev_free_block = victim.next_free_block = None
        if content[block_id] is not None:  # its hashes go next: no chain runs through it
            content[block_id] = None
            if num_children[block_id]:  # links of its children name an older generation
                num_children[block_id] = 0
                gen[block_id] += 1
            parent_id = parent_of[block_id]  # (reset when it caches new content)
            if parent_id >= 0 and parent_gen[block_id] == gen[parent_id]:
                left = num_children[parent_id] - 1
                num_children[parent_id] = left
                if not left and tracked[parent_id]:
                    if carry >= 0:
                        add(carry)
                    carry = parent_id
        keep(victim)
    if carry >= 0:
        add(carry)
    return taken


def free_list_touch(
    blocks: Any, tracked: bytearray, num_children: list[int], hits: list[int], discard: Any
) -> tuple[int, int]:
    """vLLM's ``BlockPool.touch`` over a free list with a rank, in order: a free block
    (``ref_cnt`` 0) is unlinked (a tracked leaf leaves the rank), every non-null block gets a
    reference, a hashed one a hit. Returns ``(unlinked, bad)``: how many left the list, and the
    position of a free block that is not linked (``-1``: none); the touch stops before it, and
    the caller raises vLLM's error for it."""
    unlinked = 0
    for i, block in enumerate(blocks):
        if block.is_null:
            continue
        block_id = block.block_id
        if block.ref_cnt == 0:  # in the free list: take it out
            before, after = block.prev_free_block, block.next_free_block
            if before is None or after is None:
                return unlinked, i
            before.next_free_block = after
            after.prev_free_block = before
            block.prev_free_block = block.next_free_block = None
            unlinked += 1
            if tracked[block_id]:
                tracked[block_id] = 0
                if not num_children[block_id]:  # only leaves are candidates
                    discard(block_id)
        block.ref_cnt += 1
        if block.block_hash is not None:
            hits[block_id] += 1
    return unlinked, -1


def native_type(name: str) -> Any:
    """The compiled class ``name`` of ``kvplug._speedups`` (the vLLM queue's block ranks:
    ``BlockHeap``, ``S3FIFORank``, ``ARCRank``) while the compiled kernels are in use, else
    ``None``: :mod:`kvplug.integrations.vllm.ranks` then uses its Python classes, the
    reference."""
    return getattr(_native, name) if native_enabled() else None


_PYTHON = {
    "walk": walk,
    "stamp_hits": stamp_hits,
    "lock_path": lock_path,
    "check_slots": check_slots,
    "distinct_units": distinct_units,
    "release_slots": release_slots,
    "expand_units": expand_units,
    "check_token_ids": check_token_ids,
    "common_prefix": common_prefix,
    "common_items": common_items,
    "sha256_chain": sha256_chain,
    "pack_int64": pack_int64,
    "free_list_append": free_list_append,
    "free_list_popleft": free_list_popleft,
    "free_list_touch": free_list_touch,
}


def use_native(enabled: bool = True) -> bool:
    """Use the compiled kernels (``True``) or the Python ones; returns whether native is on."""
    on = enabled and _native is not None
    source: Any = _native if on else None
    for name, func in _PYTHON.items():
        globals()[name] = getattr(source, name) if on else func
    if on:
        for cls in _bound:
            _native.bind_node_type(cls)
    return on


def native_enabled() -> bool:
    """Whether the compiled kernels are in use now."""
    return globals()["walk"] is not _PYTHON["walk"]


use_native(os.environ.get("KVPLUG_PURE_PYTHON", "") in ("", "0"))
