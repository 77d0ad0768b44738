"""Hypothesis state machine: BlockHashCache x every built-in policy, on real allocators.

Requests start (match, lock, evict the shortfall, allocate), finish (insert, free the unaligned
tail, unlock) or abort; the cache is also asked to evict directly and probed with matches. After
every step: conservation (free + evictable + protected + held by requests == capacity), cached
slots distinct and disjoint from the requests' own, locked prefixes still cached, every matched
slot holds the KV of exactly that prefix, and eviction within [shortfall, shortfall rounded up].
Double frees raise inside the allocator (``debug_checks=True``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvplug.caches.block_hash import BlockHashCache
from kvplug.eviction import evict_from_tree_cache
from kvplug_hookspecs import CacheKey, EvictParams
from tests.cache_helpers import POLICY_NAMES, make_allocator, new_policy_factory

CAPACITY = 64
BASES = [[100 + 10 * b + i % 7 for i in range(24)] for b in range(3)]  # shared "system prompts"

keys = st.builds(
    lambda base, cut, suffix, ns: CacheKey(BASES[base][:cut] + suffix, ns),
    st.integers(0, 2),
    st.integers(0, 24),
    st.lists(st.integers(0, 3), max_size=8),
    st.sampled_from([None, None, "ns"]),
)


def round_up(n: int, page: int) -> int:
    return -(-n // page) * page


class BlockHashMachine(RuleBasedStateMachine):
    policy_name = "lru"

    @initialize(page=st.sampled_from([1, 4]))
    def setup(self, page):
        self.page = page
        self.allocator = make_allocator(CAPACITY, page)
        policy = new_policy_factory(self.policy_name)
        self.cache = BlockHashCache(self.allocator, policy, page_size=page)
        self.requests: list[dict] = []
        self.content: dict[int, tuple] = {}  # slot -> (namespace, token prefix it holds the KV of)

    # -- helpers --------------------------------------------------------------------------------

    def _check_match(self, key: CacheKey, m) -> None:
        ids = list(key.token_ids)
        assert m.prefix_len % self.page == 0 and m.prefix_len <= len(ids)
        assert len(m.device_indices) == m.prefix_len
        for i, slot in enumerate(m.device_indices.tolist()):
            expected = (key.extra_key, tuple(ids[: i + 1]))
            assert self.content[slot] == expected, "a match returned foreign KV"

    def _check_eviction(self, asked: int, evictable_before: int, freed: int) -> None:
        assert freed <= round_up(asked, self.page)
        assert freed >= min(asked, evictable_before)
        if evictable_before < asked:
            assert freed == evictable_before

    # -- rules ----------------------------------------------------------------------------------

    @rule(key=keys, priority=st.integers(0, 3), recompute=st.booleans())
    def start_request(self, key, priority, recompute):
        """``recompute``: skip the cache (fresh slots for every token): insert meets duplicates."""
        m = self.cache.match_prefix(CacheKey([], key.extra_key) if recompute else key)
        self._check_match(key, m)
        self.cache.inc_lock_ref(m.last_node)
        need = round_up(len(key.token_ids) - m.prefix_len, self.page)
        params = self.allocator.shortfall(need)
        before = (self.cache.evictable_size(), self.allocator.available_size())
        result = evict_from_tree_cache(self.cache, need)
        if params is None:
            assert result.num_tokens == 0
        else:
            self._check_eviction(params.num_tokens, before[0], result.num_tokens)
        assert self.allocator.available_size() == before[1] + result.num_tokens
        own = self.allocator.alloc(need) if need else torch.empty(0, dtype=torch.int64)
        if own is None:  # too much is locked: the engine would retract; here the request gives up
            self.cache.dec_lock_ref(m.last_node)
            return
        ids = list(key.token_ids)
        for i, slot in enumerate(own.tolist()[: len(ids) - m.prefix_len]):
            self.content[slot] = (key.extra_key, tuple(ids[: m.prefix_len + i + 1]))
        self.requests.append(
            {
                "key": key,
                "handle": m.last_node,
                "matched": m.device_indices,
                "own": own,
                "priority": priority,
            }
        )

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        length = len(req["key"].token_ids)
        prefix_len = len(req["matched"])
        indices = torch.cat([req["matched"], req["own"]])[:length]
        cached = self.cache.insert(req["key"], indices, priority=req["priority"])
        assert cached >= prefix_len  # the locked prefix cannot have gone
        aligned = length // self.page * self.page
        tail = req["own"][aligned - prefix_len :]
        if tail.numel():
            self.allocator.free(tail)
        self.cache.dec_lock_ref(req["handle"])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_request(self, data):
        req = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        if req["own"].numel():
            self.allocator.free(req["own"])
        self.cache.dec_lock_ref(req["handle"])

    @rule(n=st.integers(0, 40))
    def evict(self, n):
        before = (self.cache.evictable_size(), self.allocator.available_size())
        result = self.cache.evict(EvictParams(num_tokens=n))
        self._check_eviction(n, before[0], result.num_tokens)
        assert self.allocator.available_size() == before[1] + result.num_tokens

    @rule(key=keys)
    def probe(self, key):
        self._check_match(key, self.cache.match_prefix(key))

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def conservation_and_ownership(self):
        cache, allocator = self.cache, self.allocator
        held = sum(r["own"].numel() for r in self.requests)
        cached_sizes = cache.evictable_size() + cache.protected_size()
        assert allocator.available_size() + cached_sizes + held == CAPACITY
        cached = cache.all_values_flatten().tolist()
        assert len(cached) == len(set(cached)) == cache.total_size()
        assert cache.total_size() == cache.num_blocks() * self.page
        own = [s for r in self.requests for s in r["own"].tolist()]
        assert not set(cached) & set(own)
        locked = set()
        for r in self.requests:
            locked.update(r["matched"].tolist())
        assert locked <= set(cached), "a locked block was evicted"
        assert cache.protected_size() == len(locked)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_block_hash_state_machine(policy):
    machine = type(f"BlockHash_{policy}", (BlockHashMachine,), {"policy_name": policy})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=25,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
