"""Stateful property tests: an engine's random request lifecycle over radix (every policy, pages 1
and 4) and chunk caches, with real allocators in double-free-detecting mode.

After every step: no slot lost or leaked (allocator free + cache evictable + cache protected +
slots held by requests == capacity, and the live slots are exactly the cached ones plus the held
ones, each once); locked prefixes are still cached; the tree's per-node lock state adds up to
``evictable_size``/``protected_size``. Every eviction frees at least what was asked when enough
is evictable and at most that rounded up to a page (``exact``), or everything evictable otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvplug.eviction import evict_from_tree_cache
from kvplug_hookspecs import CacheKey, EvictParams
from tests.cache_helpers import POLICY_NAMES, make_chunk, make_radix

CAPACITY = 48
MAX_RUNNING = 3  # requests (and loose allocations) in flight: the cache, not they, fills memory
SYSTEM_A = (7, 7, 1, 2, 3, 4, 5, 6)
SYSTEM_B = (7, 7, 1, 2, 9, 9, 9, 9)  # shares one page of SYSTEM_A at page_size 4

prompts = st.builds(
    lambda system, suffix: [*system, *suffix],
    st.sampled_from([(), SYSTEM_A, SYSTEM_B]),
    st.lists(st.integers(0, 5), max_size=10),
)
namespaces = st.sampled_from([None, None, "lora"])
picks = st.integers(0, 1 << 16)

SETTINGS = settings(
    max_examples=50,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


@dataclass
class Request:
    key: CacheKey
    prefix: torch.Tensor  # cached slots it matched (locked in the cache)
    own: torch.Tensor  # slots it allocated (whole pages)
    node: Any


class CacheMachine(RuleBasedStateMachine):
    def __init__(
        self, kind: str, page_size: int, policy: str = "lru", granularity: str = "exact"
    ) -> None:
        super().__init__()
        self.page = page_size
        self.exact = granularity == "exact"
        if kind == "radix":
            self.cache, self.allocator = make_radix(CAPACITY, page_size, policy, granularity)
        else:
            self.cache, self.allocator = make_chunk(CAPACITY, page_size)
        self.requests: list[Request] = []
        self.loose: list[
            torch.Tensor
        ] = []  # memory the engine holds outside requests (decode etc.)

    # -- helpers -------------------------------------------------------------------------------

    def _checked_evict(self, need: int) -> None:
        """Evict for an allocation of ``need`` slots and check the shortfall contract."""
        available, evictable = self.allocator.available_size(), self.cache.evictable_size()
        result = evict_from_tree_cache(self.cache, need)
        if self.cache.is_chunk_cache:
            assert result is None
            return
        shortfall = max(0, need - available)
        freed = result.num_tokens
        assert self.allocator.available_size() == available + freed
        if shortfall == 0:
            assert freed == 0
        elif evictable >= shortfall:
            assert freed >= shortfall
            if self.exact:
                assert freed <= _round_up(shortfall, self.page)
        else:
            assert freed == evictable

    def _alloc(self, n: int) -> torch.Tensor | None:
        n = _round_up(n, self.page)
        self._checked_evict(n)
        slots = self.allocator.alloc(n)
        if slots is None and self.exact:
            assert self.cache.evictable_size() == 0, (
                "alloc failed although evictable tokens remained"
            )
        return slots

    def _held(self) -> list[torch.Tensor]:
        return [r.own for r in self.requests] + self.loose

    # -- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: len(self.requests) < MAX_RUNNING)
    @rule(tokens=prompts, extra=namespaces)
    def start_request(self, tokens, extra):
        key = CacheKey(tokens, extra)
        m = self.cache.match_prefix(key)
        assert m.prefix_len == m.device_indices.numel() <= len(tokens)
        assert m.prefix_len % self.page == 0
        self.cache.inc_lock_ref(m.last_node)
        own = self._alloc(len(tokens) - m.prefix_len)
        if own is None:
            self.cache.dec_lock_ref(m.last_node)
            return
        self.requests.append(Request(key, m.device_indices, own, m.last_node))

    @precondition(lambda self: self.requests)
    @rule(pick=picks, cache_it=st.booleans())
    def finish_request(self, pick, cache_it):
        r = self.requests.pop(pick % len(self.requests))
        n, p = len(r.key.token_ids), r.prefix.numel()
        if cache_it:
            indices = torch.cat([r.prefix, r.own[: n - p]])
            cached_before = self.cache.insert(r.key, indices)
            assert cached_before >= p
            aligned = n - n % self.page
            self.allocator.free(r.own[aligned - p :])  # the caller's part: the unaligned tail
        else:
            self.allocator.free(r.own)
        self.cache.dec_lock_ref(r.node)

    @precondition(lambda self: self.requests)
    @rule(pick=picks)
    def cache_unfinished_request(self, pick):
        """Chunked prefill: cache what is computed, continue on the cached slots."""
        r = self.requests[pick % len(self.requests)]
        n, p = len(r.key.token_ids), r.prefix.numel()
        self.cache.insert(r.key, torch.cat([r.prefix, r.own[: n - p]]))
        m = self.cache.match_prefix(r.key)
        aligned = n - n % self.page
        assert m.prefix_len == (0 if self.cache.is_chunk_cache else aligned)
        self.cache.inc_lock_ref(m.last_node)
        self.cache.dec_lock_ref(r.node)
        if self.cache.is_chunk_cache:
            # the chunk cache freed the aligned part: the request has to recompute it
            r.own = r.own[aligned - p :]
            r.key = CacheKey(list(r.key.token_ids)[aligned:], r.key.extra_key)
        else:
            r.own = r.own[aligned - p :]
        r.prefix, r.node = m.device_indices, m.last_node

    @rule(tokens=prompts, extra=namespaces)
    def match_only(self, tokens, extra):
        m = self.cache.match_prefix(CacheKey(tokens, extra))
        assert m.prefix_len == m.device_indices.numel()
        assert m.prefix_len <= len(tokens) - len(tokens) % self.page

    @rule(n=st.integers(0, 12) | st.just(CAPACITY + 4))
    def evict(self, n):
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(EvictParams(num_tokens=n)).num_tokens
        if self.cache.is_chunk_cache:
            assert freed == 0
        elif evictable >= n:
            assert freed >= n
            if self.exact:
                assert freed <= _round_up(n, self.page)
        else:
            assert freed == evictable
        assert self.cache.evictable_size() == evictable - freed

    @precondition(lambda self: len(self.loose) < MAX_RUNNING)
    @rule(n=st.integers(1, 8))
    def alloc_loose(self, n):
        slots = self._alloc(n)
        if slots is not None:
            self.loose.append(slots)

    @precondition(lambda self: self.loose)
    @rule(pick=picks)
    def free_loose(self, pick):
        self.allocator.free(self.loose.pop(pick % len(self.loose)))

    @precondition(lambda self: not self.requests)
    @rule()
    def reset(self):
        self.cache.reset()
        assert self.cache.total_size() == 0

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def conservation(self):
        held = self._held()
        held_count = sum(t.numel() for t in held)
        cache = self.cache
        assert (
            self.allocator.available_size()
            + cache.evictable_size()
            + cache.protected_size()
            + held_count
            == CAPACITY
        )
        cached = cache.all_values_flatten().tolist()
        assert len(cached) == cache.total_size()
        live = cached + [s for t in held for s in t.tolist()]
        assert len(live) == len(set(live)), "a slot is owned twice"
        assert all(1 <= s <= CAPACITY + self.page - 1 for s in live)

    @invariant()
    def locked_prefixes_stay_cached(self):
        cached = set(self.cache.all_values_flatten().tolist())
        for r in self.requests:
            assert set(r.prefix.tolist()) <= cached
        if not self.requests:
            assert self.cache.protected_size() == 0

    @invariant()
    def lock_state_adds_up(self):
        root = getattr(self.cache, "root", None)
        if root is None:
            return
        evictable = protected = 0
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            assert node.num_tokens == node.value.numel() == len(node.key) > 0
            assert node.num_tokens % self.page == 0
            if node.lock_ref:
                protected += node.num_tokens
                assert all(child.lock_ref <= node.lock_ref for child in node.children.values())
            else:
                evictable += node.num_tokens
            stack.extend(node.children.values())
        assert (evictable, protected) == (self.cache.evictable_size(), self.cache.protected_size())


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_cache_lifecycle(page_size, policy):
    run_state_machine_as_test(lambda: CacheMachine("radix", page_size, policy), settings=SETTINGS)


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_cache_leaf_granularity_lifecycle(page_size):
    run_state_machine_as_test(
        lambda: CacheMachine("radix", page_size, "lru", "leaf"), settings=SETTINGS
    )


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache_lifecycle(page_size):
    run_state_machine_as_test(lambda: CacheMachine("chunk", page_size), settings=SETTINGS)
