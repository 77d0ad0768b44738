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

    monkeypatch.setattr(radix_events, "iter_chain", refuse)
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

    live: dict[int, int] = {}
    for e in events.stored:
        for h in e.block_hashes:
            live[h] = live.get(h, 0) + 1
    for e in events.removed:
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
