"""A policy that fails is survivable: afterwards every unlocked slot is still evictable.

``MixedKeyPolicy`` gives keys that do not compare (a string for one candidate, a tuple for
another) for a random number of calls, starting at a random insert or evict, possibly outlasting
the call that fails and the cache's rebuild of the policy's view. Whatever happened, once the
policy behaves again (or was quarantined to LRU) a cache with nothing locked must give back
every slot on ``evict(capacity)``; a failing call changes nothing observable; and after a
``PolicyError`` the next ``evict`` cannot fail on what the policy kept from its bad spell.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvplug.allocators import PagedAllocator, StandardAllocator, SWAAllocator
from kvplug.caches.block_hash import BlockHashCache
from kvplug.caches.common import QuarantinePolicy
from kvplug.caches.radix import RadixCache
from kvplug.caches.swa_radix import SWARadixCache
from kvplug.errors import PolicyError
from kvplug_hookspecs import CacheKey, EvictParams
from tests.faults import MixedKeyPolicy, state

CAPACITY = 64
CACHES = {"radix": RadixCache, "block_hash": BlockHashCache, "swa_radix": SWARadixCache}
KINDS = [("radix", 1), ("radix", 4), ("block_hash", 4), ("swa_radix", 1)]
SETTINGS = settings(
    max_examples=25,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
prompts = st.builds(
    lambda head, tail: [*head, *tail],
    st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (5, 6, 7, 8)]),
    st.lists(st.integers(0, 3), min_size=1, max_size=9),
)


@dataclass(eq=False)
class Request:
    handle: Any
    slots: torch.Tensor  # the matched prefix's slots, then its own
    prefix_len: int
    key: CacheKey


def _allocator(kind: str, page: int) -> Any:
    if kind == "swa_radix":
        return SWAAllocator(CAPACITY, CAPACITY, 4, device="cpu")
    if page > 1:
        return PagedAllocator(CAPACITY, page, device="cpu")
    return StandardAllocator(CAPACITY, device="cpu")


def _policies(cache: Any) -> list[Any]:
    if hasattr(cache, "swa_policy"):
        return [cache.full_policy, cache.swa_policy]
    return [cache.policy]


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class RecoveryMachine(RuleBasedStateMachine):
    def __init__(self, kind: str, page: int) -> None:
        super().__init__()
        self.page = page
        self.allocator = _allocator(kind, page)
        self.cache: Any = CACHES[kind](self.allocator, MixedKeyPolicy, page_size=page)
        self.running: list[Request] = []
        self.fault: tuple[str, int] | None = None  # (call site, key calls it lasts)
        self.bad_since_error = False  # the policy misbehaved since the last PolicyError
        self.log = _Count()
        logging.getLogger("kvplug.caches.common").addHandler(self.log)

    # -- one call, with the armed fault if it is for this site ---------------------------------
    def _call(self, site: str, operation: Any) -> bool:
        before = state(self.cache, self.allocator)
        bad = self.fault is not None and self.fault[0] == site
        if bad:
            assert self.fault is not None
            for policy in _policies(self.cache):
                if isinstance(policy, MixedKeyPolicy):
                    policy.misbehave(self.fault[1])
            self.fault = None
            self.bad_since_error = True
        try:
            operation()
        except PolicyError:
            # a failing call changes nothing observable; while behaving, only keys the policy
            # kept from a bad spell (never reported) can make a call fail, once
            assert bad or self.bad_since_error
            assert state(self.cache, self.allocator) == before
            # a failing behaving call rebuilt the view with good keys; a failing bad call
            # rebuilt it while still misbehaving (what it kept may fail a later call, once)
            self.bad_since_error = bad
            return False
        finally:
            for policy in _policies(self.cache):
                if isinstance(policy, MixedKeyPolicy):
                    policy.behave()
        return True

    # -- rules ---------------------------------------------------------------------------------
    @rule(site=st.sampled_from(["insert", "evict"]), calls=st.integers(1, 40))
    def arm(self, site: str, calls: int) -> None:
        self.fault = (site, calls)

    def _must(self, site: str, operation: Any) -> Any:
        """Run a call that has to happen (unlocking a finished request): a ``PolicyError`` is
        allowed once, after a bad spell; the call then succeeds."""
        result: list[Any] = []
        if not self._call(site, lambda: result.append(operation())):
            result.append(operation())
        return result[0]

    @rule(tokens=prompts)
    def start_request(self, tokens: list[int]) -> None:
        if len(self.running) >= 3:
            return
        key = CacheKey(tokens)
        match = self._must("match", lambda: self.cache.match_prefix(key))
        self._must("lock", lambda: self.cache.inc_lock_ref(match.last_node))
        need = -(-(len(tokens) - match.prefix_len) // self.page) * self.page
        short = need - self.allocator.available_size()
        if short > 0:
            params = EvictParams(num_tokens=short, swa_num_tokens=short)
            self._call("evict", lambda: self.cache.evict(params))
        if need > self.allocator.available_size():
            self._must("unlock", lambda: self.cache.dec_lock_ref(match.last_node))
            return
        slots = torch.cat([match.device_indices, self.allocator.alloc(need)])
        self.running.append(Request(match.last_node, slots, match.prefix_len, key))

    @rule(pick=st.integers(0, 1 << 16))
    def finish_request(self, pick: int) -> None:
        if not self.running:
            return
        request = self.running[pick % len(self.running)]
        tokens = len(request.key.token_ids)
        if not self._call("insert", lambda: self.cache.insert(request.key, request.slots[:tokens])):
            return
        tail = request.slots[tokens // self.page * self.page :]
        if tail.numel():
            self.allocator.free(tail)
        self.running.remove(request)
        self._must("unlock", lambda: self.cache.dec_lock_ref(request.handle))

    @rule(n=st.integers(1, 24))
    def evict(self, n: int) -> None:
        self._call("evict", lambda: self.cache.evict(EvictParams(num_tokens=n, swa_num_tokens=n)))

    @rule()
    def drain(self) -> None:
        """Nothing locked, the policy behaving: ``evict(capacity)`` gives back every slot."""
        for request in self.running:
            self._must("unlock", lambda: self.cache.dec_lock_ref(request.handle))  # noqa: B023
            self.allocator.free(request.slots[request.prefix_len :])
        self.running.clear()
        everything = EvictParams(num_tokens=CAPACITY, swa_num_tokens=CAPACITY)
        self._must("drain", lambda: self.cache.evict(everything))
        assert self.cache.total_size() == 0
        assert self.cache.evictable_size() == 0
        assert self.allocator.available_size() == CAPACITY

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def quarantine_is_lru_and_said_once(self) -> None:
        warnings = [r for r in self.log.records if "quarantined" in r.getMessage()]
        assert len(warnings) <= 1
        quarantined = [isinstance(p, QuarantinePolicy) for p in _policies(self.cache)]
        assert len(warnings) == int(any(quarantined))
        assert all(quarantined) or not any(quarantined)

    @invariant()
    def conserved(self) -> None:
        held = sum(r.slots.numel() - r.prefix_len for r in self.running)
        cache, a = self.cache, self.allocator
        free = a.full_available_size() if hasattr(a, "full_available_size") else a.available_size()
        assert free + cache.protected_size() + cache.evictable_size() + held == CAPACITY

    def teardown(self) -> None:
        logging.getLogger("kvplug.caches.common").removeHandler(self.log)
        if self.running or self.cache.total_size():
            self.drain()


@pytest.mark.parametrize("kind, page", KINDS)
def test_every_slot_stays_evictable_after_policy_failures(kind: str, page: int) -> None:
    run_state_machine_as_test(lambda: RecoveryMachine(kind, page), settings=SETTINGS)


def _key(group: int, leaf: int) -> CacheKey:
    """Prompt ``leaf`` (0 or 1) of ``group``: the group's 8-token head, then 4 tokens of its own."""
    return CacheKey(
        [group * 100 + j for j in range(8)] + [group * 100 + 50 + leaf * 10 + j for j in range(4)]
    )


def _insert(cache: Any, allocator: Any, key: CacheKey) -> None:
    match = cache.match_prefix(key)
    new = allocator.alloc(len(key.token_ids) - match.prefix_len)
    cache.insert(key, torch.cat([match.device_indices, new]))


def _filled(kind: str, page: int) -> tuple[Any, Any]:
    """A cache of ``kind`` holding four 8-token heads with two 4-token leaves each, unlocked,
    inserted group by group (64 slots, nothing free)."""
    allocator = _allocator(kind, page)
    cache = CACHES[kind](allocator, MixedKeyPolicy, page_size=page)
    for group in range(4):
        for leaf in range(2):
            _insert(cache, allocator, _key(group, leaf))
    assert (allocator.available_size(), cache.total_size()) == (0, CAPACITY)
    return cache, allocator


@pytest.mark.parametrize("kind, page", KINDS)
@pytest.mark.parametrize("site", ["insert", "evict"])
def test_a_bad_spell_then_everything_evictable(kind: str, page: int, site: str) -> None:
    """The issue's case: a key that does not compare with the others fails one call; then,
    the policy behaving, every one of the 64 slots can be evicted, with no error."""
    cache, allocator = _filled(kind, page)
    cache.evict(EvictParams(num_tokens=4, swa_num_tokens=4))  # group 0's first leaf
    _policies(cache)[0].misbehave(1)  # swa_radix: its full policy
    with pytest.raises(PolicyError, match="MixedKeyPolicy"):
        if site == "insert":  # a new leaf under group 3's head
            key, new = _key(3, 2), allocator.alloc(4)
            try:
                cache.insert(key, torch.cat([cache.match_prefix(key).device_indices, new]))
            finally:
                allocator.free(new)  # the failed insert left them with the caller
        else:
            cache.evict(EvictParams(num_tokens=8, swa_num_tokens=8))  # group 0's head next
    assert [type(p) for p in _policies(cache)] == [MixedKeyPolicy] * len(_policies(cache))
    cache.evict(EvictParams(num_tokens=CAPACITY, swa_num_tokens=CAPACITY))
    assert (cache.total_size(), allocator.available_size()) == (0, CAPACITY)


@pytest.mark.parametrize("kind, page", KINDS)
def test_a_policy_that_keeps_failing_is_quarantined_to_lru(
    kind: str, page: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy that fails on the rebuild too is replaced by LRU, said once in the log; the
    cache then evicts least recently used first and every slot stays evictable."""
    cache, allocator = _filled(kind, page)
    cache.evict(EvictParams(num_tokens=4, swa_num_tokens=4))  # group 0's first leaf
    for policy in _policies(cache):
        policy.misbehave(10**9)
    with caplog.at_level(logging.WARNING, logger="kvplug.caches.common"):
        with pytest.raises(PolicyError, match="MixedKeyPolicy"):
            cache.evict(EvictParams(num_tokens=8, swa_num_tokens=8))
        assert [type(p) for p in _policies(cache)] == [QuarantinePolicy] * len(_policies(cache))
        assert cache.match_prefix(_key(1, 0)).prefix_len == 12  # now the most recent
        cache.evict(EvictParams(num_tokens=12, swa_num_tokens=12))  # LRU: group 0's leaf, head
        assert cache.match_prefix(_key(0, 1)).prefix_len == 0
        assert cache.match_prefix(_key(1, 0)).prefix_len == 12
        assert cache.match_prefix(_key(1, 1)).prefix_len == 12
        assert cache.total_size() == CAPACITY - 16
        cache.evict(EvictParams(num_tokens=CAPACITY, swa_num_tokens=CAPACITY))
    assert (cache.total_size(), allocator.available_size()) == (0, CAPACITY)
    quarantines = [r for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(quarantines) == 1
    assert "MixedKeyPolicy" in quarantines[0].getMessage()
