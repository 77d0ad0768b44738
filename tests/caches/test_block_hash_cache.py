"""BlockHashCache scenarios with exact numbers, through the public API and real allocators."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kvplug.caches.block_hash import Block, BlockHashCache, BlockHashOptions
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


def make_cache(capacity=64, page_size=4, policy="lru", events=None, options=None, **policy_options):
    allocator = make_allocator(capacity, page_size)
    cache = BlockHashCache(
        allocator,
        new_policy_factory(policy, **policy_options),
        page_size=page_size,
        events=events,
        options=options,
    )
    return cache, allocator


def sizes(cache, allocator):
    return allocator.available_size(), cache.evictable_size(), cache.protected_size()


# -- insert / match -----------------------------------------------------------------------------


def test_insert_and_match_with_page_4():
    cache, allocator = make_cache(capacity=64, page_size=4)
    assert isinstance(cache, PrefixCache) and cache.is_chunk_cache is False
    key = list(range(100, 110))  # 10 tokens: 2 full blocks cached, 2 tokens stay the caller's
    slots = allocator.alloc(12)
    assert cache.insert(key, slots[:10]) == 0
    allocator.free(slots[8:])
    assert (cache.num_blocks(), cache.total_size()) == (2, 8)
    assert sizes(cache, allocator) == (56, 8, 0)

    assert cache.match_prefix(key[:3]).prefix_len == 0  # no full block
    assert cache.match_prefix(key[:7]).prefix_len == 4
    m = cache.match_prefix(key)
    assert m.prefix_len == 8 and m.device_indices.dtype == torch.int64
    assert m.device_indices.tolist() == slots[:8].tolist()
    assert isinstance(m.last_node, Block) and m.last_node.num_tokens == 4
    assert cache.match_prefix([*key[:5], 0, 0, 0]).prefix_len == 4  # mismatch in block 2
    assert cache.match_prefix([0, *key[1:]]).prefix_len == 0  # mismatch in block 1
    empty = cache.match_prefix([])
    assert (empty.prefix_len, empty.last_node, empty.device_indices.numel()) == (0, cache.root, 0)


def test_extending_a_cached_prefix_adds_only_the_new_blocks():
    cache, allocator = make_cache(capacity=64, page_size=4)
    first = put(cache, allocator, list(range(8)))
    m = cache.match_prefix(list(range(16)))
    assert m.prefix_len == 8
    new = allocator.alloc(8)
    assert cache.insert(list(range(16)), torch.cat([m.device_indices, new])) == 8
    assert (cache.num_blocks(), cache.total_size()) == (4, 16)
    assert allocator.available_size() == 48  # identical slots kept, nothing freed or leaked
    both = [*first.tolist(), *new.tolist()]
    assert cache.match_prefix(list(range(16))).device_indices.tolist() == both


def test_insert_frees_the_callers_duplicate_slots():
    cache, allocator = make_cache(capacity=64, page_size=4)
    first = put(cache, allocator, list(range(12)))
    again = allocator.alloc(12)  # the same tokens computed again on fresh slots
    assert allocator.available_size() == 40
    assert cache.insert(list(range(12)), again) == 12
    assert allocator.available_size() == 52  # the 12 duplicates went back
    assert cached_slots(cache) == set(first.tolist())
    # a partly shared key: the 8 shared tokens' fresh slots are freed, the 4 new ones kept
    mixed = allocator.alloc(12)
    assert cache.insert([*range(8), 50, 51, 52, 53], mixed) == 8
    assert allocator.available_size() == 48 and cache.total_size() == 16
    assert cached_slots(cache) == set(first.tolist()) | set(mixed[8:].tolist())


def test_hash_chaining_same_tokens_after_another_parent_do_not_match():
    cache, allocator = make_cache(capacity=64, page_size=4)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    put(cache, allocator, a + b)
    assert cache.match_prefix(a + b).prefix_len == 8
    assert cache.match_prefix(c + b).prefix_len == 0  # block b exists, but after another parent
    assert cache.match_prefix(b).prefix_len == 0
    assert cache.insert(c + b, allocator.alloc(8)) == 0
    assert cache.num_blocks() == 4 and cache.total_size() == 16


def test_namespaces_never_share():
    cache, allocator = make_cache(capacity=64, page_size=4)
    tokens = list(range(8))
    put(cache, allocator, tokens, extra_key="lora-a")
    assert cache.match_prefix(CacheKey(tokens, "lora-a")).prefix_len == 8
    assert cache.match_prefix(CacheKey(tokens, "lora-b")).prefix_len == 0
    assert cache.match_prefix(tokens).prefix_len == 0  # namespace None
    assert cache.insert(CacheKey(tokens, "lora-b"), allocator.alloc(8)) == 0
    assert cache.insert(tokens, allocator.alloc(8)) == 0
    assert cache.num_blocks() == 6 and allocator.available_size() == 40


def test_hashes_are_deterministic_across_caches_and_chain_the_namespace():
    events_a, events_b, events_c = RecordingEvents(), RecordingEvents(), RecordingEvents()
    cache_a, alloc_a = make_cache(events=events_a)
    cache_b, alloc_b = make_cache(events=events_b)
    blake = BlockHashOptions(hash_algorithm="blake2b")
    cache_c, alloc_c = make_cache(events=events_c, options=blake)
    put(cache_a, alloc_a, list(range(8)))
    put(cache_b, alloc_b, list(range(8)))
    put(cache_b, alloc_b, list(range(8)), extra_key="salt")
    put(cache_c, alloc_c, list(range(8)))
    plain, salted = events_b.stored
    assert len(plain.block_hashes) == 2 and plain.num_tokens == 8
    assert events_a.stored[0].block_hashes == plain.block_hashes
    assert set(salted.block_hashes).isdisjoint(plain.block_hashes) and salted.extra_key == "salt"
    assert set(events_c.stored[0].block_hashes).isdisjoint(plain.block_hashes)


# -- reference counts ---------------------------------------------------------------------------


def test_references_protect_blocks_and_move_tokens_between_sizes():
    cache, allocator = make_cache(capacity=32, page_size=4)
    put(cache, allocator, list(range(12)))
    m = cache.match_prefix(list(range(8)))
    assert sizes(cache, allocator) == (20, 12, 0)
    assert cache.inc_lock_ref(m.last_node) == -8
    assert sizes(cache, allocator) == (20, 4, 8)
    assert cache.inc_lock_ref(m.last_node) == 0  # a second request on the same prefix
    # only the unreferenced tail block can go
    assert cache.evict(EvictParams(num_tokens=32)) == EvictResult(num_tokens=4)
    assert sizes(cache, allocator) == (24, 0, 8)
    assert cache.dec_lock_ref(m.last_node) == 0
    assert cache.dec_lock_ref(m.last_node) == 8
    assert sizes(cache, allocator) == (24, 8, 0)
    assert cache.evict(EvictParams(num_tokens=32)) == EvictResult(num_tokens=8)
    assert sizes(cache, allocator) == (32, 0, 0) and cache.num_blocks() == 0


def test_bad_lock_calls_are_rejected_without_state_change():
    cache, allocator = make_cache(capacity=32, page_size=4)
    put(cache, allocator, list(range(8)))
    handle = cache.match_prefix(list(range(8))).last_node
    with pytest.raises(ValueError, match="holds no reference"):
        cache.dec_lock_ref(handle)
    assert sizes(cache, allocator) == (24, 8, 0)
    with pytest.raises(TypeError, match="last_node"):
        cache.inc_lock_ref("not a block")
    cache.evict(EvictParams(num_tokens=8))
    with pytest.raises(ValueError, match="not cached"):
        cache.inc_lock_ref(handle)  # evicted: a stale handle
    other, other_alloc = make_cache(capacity=32, page_size=4)
    put(other, other_alloc, list(range(8)))
    with pytest.raises(ValueError, match="not cached"):
        cache.inc_lock_ref(other.match_prefix(list(range(8))).last_node)
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0


def test_only_childless_blocks_are_evicted_and_parents_follow():
    # MRU would evict the just-matched root-side block first if it were a candidate.
    cache, allocator = make_cache(capacity=64, page_size=4, policy="mru")
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    slots = put(cache, allocator, a + b + c)
    cache.match_prefix(a)
    assert cache.evict(EvictParams(num_tokens=4)) == EvictResult(num_tokens=4)
    assert cached_slots(cache) == set(slots[:8].tolist())  # the tail block c went, not a
    assert cache.evict(EvictParams(num_tokens=1)) == EvictResult(num_tokens=4)  # a whole block
    assert cached_slots(cache) == set(slots[:4].tolist())
    assert cache.match_prefix(a + b + c).prefix_len == 4


def test_a_parent_becomes_evictable_when_its_last_child_goes():
    cache, allocator = make_cache(capacity=64, page_size=4, policy="fifo")
    trunk, left, right = [1] * 4, [2] * 4, [3] * 4
    slots_left = put(cache, allocator, trunk + left)
    slots_right = allocator.alloc(8)
    assert cache.insert(trunk + right, slots_right) == 4
    # FIFO: the trunk is the oldest block, yet both leaves go before it
    assert cache.evict(EvictParams(num_tokens=4)) == EvictResult(num_tokens=4)
    assert cached_slots(cache) == set(slots_left[:4].tolist()) | set(slots_right[4:].tolist())
    assert cache.evict(EvictParams(num_tokens=4)) == EvictResult(num_tokens=4)
    assert cached_slots(cache) == set(slots_left[:4].tolist())
    assert cache.evict(EvictParams(num_tokens=4)) == EvictResult(num_tokens=4)
    assert cache.total_size() == 0 and allocator.available_size() == 64


def test_a_referenced_child_keeps_its_unreferenced_parent():
    cache, allocator = make_cache(capacity=32, page_size=4)
    put(cache, allocator, list(range(8)))
    handle = cache.match_prefix(list(range(8))).last_node
    cache.inc_lock_ref(handle)
    assert cache.evict(EvictParams(num_tokens=8)) == EvictResult()
    assert sizes(cache, allocator) == (24, 0, 8)


# -- policies rank blocks -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("lru", [3, 2, 0, 1]),
        ("mru", [1, 0, 2, 3]),
        ("fifo", [0, 1, 2, 3]),
        ("filo", [3, 2, 1, 0]),
        ("lfu", [3, 0, 1, 2]),
        ("priority", [3, 1, 0, 2]),
        ("slru", [3, 0, 1, 2]),
    ],
)
def test_policies_order_blocks(policy, expected):
    cache, allocator = make_cache(capacity=64, page_size=4, policy=policy)
    keys = [[k] * 4 for k in range(10, 14)]
    owners = {}
    for i, (key, priority) in enumerate(zip(keys, [5, 1, 9, 0])):
        for slot in put(cache, allocator, key, priority=priority).tolist():
            owners[slot] = i
    # last access: key 3 at insert, then 2, 0, 1; hits: 0, 1, 1, 2 for keys 3, 0, 1, 2
    for i in (2, 2, 0, 1):
        assert cache.match_prefix(keys[i]).prefix_len == 4
    order = []
    for _ in keys:
        before = cached_slots(cache)
        assert cache.evict(EvictParams(num_tokens=4)) == EvictResult(num_tokens=4)
        (gone,) = {owners[s] for s in before - cached_slots(cache)}
        order.append(gone)
    assert order == expected


# -- exact shortfall eviction -------------------------------------------------------------------


def _filled(capacity, free, prompt, page_size):
    """A cache whose allocator has ``free`` slots left, the rest cached in ``prompt``-token keys."""
    cache, allocator = make_cache(capacity=capacity, page_size=page_size)
    first = 0
    while allocator.available_size() > free:
        n = min(prompt, allocator.available_size() - free)
        put(cache, allocator, [first] * n)
        first += 1
    assert allocator.available_size() == free and cache.evictable_size() == capacity - free
    return cache, allocator


def test_shortfall_regression_20_needed_5_free_evicts_15():
    cache, allocator = _filled(capacity=40, free=5, prompt=5, page_size=1)
    assert evict_from_tree_cache(cache, 20) == EvictResult(num_tokens=15)
    assert sizes(cache, allocator) == (20, 20, 0)
    assert (cache.stats.shortfall_requested_tokens, cache.stats.shortfall_freed_tokens) == (15, 15)
    assert allocator.alloc(20) is not None


def test_shortfall_regression_30_free_evicts_nothing():
    cache, allocator = _filled(capacity=40, free=30, prompt=5, page_size=1)
    assert evict_from_tree_cache(cache, 20) == EvictResult()
    assert sizes(cache, allocator) == (30, 10, 0)
    assert cache.stats.evictions == 0


def test_paged_shortfall_rounds_up_to_one_block():
    cache, allocator = _filled(capacity=40, free=4, prompt=12, page_size=4)
    # 21 needed, 4 free: shortfall 17 -> the allocator asks for 20 (whole pages) -> 5 blocks
    assert evict_from_tree_cache(cache, 21) == EvictResult(num_tokens=20)
    assert sizes(cache, allocator) == (24, 16, 0)
    # a cache asked directly frees at most the request rounded up to a block
    assert cache.evict(EvictParams(num_tokens=5)) == EvictResult(num_tokens=8)


def test_too_little_evictable_frees_what_it_can():
    cache, allocator = make_cache(capacity=32, page_size=4)
    put(cache, allocator, [1] * 8)
    put(cache, allocator, [2] * 8)
    cache.inc_lock_ref(cache.match_prefix([1] * 8).last_node)
    assert evict_from_tree_cache(cache, 32) == EvictResult(num_tokens=8)
    assert sizes(cache, allocator) == (24, 0, 8)
    no_window_pool = EvictParams(num_tokens=4, swa_num_tokens=4)
    assert cache.evict(no_window_pool) == EvictResult()


# -- events, counters, reset, construction, bad input -------------------------------------------


def test_events_carry_block_hashes_and_token_counts():
    events = RecordingEvents()
    cache, allocator = make_cache(capacity=32, page_size=4, events=events)
    put(cache, allocator, list(range(8)))
    stored = events.stored[0]
    assert (stored.cache, stored.num_tokens, len(stored.block_hashes)) == ("block_hash", 8, 2)
    cache.evict(EvictParams(num_tokens=8))
    removed = events.removed[0]
    assert removed.num_tokens == 8 and removed.reason == "evicted"
    assert removed.block_hashes == tuple(reversed(stored.block_hashes))  # tail first
    put(cache, allocator, list(range(12)))
    cache.reset()
    assert events.cleared[-1].num_tokens == 12


def test_stats_count_queries_hits_inserts_and_evictions():
    cache, allocator = make_cache(capacity=32, page_size=4)
    put(cache, allocator, list(range(8)))
    cache.match_prefix(list(range(10)))
    cache.match_prefix([7] * 4)
    cache.evict(EvictParams(num_tokens=4))
    s = cache.stats
    assert (s.match_queries, s.match_query_tokens, s.hit_tokens) == (2, 14, 8)
    assert (s.inserted_tokens, s.evicted_tokens, s.evictions) == (8, 4, 1)
    assert s.hit_rate == pytest.approx(8 / 14)


def test_lfu_hit_counts_move_on_every_match():
    cache, allocator = make_cache(capacity=32, page_size=4, policy="lfu")
    put(cache, allocator, list(range(8)))
    for _ in range(3):
        cache.match_prefix(list(range(8)))
    handle = cache.match_prefix(list(range(4))).last_node
    assert handle.hit_count == 4
    assert cache.match_prefix(list(range(8))).last_node.hit_count == 4


def test_reset_frees_every_slot_and_is_refused_while_referenced():
    cache, allocator = make_cache(capacity=32, page_size=4)
    put(cache, allocator, list(range(12)))
    handle = cache.match_prefix(list(range(12))).last_node
    cache.inc_lock_ref(handle)
    with pytest.raises(RuntimeError, match="referenced"):
        cache.reset()
    assert sizes(cache, allocator) == (20, 0, 12)
    cache.dec_lock_ref(handle)
    cache.reset()
    assert sizes(cache, allocator) == (32, 0, 0) and cache.num_blocks() == 0
    assert cache.match_prefix(list(range(12))).prefix_len == 0


def test_bad_inserts_are_rejected_without_state_change():
    cache, allocator = make_cache(capacity=32, page_size=4)
    put(cache, allocator, list(range(4)))
    slots = allocator.alloc(8)
    before = (sizes(cache, allocator), cache.num_blocks(), cache.stats.inserted_tokens)
    with pytest.raises(ValueError, match="7 slots but the key has 8"):
        cache.insert(list(range(8)), slots[:7])
    with pytest.raises(TypeError, match="integer tensor"):
        cache.insert(list(range(8)), slots.float())
    with pytest.raises(TypeError, match="torch.Tensor"):
        cache.insert(list(range(8)), slots.tolist())
    with pytest.raises(ValueError, match="allocator's pool is on cpu"):
        cache.insert(list(range(8)), torch.empty(8, dtype=torch.int64, device="meta"))
    with pytest.raises(TypeError, match="token ids must be ints"):
        cache.insert(["a"] * 8, slots)
    with pytest.raises(TypeError, match="priority"):
        cache.insert(list(range(8)), slots, priority=1.5)
    with pytest.raises(TypeError, match="EvictParams"):
        cache.evict(4)
    assert (sizes(cache, allocator), cache.num_blocks(), cache.stats.inserted_tokens) == before
    assert cache.insert(list(range(8)), slots) == 4  # the same call, well-formed, still works


def test_construction_checks_and_factory():
    allocator = make_allocator(32, 4)
    with pytest.raises(ValueError, match="not a multiple of the allocator's page_size=4"):
        BlockHashCache(allocator, LRUPolicy, page_size=2)
    with pytest.raises(TypeError, match="BlockHashOptions"):
        BlockHashCache(allocator, LRUPolicy, options={"hash_algorithm": "md5"})
    with pytest.raises(ValidationError, match="hash_algorithm"):
        BlockHashOptions(hash_algorithm="md5")
    with pytest.raises(TypeError, match="not an EvictionPolicy"):
        BlockHashCache(allocator, lambda: object())
    ctx = PrefixCacheContext(allocator=allocator, new_policy=LRUPolicy, page_size=8)
    cache = BlockHashCache.from_context(ctx, BlockHashOptions(hash_algorithm="blake2b"))
    assert (cache.page_size, cache.options.hash_algorithm) == (8, "blake2b")
    put(cache, allocator, list(range(16)))
    assert cache.num_blocks() == 2 and cache.match_prefix(list(range(16))).prefix_len == 16


def test_blocks_carry_candidate_features():
    cache, allocator = make_cache(capacity=64, page_size=4)
    cache.insert(CacheKey(list(range(8)), "ns"), allocator.alloc(8))
    first = cache.match_prefix(CacheKey(list(range(4)), "ns")).last_node
    second = cache.match_prefix(CacheKey(list(range(8)), "ns")).last_node
    assert (first.depth, second.depth) == (0, 4)
    assert first.namespace == second.namespace == "ns"
    assert first.new_tokens == second.new_tokens == 8  # both added by one 8-token request
    assert first.content_id == first.block_hash and second.content_id == second.block_hash
    assert first.content_id != second.content_id and first.content_id and second.content_id
    assert not first.partial_page and first.turn == -1
    m = cache.match_prefix(CacheKey(list(range(12)), "ns"))
    cache.insert(CacheKey(list(range(12)), "ns"), torch.cat([m.device_indices, allocator.alloc(4)]))
    third = cache.match_prefix(CacheKey(list(range(12)), "ns")).last_node
    assert (third.depth, third.new_tokens) == (8, 4)  # the extending request added one block
