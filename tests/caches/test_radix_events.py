"""radix KV events: per-page, position-aware, chained block hashes (kvplug.caches.block_hashing).

Expected hashes are computed from the documented rule, independently of kvplug's code
(tests/hash_rule.py).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import kvplug.caches.block_hashing as block_hashing
import kvplug.caches.radix_events as radix_events
from kvplug.caches.block_hash import BlockHashCache
from kvplug_hookspecs import CacheKey, EvictParams, MatchResult
from tests.cache_helpers import (
    RecordingEvents,
    make_allocator,
    make_radix,
    new_policy_factory,
    put,
)
from tests.hash_rule import chain, ev, seed


def stored(events: RecordingEvents) -> list[tuple]:
    return [
        (e.num_tokens, e.block_hashes, e.parent_block_hash, e.token_ids, e.extra_key)
        for e in events.stored
    ]


def removed(events: RecordingEvents) -> list[tuple]:
    return [(e.num_tokens, e.block_hashes, e.reason) for e in events.removed]


def assert_published_set_exact(cache, events: RecordingEvents, p: int) -> None:
    """Every node's page hashes follow the rule on its path from the root, and the hashes
    stored minus those removed are exactly the cached pages' hashes (each once); only
    evictions of cached pages carry hashes (a window-only eviction carries none)."""
    live: dict[int, int] = {}
    for e in events.stored:
        for h in e.block_hashes:
            live[h] = live.get(h, 0) + 1
    for e in events.removed:
        assert e.reason == "evicted" or e.block_hashes == ()
        for h in e.block_hashes:
            live[h] -= 1
    cached = []
    for node in cache._nodes():
        path, up = [], node
        while up is not cache.root:
            path[:0] = up.key
            up = up.parent
        expected = chain(path, p)[-(node.num_tokens // p) :]
        assert cache._hashes.digests(node) == expected
        cached.extend(ev(expected))
    assert sorted(cached) == sorted(h for h, n in live.items() for _ in range(n))
    assert all(n in (0, 1) for n in live.values())


def test_the_rule_pinned_to_literal_values():
    """A change of the scheme changes these numbers (routers would see other hashes)."""
    assert ev(chain([1, 2], 1)) == (8020595319639443153, 17451725001422572686)
    assert ev(chain([1, 2], 1)) == tuple(
        block_hashing.event_hash(d)
        for d in block_hashing.iter_chain(hashlib.sha256, seed(), (1, 2), 1, 2)
    )


def test_page_1_store_split_evict_cut_restore():
    events = RecordingEvents()
    cache, allocator = make_radix(capacity=32, events=events)
    a = chain([1, 2, 3, 4], 1)
    put(cache, allocator, [1, 2, 3, 4])
    put(cache, allocator, [1, 2, 3, 4])  # all cached: nothing stored
    assert stored(events) == [(4, ev(a), None, (1, 2, 3, 4), None)]

    cache.match_prefix([1, 2, 9])  # splits [1,2,3,4] after 2 tokens: no event
    cache.match_prefix([1, 2, 3], record_hit=False)  # and after 3: no event
    assert len(events.stored) == 1 and events.removed == []

    b = chain([5, 6], 1, parent=a[1])
    put(cache, allocator, [1, 2, 5, 6])
    assert stored(events)[1] == (2, ev(b), ev(a)[1], (5, 6), None)

    c = chain([3, 4], 1)  # the same tokens at depth 0: other hashes than a[2:]
    put(cache, allocator, [3, 4])
    assert stored(events)[2] == (2, ev(c), None, (3, 4), None)
    assert set(ev(c)).isdisjoint(ev(a))

    # LRU: the [3], [4] tail of the first key is the oldest leaf (two nodes after the splits)
    cache.evict(EvictParams(num_tokens=2))
    assert removed(events) == [(2, ev(a[3:]) + ev(a[2:3]), "evicted")]
    # then [5, 6], then its parent [1, 2] is cut (exact granularity): only page [2] is freed
    cache.evict(EvictParams(num_tokens=3))
    assert removed(events)[1] == (3, ev(b) + ev(a[1:2]), "evicted")
    assert cache.match_prefix([1, 2]).prefix_len == 1

    # the kept page chains on: [2] at depth 1 hashes as before
    d = chain([2, 7], 1, parent=a[0])
    put(cache, allocator, [1, 2, 7])
    assert stored(events)[3] == (2, ev(d), ev(a)[0], (2, 7), None)
    assert ev(d)[0] == ev(a)[1]

    cache.reset()
    assert [e.num_tokens for e in events.cleared] == [5]
    put(cache, allocator, [1, 2, 3, 4])  # a fresh tree: the same content, the same hashes
    assert stored(events)[4] == stored(events)[0]


def test_page_4_whole_pages_only_and_the_same_hashes_as_block_hash():
    events = RecordingEvents()
    cache, allocator = make_radix(capacity=64, page_size=4, events=events)
    key = list(range(100, 110))  # 10 tokens: 2 whole pages are cached, 2 stay the caller's
    a = chain(key, 4)
    assert len(a) == 2
    slots = allocator.alloc(12)
    cache.insert(key, slots[:10])
    allocator.free(slots[8:])
    assert stored(events) == [(8, ev(a), None, tuple(key[:8]), None)]

    cache.match_prefix([100, 101, 102, 103, 0, 0, 0, 0])  # splits after page 1: no event
    other = key[:4] + [7, 7, 7, 7, 8, 8, 8, 8]
    b = chain(other[4:], 4, parent=a[0])
    put(cache, allocator, other)
    assert stored(events)[1] == (8, ev(b), ev(a)[0], tuple(other[4:]), None)

    ns = chain(key, 4, parent=seed("tenant"))
    put(cache, allocator, key[:8], extra_key="tenant")
    assert stored(events)[2] == (8, ev(ns), None, tuple(key[:8]), "tenant")

    cache.evict(EvictParams(num_tokens=4))  # the oldest leaf is key's page 2 (4 tokens)
    assert removed(events) == [(4, ev(a[1:]), "evicted")]
    cache.evict(EvictParams(num_tokens=5))  # 5 -> 2 pages: other's whole leaf (2 pages)
    assert removed(events)[1] == (8, ev(b), "evicted")

    # block_hash hashes the same pages from the root the same way
    blocks = RecordingEvents()
    allocator2 = make_allocator(64, 4)
    block_cache = BlockHashCache(allocator2, new_policy_factory("lru"), page_size=4, events=blocks)
    put(block_cache, allocator2, key[:8])
    put(block_cache, allocator2, other)
    assert stored(blocks) == [
        (8, ev(a), None, tuple(key[:8]), None),
        (8, ev(b), ev(a)[0], tuple(other[4:]), None),
    ]


def test_insert_continuing_from_prev_emits_the_same_events():
    runs = []
    for use_prev in (False, True):
        events = RecordingEvents()
        cache, allocator = make_radix(capacity=32, events=events)
        put(cache, allocator, [1, 2, 3])
        key = CacheKey((1, 2, 3, 4, 5))
        m = cache.match_prefix(key)
        slots = torch.cat([m.device_indices, allocator.alloc(2)])
        prev: MatchResult | None = m if use_prev else None
        assert cache.insert(key, slots, prev=prev) == 3
        runs.append(stored(events))
    assert runs[0] == runs[1]
    assert runs[0][1] == (
        2,
        ev(chain([1, 2, 3, 4, 5], 1)[3:]),
        ev(chain([1, 2, 3], 1))[2],
        (4, 5),
        None,
    )


def test_no_observer_no_hashing(monkeypatch: pytest.MonkeyPatch):
    def refuse(*args, **kwargs):
        raise AssertionError("hashed with no observer")

    monkeypatch.setattr(block_hashing, "iter_chain", refuse)
    monkeypatch.setattr(radix_events, "RadixBlockHashes", refuse)
    cache, allocator = make_radix(capacity=32, page_size=1)
    assert cache._hashes is None
    put(cache, allocator, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 9])
    put(cache, allocator, [1, 2, 5])
    cache.evict(EvictParams(num_tokens=4))
    cache.reset()
    assert cache._hashes is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_operations_keep_every_node_hash_and_the_published_set_exact(page_size: int):
    """After seeded random inserts, probes (splits), locks and evictions, every node's page
    hashes equal the rule applied to its path from the root, and the hashes stored minus those
    removed are exactly the cached pages' hashes."""
    import random

    rng = random.Random(page_size)
    events = RecordingEvents()
    cache, allocator = make_radix(capacity=256, page_size=page_size, events=events)
    p = page_size
    locked: list = []
    for _ in range(150):
        op = rng.random()
        key = [rng.randrange(3) for _ in range(p * rng.randrange(1, 7))]
        if op < 0.45:
            if allocator.available_size() < len(key):
                cache.evict(EvictParams(num_tokens=len(key)))
            if allocator.available_size() >= len(key):
                m = cache.match_prefix(key)
                slots = torch.cat([m.device_indices, allocator.alloc(len(key) - m.prefix_len)])
                cache.insert(key, slots, prev=m if rng.random() < 0.5 else None)
        elif op < 0.65:
            cache.match_prefix(key, record_hit=rng.random() < 0.5)
        elif op < 0.8:
            node = cache.match_prefix(key).last_node
            cache.inc_lock_ref(node)
            locked.append(node)
        elif op < 0.9 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(EvictParams(num_tokens=p * rng.randrange(1, 5)))
    assert events.removed and len(events.stored) > 5

    assert_published_set_exact(cache, events, p)


# -- swa_radix: the full side, with the same hashes; the window side keeps count-only events ----


def _swa(events: RecordingEvents, page_size: int = 1):
    from kvplug.allocators import SWAAllocator
    from kvplug.caches.swa_radix import SWARadixCache

    allocator = SWAAllocator(64, 32, 4, page_size=page_size, device="cpu", debug_checks=True)
    cache = SWARadixCache(allocator, new_policy_factory("lru"), events=events)
    return cache, allocator


def test_swa_radix_full_side_events_carry_the_radix_hashes():
    events = RecordingEvents()
    cache, allocator = _swa(events)
    a = chain([1, 2, 3, 4, 5, 6], 1)
    put(cache, allocator, [1, 2, 3, 4, 5, 6])
    assert stored(events) == [(6, ev(a), None, (1, 2, 3, 4, 5, 6), None)]

    # the window side of the oldest 3 tokens is freed: a split and a tombstone, no hashes
    cache.evict(EvictParams(swa_num_tokens=3))
    assert removed(events) == [(3, (), "swa_evicted")]
    assert len(events.stored) == 1

    # a key whose first 2 new tokens already lost their window: two nodes, one event each,
    # the second chained on the first (the tombstoned head is still stored on the full side)
    b = chain([7, 8, 9, 10], 1, parent=a[5])
    slots = allocator.alloc(10)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], slots, swa_evicted_seqlen=8)
    assert stored(events)[1:] == [
        (2, ev(b[:2]), ev(a)[5], (7, 8), None),
        (2, ev(b[2:]), ev(b)[1], (9, 10), None),
    ]

    # full eviction: the leaf [9, 10], then [7, 8] cut by exact granularity to its first page
    cache.evict(EvictParams(num_tokens=3))
    assert removed(events)[1] == (3, ev(b[2:]) + ev(b[1:2]), "evicted")
    assert cache.total_size() == 7  # [1..6] and [7] stay cached on the full side

    cache.reset()
    assert events.cleared[-1].num_tokens == 7


def test_swa_radix_page_4_hashes_equal_radix_and_block_hash():
    """The same pages from the root hash alike in radix and swa_radix (and block_hash)."""
    key = list(range(100, 116))
    got = []
    for kind in ("radix", "swa"):
        events = RecordingEvents()
        if kind == "radix":
            cache, allocator = make_radix(capacity=64, page_size=4, events=events)
        else:
            cache, allocator = _swa(events, page_size=4)
        put(cache, allocator, key)
        put(cache, allocator, key, extra_key="lora-1")
        got.append((events.stored[0].block_hashes, events.stored[1].block_hashes))
    assert got[0] == got[1] == (ev(chain(key, 4)), ev(chain(key, 4, parent=seed("lora-1"))))


def test_swa_radix_without_an_observer_hashes_nothing(monkeypatch):
    from kvplug.allocators import SWAAllocator
    from kvplug.caches.swa_radix import SWARadixCache

    def boom(*args, **kwargs):
        raise AssertionError("hashed without an observer")

    monkeypatch.setattr(block_hashing, "iter_chain", boom)
    allocator = SWAAllocator(64, 32, 4, device="cpu")
    cache = SWARadixCache(allocator, new_policy_factory("lru"))
    put(cache, allocator, [1, 2, 3, 4])
    cache.evict(EvictParams(num_tokens=2, swa_num_tokens=2))
    assert cache._hashes is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_swa_radix_random_operations_keep_the_published_set_exact(page_size: int):
    """swa_radix under seeded random inserts (some with window-freed heads), probes, locks,
    full and window evictions: every node's hashes follow the rule on its path, and the hashes
    stored minus those removed are exactly the pages cached on the full side."""
    import random

    rng = random.Random(100 + page_size)
    events = RecordingEvents()
    cache, allocator = _swa(events, page_size)
    p = page_size
    locked: list = []
    for _ in range(150):
        op = rng.random()
        key = [rng.randrange(3) for _ in range(p * rng.randrange(1, 5))]
        if op < 0.45:
            short = allocator.shortfall(len(key))
            if short is not None:
                cache.evict(short)
            if allocator.shortfall(len(key)) is None:
                cache.match_prefix(key)  # a hit first, as an engine does
                slots = allocator.alloc(len(key))
                gone = p * rng.randrange(0, len(key) // p + 1) if rng.random() < 0.3 else 0
                cache.insert(key, slots, swa_evicted_seqlen=gone)
        elif op < 0.6:
            cache.match_prefix(key, record_hit=rng.random() < 0.5)
        elif op < 0.75:
            node = cache.match_prefix(key).last_node
            cache.inc_lock_ref(node)
            locked.append(node)
        elif op < 0.85 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            full, window = p * rng.randrange(0, 3), p * rng.randrange(0, 3)
            cache.evict(EvictParams(num_tokens=full, swa_num_tokens=window))
    assert len(events.removed) > 3 and len(events.stored) > 5
    assert any(e.reason == "swa_evicted" and e.num_tokens for e in events.removed)

    assert_published_set_exact(cache, events, p)
