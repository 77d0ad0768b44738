"""SWARadixCache scenarios with exact numbers, through the public API and the ``swa`` allocator."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kvplug.allocators.swa import SWAAllocator
from kvplug.caches.common import start_content_id
from kvplug.caches.swa_radix import SWARadixCache, SWARadixNode, SWARadixOptions
from kvplug.eviction import evict_from_tree_cache
from kvplug.policies import LRUPolicy
from kvplug_hookspecs import CacheKey, EvictParams, EvictResult, PrefixCache, PrefixCacheContext
from tests.cache_helpers import (
    RecordingEvents,
    cached_slots,
    make_allocator,
    new_policy_factory,
    put,
)


def make_swa(capacity=64, swa_capacity=32, window=4, policy="lru", page_size=None, **kwargs):
    allocator = SWAAllocator(capacity, swa_capacity, window, device="cpu", debug_checks=True)
    cache = SWARadixCache(allocator, new_policy_factory(policy), page_size=page_size, **kwargs)
    return cache, allocator


def full_sizes(cache, allocator):
    return allocator.full_available_size(), cache.evictable_size(), cache.protected_size()


def swa_sizes(cache, allocator):
    return allocator.swa_available_size(), cache.swa_evictable_size(), cache.swa_protected_size()


A, B, C = list(range(0, 8)), list(range(8, 16)), list(range(16, 18))


# -- insert / match -----------------------------------------------------------------------------


def test_insert_and_match_without_tombstones():
    cache, allocator = make_swa()
    assert isinstance(cache, PrefixCache) and cache.is_chunk_cache is False
    assert cache.sliding_window_size == 4
    slots = put(cache, allocator, A + B)
    assert full_sizes(cache, allocator) == (48, 16, 0)
    assert swa_sizes(cache, allocator) == (16, 16, 0)
    m = cache.match_prefix(A + [99])
    assert m.prefix_len == 8 and m.device_indices.tolist() == slots[:8].tolist()
    assert isinstance(m.last_node, SWARadixNode) and m.last_node.num_tokens == 8  # split at 8
    assert cache.match_prefix(A + B).prefix_len == 16
    assert cache.match_prefix(A[:2]).prefix_len == 2  # no tombstone on the path: any length counts
    assert cache.match_prefix([]).last_node is cache.root


def test_namespaces_never_share():
    cache, allocator = make_swa()
    put(cache, allocator, A, extra_key="a")
    assert cache.match_prefix(CacheKey(A, "a")).prefix_len == 8
    assert cache.match_prefix(CacheKey(A, "b")).prefix_len == 0
    assert cache.match_prefix(A).prefix_len == 0
    assert cache.insert(CacheKey(A, "b"), allocator.alloc(8)) == 0
    assert cache.total_size() == 16


def test_insert_frees_duplicates_in_both_pools():
    cache, allocator = make_swa()
    first = put(cache, allocator, A)
    assert cache.insert(A + B, allocator.alloc(16)) == 8
    assert full_sizes(cache, allocator) == (48, 16, 0)
    assert swa_sizes(cache, allocator) == (16, 16, 0)
    assert set(first.tolist()) <= cached_slots(cache)


# -- tombstones ---------------------------------------------------------------------------------


def test_a_prefix_whose_window_was_evicted_does_not_match():
    cache, allocator = make_swa()
    put(cache, allocator, A)
    assert cache.evict(EvictParams(swa_num_tokens=8)) == EvictResult(swa_num_tokens=8)
    assert full_sizes(cache, allocator) == (56, 8, 0)  # the full side stays cached
    assert swa_sizes(cache, allocator) == (32, 0, 0)
    assert cache.match_prefix(A).prefix_len == 0
    # the dead leaf goes first on full eviction, before any live leaf
    put(cache, allocator, B)
    assert cache.evict(EvictParams(num_tokens=8)) == EvictResult(num_tokens=8)
    assert cache.match_prefix(B).prefix_len == 8 and cache.total_size() == 8


def test_a_tombstone_is_crossed_when_a_full_window_follows_it():
    cache, allocator = make_swa(window=4)
    put(cache, allocator, A + B)
    cache.match_prefix(A + [99])  # split: A and B are two nodes; LRU times grow root to leaf
    cache.match_prefix(A + B)
    # A goes: root-side nodes are the least recently used
    assert cache.evict(EvictParams(swa_num_tokens=8)) == EvictResult(swa_num_tokens=8)
    assert swa_sizes(cache, allocator) == (24, 8, 0)
    assert cache.match_prefix(A + B).prefix_len == 16  # 8 live tokens after the tombstone
    assert cache.match_prefix(A + B[:4]).prefix_len == 12  # exactly one window
    assert cache.match_prefix(A + B[:3]).prefix_len == 0  # 3 < window: back to before A
    assert cache.match_prefix(A).prefix_len == 0


def test_window_eviction_tombstones_the_head_and_keeps_the_tail_live():
    cache, allocator = make_swa(window=4)
    put(cache, allocator, A + B)
    assert cache.evict(EvictParams(swa_num_tokens=5)) == EvictResult(swa_num_tokens=5)  # exact
    assert swa_sizes(cache, allocator) == (21, 11, 0)
    assert cache.match_prefix(A + B).prefix_len == 16
    assert cache.match_prefix(A[:5]).prefix_len == 0
    assert cache.match_prefix(A[:5] + [99]).prefix_len == 0
    assert cache.match_prefix(A + [99]).prefix_len == 0  # only 3 live tokens after the tombstone
    assert cache.match_prefix(A + B[:1]).prefix_len == 9


def test_full_and_window_eviction_report_separately():
    cache, allocator = make_swa(window=4)
    put(cache, allocator, A)
    put(cache, allocator, B)
    cache.match_prefix(A)  # B is now the LRU leaf
    # 4 full tokens: B's tail (both pools); then 6 more window tokens: B's head and 2 of A
    result = cache.evict(EvictParams(num_tokens=4, swa_num_tokens=10))
    assert result == EvictResult(num_tokens=4, swa_num_tokens=10)
    assert full_sizes(cache, allocator) == (52, 12, 0)
    assert swa_sizes(cache, allocator) == (26, 6, 0)
    assert cache.stats.evicted_tokens == 4 and cache.stats.swa_evicted_tokens == 10
    assert cache.match_prefix(A).prefix_len == 8 and cache.match_prefix(B).prefix_len == 0
    # dead B(4) first, then A's live tail (6, both pools), then A's dead head (2, full only)
    assert cache.evict(EvictParams(num_tokens=12)) == EvictResult(num_tokens=12, swa_num_tokens=6)
    assert full_sizes(cache, allocator) == (64, 0, 0) and swa_sizes(cache, allocator) == (32, 0, 0)


def test_swa_shortfall_full_10_window_3_need_8_evicts_0_and_5():
    cache, allocator = make_swa(capacity=40, swa_capacity=20, window=4)
    running = allocator.alloc(13)  # a running request whose old tokens slid out of the window
    allocator.free_swa(running)
    put(cache, allocator, list(range(17)))
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (10, 3)
    assert evict_from_tree_cache(cache, 8) == EvictResult(num_tokens=0, swa_num_tokens=5)
    assert (allocator.full_available_size(), allocator.swa_available_size()) == (10, 8)
    assert full_sizes(cache, allocator)[1:] == (17, 0)
    assert swa_sizes(cache, allocator)[1:] == (12, 0)
    assert cache.match_prefix(list(range(17))).prefix_len == 17  # the live tail still matches
    assert allocator.alloc(8) is not None
    assert evict_from_tree_cache(cache, 2) == EvictResult(num_tokens=0, swa_num_tokens=2)


def test_exact_eviction_rounds_to_pages():
    cache, allocator = make_swa(page_size=2)
    put(cache, allocator, A + B)
    assert cache.evict(EvictParams(num_tokens=3)) == EvictResult(num_tokens=4, swa_num_tokens=4)
    assert cache.evict(EvictParams(swa_num_tokens=3)) == EvictResult(swa_num_tokens=4)
    assert cache.total_size() == 12 and cache.swa_total_size() == 8
    assert cache.match_prefix(A + B).prefix_len == 12


# -- locks --------------------------------------------------------------------------------------


def _chain(cache, allocator):
    """Cache A(8) -> B(2) -> C(2) as three nodes; return the node C."""
    put(cache, allocator, A + B[:2] + C)
    cache.match_prefix(A + [99])
    cache.match_prefix(A + B[:2] + [99])
    handle = cache.match_prefix(A + B[:2] + C).last_node
    b, a = handle.parent, handle.parent.parent
    assert (handle.num_tokens, b.num_tokens, a.num_tokens) == (2, 2, 8)
    return handle


def test_lock_protects_full_to_the_root_and_the_window_only_over_the_last_window():
    cache, allocator = make_swa(window=4)
    handle = _chain(cache, allocator)
    assert cache.inc_lock_ref(handle) == -12
    assert full_sizes(cache, allocator) == (52, 0, 12)
    assert swa_sizes(cache, allocator) == (20, 8, 4)  # window lock on C and B only
    # A's window is outside every window lock: it can be tombstoned; no full token can go
    result = cache.evict(EvictParams(num_tokens=12, swa_num_tokens=12))
    assert result == EvictResult(swa_num_tokens=8)
    assert full_sizes(cache, allocator) == (52, 0, 12) and swa_sizes(cache, allocator) == (28, 0, 4)
    assert cache.dec_lock_ref(handle) == 12
    assert full_sizes(cache, allocator) == (52, 12, 0) and swa_sizes(cache, allocator) == (28, 4, 0)
    assert cache.match_prefix(A + B[:2] + C).prefix_len == 12  # one window after the tombstone


def test_a_window_lock_reaching_a_long_node_locks_all_of_it():
    cache, allocator = make_swa(window=4)
    handle = _chain(cache, allocator)
    b = handle.parent
    cache.inc_lock_ref(b)  # B(2) + A(8): the window lock ends after A, as SGLang's
    assert swa_sizes(cache, allocator) == (20, 2, 10)
    cache.dec_lock_ref(b)
    assert swa_sizes(cache, allocator) == (20, 12, 0)


def test_unlock_after_a_split_of_a_locked_node_releases_exactly_what_was_locked():
    cache, allocator = make_swa(window=4)
    slots = put(cache, allocator, A + B + C)
    cache.match_prefix(A + [99])
    handle = cache.match_prefix(A + B + C).last_node  # A(8) -> BC(10)
    cache.inc_lock_ref(handle)  # window lock covers BC(10) >= 4
    assert swa_sizes(cache, allocator) == (14, 8, 10)
    # a new prompt splits the locked node inside the window lock's extent
    assert cache.insert(A + B[:4] + [99], torch.cat([slots[:12], allocator.alloc(1)])) == 12
    assert cache.dec_lock_ref(handle) == 18
    assert full_sizes(cache, allocator) == (45, 19, 0)
    assert swa_sizes(cache, allocator) == (13, 19, 0)


def test_bad_lock_calls_are_rejected_without_state_change():
    cache, allocator = make_swa(window=4)
    handle = _chain(cache, allocator)
    b = handle.parent
    with pytest.raises(ValueError, match="not locked"):
        cache.dec_lock_ref(handle)
    with pytest.raises(TypeError, match="SWARadixNode"):
        cache.inc_lock_ref(object())
    cache.evict(EvictParams(swa_num_tokens=8))  # tombstones A
    before = (full_sizes(cache, allocator), swa_sizes(cache, allocator))
    with pytest.raises(ValueError, match="tombstoned"):
        cache.inc_lock_ref(b)  # B's window would reach into the tombstone
    assert (full_sizes(cache, allocator), swa_sizes(cache, allocator)) == before
    assert b.full_lock_ref == 0 and b.swa_lock_ref == 0
    cache.evict(EvictParams(num_tokens=12))
    with pytest.raises(ValueError, match="not cached here"):
        cache.inc_lock_ref(handle)  # evicted
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0


# -- re-insert over tombstones ------------------------------------------------------------------


def test_insert_revives_an_unlocked_tombstone_with_the_new_slots():
    cache, allocator = make_swa()
    old = put(cache, allocator, A)
    cache.evict(EvictParams(swa_num_tokens=8))
    assert cache.match_prefix(A).prefix_len == 0
    new = allocator.alloc(8)
    assert cache.insert(A, new) == 8
    assert full_sizes(cache, allocator) == (56, 8, 0)  # the old full slots went back
    assert swa_sizes(cache, allocator) == (24, 8, 0)
    m = cache.match_prefix(A)
    assert m.prefix_len == 8 and m.device_indices.tolist() == new.tolist()
    assert not set(old.tolist()) & cached_slots(cache)


def test_a_locked_tombstone_is_revived_from_the_fresh_window_kv():
    # issue 7 §5, SGLang's recovery with a locked full side: the node keeps the full slots the
    # lock holder reads and takes the inserting request's window slots; the fresh full slots
    # are freed. Before, the fresh window KV was freed as a duplicate and A stayed unmatchable.
    cache, allocator = make_swa(window=4)
    handle = _chain(cache, allocator)
    cache.inc_lock_ref(handle)
    cache.evict(EvictParams(swa_num_tokens=8))  # A tombstoned under the lock
    old_full = handle.parent.parent.value.clone()  # A's full slots, read by the lock holder
    fresh = allocator.alloc(8)
    fresh_window = allocator.translate_loc_from_full_to_swa(fresh).clone()
    assert cache.insert(A, fresh) == 8
    assert full_sizes(cache, allocator) == (52, 0, 12)  # the fresh full slots went back
    assert swa_sizes(cache, allocator) == (20, 8, 4)  # the fresh window slots are cached
    m = cache.match_prefix(A)
    assert m.prefix_len == 8 and m.device_indices.tolist() == old_full.tolist()
    assert allocator.translate_loc_from_full_to_swa(old_full).tolist() == fresh_window.tolist()
    assert allocator.translate_loc_from_full_to_swa(fresh).tolist() == [0] * 8
    cache.dec_lock_ref(handle)
    cache.evict(EvictParams(num_tokens=64, swa_num_tokens=32))
    assert full_sizes(cache, allocator) == (64, 0, 0) and swa_sizes(cache, allocator) == (32, 0, 0)


def test_insert_with_swa_evicted_seqlen_stores_a_tombstone_head():
    cache, allocator = make_swa(window=4)
    slots = allocator.alloc(12)
    allocator.free_swa(slots[:8])  # the request's first 8 tokens slid out of its window
    assert cache.insert(list(range(12)), slots, swa_evicted_seqlen=8) == 0
    assert full_sizes(cache, allocator) == (52, 12, 0)
    assert swa_sizes(cache, allocator) == (28, 4, 0)
    assert cache.match_prefix(list(range(12))).prefix_len == 12
    assert cache.match_prefix(list(range(11))).prefix_len == 0
    # nothing window-live at all: nothing worth caching, the slots are freed
    slots = allocator.alloc(4)
    allocator.free_swa(slots)
    assert cache.insert([7, 7, 7, 7], slots, swa_evicted_seqlen=4) == 0
    assert full_sizes(cache, allocator) == (52, 12, 0) and swa_sizes(cache, allocator) == (28, 4, 0)
    with pytest.raises(ValueError, match="swa_evicted_seqlen=5"):
        cache.insert([1] * 4, allocator.alloc(4), swa_evicted_seqlen=5)


# -- events, counters, reset, construction, bad input -------------------------------------------


def test_events_report_full_and_window_removal():
    events = RecordingEvents()
    cache, allocator = make_swa(events=events)
    put(cache, allocator, A)
    assert [(e.cache, e.num_tokens) for e in events.stored] == [("swa_radix", 8)]
    cache.evict(EvictParams(num_tokens=2, swa_num_tokens=5))
    removed = [(e.num_tokens, e.reason) for e in events.removed]
    assert removed == [(2, "evicted"), (3, "swa_evicted")]
    cache.reset()
    assert events.cleared[-1].num_tokens == 6


def test_reset_frees_both_pools_and_is_refused_while_locked():
    cache, allocator = make_swa()
    handle = _chain(cache, allocator)
    cache.evict(EvictParams(swa_num_tokens=8))
    cache.inc_lock_ref(handle)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.dec_lock_ref(handle)
    cache.reset()
    assert full_sizes(cache, allocator) == (64, 0, 0) and swa_sizes(cache, allocator) == (32, 0, 0)
    assert cache.match_prefix(A).prefix_len == 0 and cache.total_size() == 0


def test_stats_count_queries_hits_inserts_and_evictions():
    cache, allocator = make_swa()
    put(cache, allocator, A)
    cache.match_prefix(A + B)
    cache.evict(EvictParams(swa_num_tokens=8))
    cache.match_prefix(A)
    s = cache.stats
    assert (s.match_queries, s.match_query_tokens, s.hit_tokens) == (2, 24, 8)
    assert (s.inserted_tokens, s.evicted_tokens, s.swa_evicted_tokens, s.evictions) == (8, 0, 8, 1)


def test_bad_input_is_rejected_without_state_change():
    cache, allocator = make_swa()
    put(cache, allocator, A)
    slots = allocator.alloc(8)

    def state():
        inserted = cache.stats.inserted_tokens
        return full_sizes(cache, allocator), swa_sizes(cache, allocator), inserted

    before = state()
    with pytest.raises(ValueError, match="7 slots but the key has 8"):
        cache.insert(B, slots[:7])
    with pytest.raises(TypeError, match="integer tensor"):
        cache.insert(B, slots.double())
    with pytest.raises(TypeError, match="swa_evicted_seqlen"):
        cache.insert(B, slots, swa_evicted_seqlen=None)
    with pytest.raises(ValueError, match="swa_evicted_seqlen=9"):
        cache.insert(B, slots, swa_evicted_seqlen=9)
    with pytest.raises(TypeError, match="EvictParams"):
        cache.evict({"num_tokens": 1})
    with pytest.raises(ValidationError, match="swa_num_tokens"):
        EvictParams(swa_num_tokens=-1)
    assert state() == before
    assert cache.insert(B, slots) == 0


def test_construction_checks_and_factory():
    with pytest.raises(TypeError, match="needs a sliding-window allocator"):
        SWARadixCache(make_allocator(32))
    allocator = SWAAllocator(32, 16, 8, device="cpu")
    with pytest.raises(ValidationError, match="sliding_window_size"):
        SWARadixOptions(sliding_window_size=0)
    with pytest.raises(TypeError, match="SWARadixOptions"):
        SWARadixCache(allocator, options={"sliding_window_size": 4})
    with pytest.raises(ValueError, match="fresh policy"):
        shared = LRUPolicy()
        SWARadixCache(allocator, lambda: shared)
    assert SWARadixCache(allocator).sliding_window_size == 8  # taken from the allocator
    ctx = PrefixCacheContext(allocator=allocator, new_policy=LRUPolicy)
    cache = SWARadixCache.from_context(ctx, SWARadixOptions(sliding_window_size=2))
    assert cache.sliding_window_size == 2 and cache.page_size == 1
    put(cache, allocator, A)
    cache.evict(EvictParams(swa_num_tokens=6))
    assert cache.match_prefix(A).prefix_len == 8  # 2 live tokens are a whole window of 2


def test_nodes_carry_candidate_features():
    cache, allocator = make_swa()
    put(cache, allocator, A + B, extra_key="ns")
    m = cache.match_prefix(CacheKey(A + [99], "ns"))  # splits the node after A
    head = m.last_node
    tail = next(iter(head.children.values()))
    assert (head.depth, head.num_tokens, tail.depth, tail.num_tokens) == (0, 8, 8, 8)
    assert head.namespace == tail.namespace == "ns"
    assert head.new_tokens == tail.new_tokens == 16  # both come from the request that added 16
    assert head.content_id != tail.content_id and head.content_id and tail.content_id
    assert not head.partial_page and not tail.partial_page and tail.turn == -1
    put(cache, allocator, A + C, extra_key="ns")
    branch = cache.match_prefix(CacheKey(A + C, "ns")).last_node
    assert (branch.depth, branch.num_tokens, branch.new_tokens) == (8, 2, 2)
    # identity is where the content starts: the same start cached again gets the same id
    assert tail.content_id == start_content_id("ns", 8, tuple(B))
    cache.evict(EvictParams(num_tokens=18))
    assert cache.total_size() == 0
    put(cache, allocator, A + B, extra_key="ns")
    again = cache.match_prefix(CacheKey(A + B, "ns")).last_node
    assert (again.depth, again.content_id) == (0, start_content_id("ns", 0, tuple(A + B)))
