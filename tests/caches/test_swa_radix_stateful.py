"""Hypothesis state machine: SWARadixCache x every built-in policy, on the real ``swa`` allocator.

Requests start (match, lock, evict the per-pool shortfall, allocate), let old tokens slide out of
their window (``free_swa``), finish (insert with ``swa_evicted_seqlen``, unlock) or abort; the
cache is also asked to evict full and window tokens directly, and probed. After every step, for
both pools: conservation (free + evictable + protected + held by requests == capacity); cached
slots distinct and disjoint from the requests' own; locked prefixes still cached with their last
window live; the window-live cached slots are exactly ``swa_total_size()``; every match returns
the KV of exactly that prefix with a live last window; eviction within [asked, asked rounded up].
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

from kvplug.allocators.swa import SWAAllocator
from kvplug.caches.swa_radix import SWARadixCache
from kvplug.eviction import evict_from_tree_cache
from kvplug_hookspecs import CacheKey, EvictParams
from tests.cache_helpers import POLICY_NAMES, new_policy_factory

FULL, WINDOW_POOL = 64, 40
BASES = [[100 + 10 * b + i % 7 for i in range(24)] for b in range(3)]

keys = st.builds(
    lambda base, cut, suffix, ns: CacheKey(BASES[base][:cut] + suffix, ns),
    st.integers(0, 2),
    st.integers(0, 24),
    st.lists(st.integers(0, 3), max_size=8),
    st.sampled_from([None, None, "ns"]),
)


def round_up(n: int, page: int) -> int:
    return -(-n // page) * page


class SWARadixMachine(RuleBasedStateMachine):
    policy_name = "lru"

    @initialize(window=st.sampled_from([1, 4, 7]), page=st.sampled_from([1, 1, 2]))
    def setup(self, window, page):
        """Page 2 runs the allocator with paged full and window pools."""
        self.window, self.page = window, page
        self.allocator = SWAAllocator(
            FULL, WINDOW_POOL, window, page_size=page, device="cpu", debug_checks=True
        )
        policy = new_policy_factory(self.policy_name)
        self.cache = SWARadixCache(self.allocator, policy, page_size=page)
        self.requests: list[dict] = []
        self.content: dict[int, tuple] = {}  # full slot -> (namespace, prefix it holds the KV of)

    # -- helpers --------------------------------------------------------------------------------

    def _live(self, slots: torch.Tensor) -> bool:
        return bool((self.allocator.translate_loc_from_full_to_swa(slots) > 0).all())

    def _check_match(self, key: CacheKey, m) -> None:
        ids = list(key.token_ids)
        assert m.prefix_len % self.page == 0 and m.prefix_len <= len(ids)
        assert len(m.device_indices) == m.prefix_len
        for i, slot in enumerate(m.device_indices.tolist()):
            expected = (key.extra_key, tuple(ids[: i + 1]))
            assert self.content[slot] == expected, "a match returned foreign KV"
        assert self._live(m.device_indices[-self.window :]), "a match whose last window is not live"

    def _check_eviction(self, params: EvictParams, before: tuple[int, ...], result) -> None:
        full_evictable, swa_evictable, full_free, swa_free = before
        page = self.page
        assert result.num_tokens <= round_up(params.num_tokens, page)
        assert result.num_tokens >= min(params.num_tokens, full_evictable)
        swa_bound = max(round_up(params.num_tokens, page), round_up(params.swa_num_tokens, page))
        assert result.swa_num_tokens <= swa_bound
        assert result.swa_num_tokens >= min(params.swa_num_tokens, swa_evictable)
        assert self.allocator.full_available_size() == full_free + result.num_tokens
        assert self.allocator.swa_available_size() == swa_free + result.swa_num_tokens

    def _before(self) -> tuple[int, int, int, int]:
        return (
            self.cache.evictable_size(),
            self.cache.swa_evictable_size(),
            self.allocator.full_available_size(),
            self.allocator.swa_available_size(),
        )

    # -- rules ----------------------------------------------------------------------------------

    @rule(key=keys, priority=st.integers(0, 3), recompute=st.booleans())
    def start_request(self, key, priority, recompute):
        """``recompute``: skip the cache (fresh slots for every token): insert meets duplicates."""
        m = self.cache.match_prefix(CacheKey([], key.extra_key) if recompute else key)
        self._check_match(key, m)
        self.cache.inc_lock_ref(m.last_node)
        need = round_up(len(key.token_ids) - m.prefix_len, self.page)
        params = self.allocator.shortfall(need)
        before = self._before()
        result = evict_from_tree_cache(self.cache, need)
        if params is not None:
            self._check_eviction(params, before, result)
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
                "slid": 0,
                "priority": priority,
            }
        )

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def slide_window(self, data):
        """The oldest own tokens of a request leave its window: their window slots are freed."""
        req = data.draw(st.sampled_from(self.requests))
        room = (req["own"].numel() - req["slid"]) // self.page
        if room == 0:
            return
        k = data.draw(st.integers(1, room)) * self.page
        self.allocator.free_swa(req["own"][req["slid"] : req["slid"] + k])
        req["slid"] += k

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        self._finish(self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1))))

    @precondition(lambda self: len(self.requests) > 1)
    @rule()
    def finish_all(self):
        """The batch drains: afterwards no lock may be left anywhere."""
        while self.requests:
            self._finish(self.requests.pop())

    def _finish(self, req: dict) -> None:
        length = len(req["key"].token_ids)
        prefix_len = len(req["matched"])
        indices = torch.cat([req["matched"], req["own"]])[:length]
        swa_evicted = min(prefix_len + req["slid"], length) if req["slid"] else 0
        cached = self.cache.insert(
            req["key"], indices, priority=req["priority"], swa_evicted_seqlen=swa_evicted
        )
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

    @rule(n=st.integers(0, 40), m=st.integers(0, 40))
    def evict(self, n, m):
        params = EvictParams(num_tokens=n, swa_num_tokens=m)
        before = self._before()
        self._check_eviction(params, before, self.cache.evict(params))

    @rule(key=keys)
    def probe(self, key):
        self._check_match(key, self.cache.match_prefix(key))

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def conservation_and_ownership(self):
        cache, allocator = self.cache, self.allocator
        held = sum(r["own"].numel() for r in self.requests)
        held_window = held - sum(r["slid"] for r in self.requests)
        full_cached = cache.evictable_size() + cache.protected_size()
        swa_cached = cache.swa_evictable_size() + cache.swa_protected_size()
        assert allocator.full_available_size() + full_cached + held == FULL
        assert allocator.swa_available_size() + swa_cached + held_window == WINDOW_POOL
        values = cache.all_values_flatten()
        cached = values.tolist()
        assert len(cached) == len(set(cached)) == cache.total_size()
        live = int((allocator.translate_loc_from_full_to_swa(values) > 0).sum()) if cached else 0
        assert live == cache.swa_total_size()
        own = [s for r in self.requests for s in r["own"].tolist()]
        assert not set(cached) & set(own)
        locked = set()
        for r in self.requests:
            locked.update(r["matched"].tolist())
            assert self._live(r["matched"][-self.window :]), "a locked window was evicted"
        assert locked <= set(cached), "a locked prefix was evicted"
        assert cache.protected_size() == len(locked)
        assert cache.swa_protected_size() <= cache.protected_size()
        if not self.requests:  # every window lock was released, whatever splits happened meanwhile
            assert cache.swa_protected_size() == 0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_swa_radix_state_machine(policy):
    machine = type(f"SWARadix_{policy}", (SWARadixMachine,), {"policy_name": policy})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=25,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
