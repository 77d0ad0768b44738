"""The radix cache's fast paths give the same results as the plain ones (issue 10).

``insert(prev=match)`` continues from the match instead of walking from the root; a stale or
foreign ``prev`` falls back to the walk. Handles are validated in O(1) by an owner stamp. Nodes
carry the candidate features (depth, namespace, content_id, new_tokens) and a path hash.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvplug.caches.radix import RadixCache
from kvplug.policies import LRUPolicy
from kvplug_hookspecs import CacheKey, EvictParams, MatchResult
from tests.cache_helpers import make_allocator, make_radix


def _tree(cache: RadixCache) -> list[tuple]:
    """The tree as comparable data: (depth, key, slots, lock_ref, hits) per node.

    Access times of inner nodes may differ by one tick (the match's instead of the insert's):
    only leaves are ranked, and equal hits under eviction pressure show the same order."""
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        out.append(
            (
                node.depth,
                node.key,
                node.value.tolist(),
                node.lock_ref,
                node.hit_count,
            )
        )
        stack.extend(node.children.values())
    return sorted(out)


def _serve(cache: RadixCache, allocator, key: list[int], *, use_prev: bool) -> int:
    page = cache.page_size
    m = cache.match_prefix(key)
    cache.inc_lock_ref(m.last_node)
    need = -(-len(key) // page) * page - m.prefix_len
    if allocator.available_size() < need:
        cache.evict(allocator.shortfall(need))
    slots = torch.cat([m.device_indices, allocator.alloc(need)])
    cache.insert(key, slots[: len(key)], prev=m if use_prev else None)
    aligned = len(key) - len(key) % page
    if aligned < len(key):
        allocator.free(slots[aligned:])
    cache.dec_lock_ref(m.last_node)
    return m.prefix_len


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_insert_continuing_from_the_match_equals_a_full_walk(page_size, policy):
    rng = random.Random(page_size)
    systems = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    keys = [
        rng.choice(systems)[: rng.randint(4, 40)] + [rng.randrange(50) for _ in range(9)]
        for _ in range(150)
    ]
    trees, hits = [], []
    for use_prev in (False, True):
        cache, allocator = make_radix(capacity=256, page_size=page_size, policy=policy)
        hits.append([_serve(cache, allocator, k, use_prev=use_prev) for k in keys])
        trees.append(_tree(cache))
        assert allocator.available_size() + cache.total_size() == 256
    assert hits[0] == hits[1]
    assert trees[0] == trees[1]


def test_stale_or_foreign_prev_falls_back_to_the_walk():
    cache, allocator = make_radix(capacity=64)
    a = allocator.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], a)
    m = cache.match_prefix([1, 2, 3, 9])
    # a key that differs from the match's path: the leaf must not be grafted under [1, 2, 3]
    new = allocator.alloc(4)
    assert cache.insert([7, 2, 3, 8], new, prev=m) == 0
    assert cache.match_prefix([7, 2, 3, 8]).device_indices.tolist() == new.tolist()
    assert cache.match_prefix([1, 2, 3, 8]).prefix_len == 3
    # the matched node was evicted meanwhile: the insert walks from the root
    other, other_allocator = make_radix(capacity=64)
    cache.evict(_all(cache))
    assert cache.total_size() == 0
    b = allocator.alloc(4)
    assert cache.insert([1, 2, 3, 9], b, prev=m) == 0
    assert cache.match_prefix([1, 2, 3, 9]).device_indices.tolist() == b.tolist()
    # a match of another cache is only a hint too
    assert other.insert([1, 2, 3, 9], other_allocator.alloc(4), prev=m) == 0
    with pytest.raises(TypeError, match="MatchResult"):
        cache.insert([1], allocator.alloc(1), prev=(m.last_node, 3))  # type: ignore[arg-type]
    bad = MatchResult(device_indices=torch.empty(0, dtype=torch.int64), last_node=5, prefix_len=0)
    with pytest.raises(TypeError, match="RadixNode"):
        cache.insert([1], allocator.alloc(1), prev=bad)


def test_prev_of_the_same_tuple_skips_the_hash_only_in_its_namespace():
    cache, allocator = make_radix(capacity=64)
    ids = (1, 2, 3, 4)
    cache.insert(CacheKey(ids, "a"), allocator.alloc(4))
    longer = ids + (5, 6)
    m = cache.match_prefix(CacheKey(longer, "a"))
    assert m.prefix_len == 4
    # the same tuple object and node, another namespace: the node is not this key's prefix
    b = allocator.alloc(6)
    assert cache.insert(CacheKey(longer, "b"), b, prev=m) == 0
    assert cache.match_prefix(CacheKey(longer, "b")).device_indices.tolist() == b.tolist()
    # the very key of the match: continues from its node (4 cached, 2 new)
    key = ids + (7, 8)
    m = cache.match_prefix(CacheKey(key, "a"))
    slots = torch.cat((m.device_indices, allocator.alloc(2)))
    assert cache.insert(CacheKey(key, "a"), slots, prev=m) == 4
    assert cache.match_prefix(CacheKey(key, "a")).device_indices.tolist() == slots.tolist()


def _all(cache: RadixCache) -> EvictParams:
    return EvictParams(num_tokens=cache.evictable_size())


def test_prev_with_wrong_indices_still_frees_only_true_duplicates():
    cache, allocator = make_radix(capacity=64)
    a = allocator.alloc(4)
    cache.insert([1, 2, 3, 4], a)
    m = cache.match_prefix([1, 2, 3, 4, 5])
    forged = MatchResult(device_indices=a.flip(0), last_node=m.last_node, prefix_len=4)
    dup = allocator.alloc(5)
    before = allocator.available_size()
    assert cache.insert([1, 2, 3, 4, 5], dup, prev=forged) == 4
    assert allocator.available_size() == before + 4  # the 4 passed prefix slots were duplicates
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == a.tolist()


def test_prev_counts_hits_and_priority_as_the_walk_does():
    cache, allocator = make_radix(capacity=64, policy="priority")
    cache.insert([1, 2, 3, 4], allocator.alloc(4))
    cache.insert([1, 2, 5, 6], allocator.alloc(4))
    m = cache.match_prefix([1, 2, 3, 4, 7], record_hit=False)
    head = m.last_node.parent
    slots = torch.cat([m.device_indices, allocator.alloc(1)])
    cache.insert([1, 2, 3, 4, 7], slots, priority=5, hits_after=2, prev=m)
    assert (head.priority, m.last_node.priority) == (5, 5)
    assert (head.hit_count, m.last_node.hit_count) == (0, 1)  # head ends at 2: not past it


def test_handles_are_checked_without_walking():
    cache, allocator = make_radix(capacity=64)
    cache.insert([1, 2, 3], allocator.alloc(3))
    m = cache.match_prefix([1, 2, 3])
    cache.evict(_all(cache))
    with pytest.raises(ValueError, match="not cached here"):
        cache.inc_lock_ref(m.last_node)
    cache.insert([1, 2, 3], allocator.alloc(3))
    m = cache.match_prefix([1, 2, 3])
    cache.reset()
    with pytest.raises(ValueError, match="not cached here"):
        cache.inc_lock_ref(m.last_node)
    other, other_alloc = make_radix(capacity=64)
    other.insert([1, 2, 3], other_alloc.alloc(3))
    with pytest.raises(ValueError, match="not cached here"):
        cache.dec_lock_ref(other.match_prefix([1, 2, 3]).last_node)


def test_nodes_carry_candidate_features():
    cache, allocator = make_radix(capacity=64, page_size=2)
    cache.insert(CacheKey([1, 2, 3, 4, 5, 6], "ns"), allocator.alloc(6))
    m = cache.match_prefix(CacheKey([1, 2, 3, 4, 9, 9], "ns"))
    tail = next(iter(m.last_node.children.values()))
    head = m.last_node
    assert (head.depth, head.num_tokens, tail.depth, tail.num_tokens) == (0, 4, 4, 2)
    assert head.namespace == tail.namespace == "ns"
    assert head.new_tokens == tail.new_tokens == 6  # both come from the request that added 6
    assert head.path_hash == hash(("ns", (1, 2, 3, 4)))
    assert tail.path_hash == 0  # a new leaf: hashed when a walk first ends at it
    cache.match_prefix(CacheKey([1, 2, 3, 4, 5, 6], "ns"), record_hit=False)
    assert tail.path_hash == hash(("ns", (1, 2, 3, 4, 5, 6)))
    assert head.content_id != tail.content_id and head.content_id and tail.content_id
    assert not head.partial_page and not tail.partial_page
    # an exact eviction cuts the tail: its path hash is unknown (0) until a walk ends at it
    cache.evict(allocator.shortfall(allocator.available_size() + 2))
    cache.insert(CacheKey([1, 2, 3, 4, 5, 6, 7, 8], "ns"), allocator.alloc(8))
    assert cache.match_prefix(CacheKey([1, 2, 3, 4, 5, 6], "ns")).prefix_len == 6


class _RecordingLRU(LRUPolicy):
    """A policy that wants every touch (as learning and third-party policies may)."""

    touch_candidates_only = False

    def __init__(self, options=None):
        super().__init__(options)
        self.touched: list[int] = []

    def touch(self, candidate):
        self.touched.append(candidate.num_tokens)
        super().touch(candidate)


def test_policies_that_want_every_touch_get_every_node_of_the_path():
    allocator = make_allocator(64)
    cache = RadixCache(allocator, _RecordingLRU)
    cache.insert([1, 2, 3, 4], allocator.alloc(4))
    m = cache.match_prefix([1, 2, 5])  # splits [1, 2 | 3, 4]
    slots = torch.cat([m.device_indices, allocator.alloc(1)])
    cache.insert([1, 2, 5], slots, prev=m)  # walks again: the policy sees the whole path
    cache.policy.touched.clear()
    cache.match_prefix([1, 2, 3, 4])
    assert cache.policy.touched == [2, 2]  # the inner head and the leaf
    builtin, _ = make_radix(capacity=64)
    assert builtin._touch_all is False and cache._touch_all is True


def test_key_validation_memo_and_int64_arrays() -> None:
    """The one-entry memo skips re-scanning the same tuple (match, then insert) and never lets
    a bad key through; int64 arrays are taken without a scan, unsigned 64-bit ones are checked."""
    from array import array

    from kvplug.caches import common

    key = (5, 6, 7)
    assert common.as_token_ids(key) is key
    assert common._last_checked[0] is key
    assert common.as_token_ids(key) is key  # the memo: same object back
    bad = (5, "x", 7)
    for _ in range(2):  # rejected every time: a failing key is never remembered
        with pytest.raises(TypeError, match="position 1"):
            common.as_token_ids(bad)
    assert common._last_checked[0] is key
    ids = [1, 2000, 3000]
    checked = common.as_token_ids(ids)
    assert checked == (1, 2000, 3000)
    assert common._last_checked[0] is checked  # its own immutable copy, never the list
    ids[1] = "x"  # the list changed: checked again, and the memo's ints do not hide it
    with pytest.raises(TypeError, match="position 1"):
        common.as_token_ids(ids)
    # a new tuple that starts with the memo's very ints is checked from where it differs
    longer = (*checked, 2**63)
    with pytest.raises(ValueError, match="fit in int64: position 3"):
        common.as_token_ids(longer)
    assert common.as_token_ids((*checked, 4000)) == (1, 2000, 3000, 4000)
    assert common.as_token_ids(key) is key
    assert common.as_token_ids(array("q", [3, -4])) == (3, -4)
    assert common.as_token_ids(array("I", [3, 4])) == (3, 4)
    with pytest.raises(ValueError, match="fit in int64: position 1"):
        common.as_token_ids(array("Q", [1, 2**63]))
