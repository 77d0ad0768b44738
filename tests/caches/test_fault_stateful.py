"""A request lifecycle with faults injected at random: a policy that raises (or returns unordered
keys, or pops a stranger) and an ``allocator.free`` that raises.

A rule that hits a fault must raise (``PolicyError`` for the policy, the allocator's own error for
``free``) and leave everything observable exactly as before (``tests.faults.state``); the request
then simply stays as it was. After every step: conservation (free + cached + held by requests ==
capacity, counted per slot through the allocator's ownership state) and single ownership (every
cached slot is ``CACHED`` and cached once, every request slot is ``HELD``, the two disjoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvplug.allocators import CACHED, FREE, HELD, PagedAllocator, StandardAllocator, SWAAllocator
from kvplug.caches.block_hash import BlockHashCache
from kvplug.caches.radix import RadixCache
from kvplug.caches.swa_radix import SWARadixCache
from kvplug.errors import PolicyError
from kvplug_hookspecs import CacheKey, EvictParams
from tests.faults import TRAPS, Boom, FaultyPolicy, failing_free, state

CAPACITY = 64
SETTINGS = settings(
    max_examples=12,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
prompts = st.builds(
    lambda head, tail: [*head, *tail],
    st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 9, 9)]),
    st.lists(st.integers(0, 3), max_size=9),
)
traps = st.sampled_from(TRAPS)


@dataclass(eq=False)
class Request:
    key: CacheKey
    handle: Any
    prefix_len: int  # the cached prefix it matched (locked in the cache)
    slots: torch.Tensor  # the prefix's slots, then its own (whole pages)


class FaultMachine(RuleBasedStateMachine):
    def __init__(self, kind: str, page_size: int) -> None:
        super().__init__()
        self.page = page_size
        if kind == "swa_radix":
            self.allocator: Any = SWAAllocator(CAPACITY, CAPACITY, 4, device="cpu")
        elif page_size > 1:
            self.allocator = PagedAllocator(CAPACITY, page_size, device="cpu")
        else:
            self.allocator = StandardAllocator(CAPACITY, device="cpu")
        cls = {"radix": RadixCache, "block_hash": BlockHashCache, "swa_radix": SWARadixCache}[kind]
        self.cache: Any = cls(self.allocator, FaultyPolicy, page_size=page_size)
        self.policies = (
            [self.cache.full_policy, self.cache.swa_policy]
            if kind == "swa_radix"
            else [self.cache.policy]
        )
        self.running: list[Request] = []
        self.free_fails = False
        self.faults = 0

    # -- running an operation that may hit a fault ------------------------------------------
    def _guarded(self, operation: Any) -> bool:
        """Run ``operation``; on an injected fault check nothing changed. True if it completed."""
        before = state(self.cache, self.allocator)
        try:
            if self.free_fails:
                with failing_free(self.allocator):
                    operation()
            else:
                operation()
        except (PolicyError, Boom) as exc:
            named = isinstance(exc, Boom) or "FaultyPolicy" in str(exc)
            assert named
            assert state(self.cache, self.allocator) == before
            self.faults += 1
            return False
        finally:
            self.free_fails = False
            for policy in self.policies:
                policy.disarm()
        return True

    # -- rules --------------------------------------------------------------------------------
    @rule(trap=traps, which=st.integers(0, 1), after=st.integers(1, 3))
    def arm_policy(self, trap, which, after):
        self.policies[which % len(self.policies)].arm(trap[0], after=after, mode=trap[1])

    @rule()
    def arm_free(self):
        self.free_fails = True

    @rule(tokens=prompts)
    def start_request(self, tokens):
        if len(self.running) >= 3:
            return
        key = CacheKey(tokens)
        result: dict[str, Any] = {}

        def match() -> None:
            result["match"] = self.cache.match_prefix(key)

        if not self._guarded(match):
            return
        m = result["match"]
        if not self._guarded(lambda: self.cache.inc_lock_ref(m.last_node)):
            return
        need = -(-(len(tokens) - m.prefix_len) // self.page) * self.page
        short = need - self.allocator.available_size()
        if short > 0:
            self._guarded(
                lambda: self.cache.evict(EvictParams(num_tokens=short, swa_num_tokens=short))
            )
        new = self.allocator.alloc(need) if need <= self.allocator.available_size() else None
        if new is None:
            self.cache.dec_lock_ref(m.last_node)
            return
        slots = torch.cat([m.device_indices, new])
        self.running.append(Request(key, m.last_node, m.prefix_len, slots))

    @rule(pick=st.integers(0, 1 << 16))
    def finish_request(self, pick):
        if not self.running:
            return
        request = self.running[pick % len(self.running)]
        tokens = list(request.key.token_ids)
        aligned = len(tokens) // self.page * self.page

        def finish() -> None:
            self.cache.insert(request.key, request.slots[: len(tokens)])

        if not self._guarded(finish):
            return
        # the cache owns the aligned part now; the request frees its tail and unlocks
        tail = request.slots[aligned:]
        if tail.numel():
            self.allocator.free(tail)
        self.running.remove(request)
        self.cache.dec_lock_ref(request.handle)

    @rule(n=st.integers(0, 16))
    def evict(self, n):
        self._guarded(lambda: self.cache.evict(EvictParams(num_tokens=n, swa_num_tokens=n)))

    # -- invariants ---------------------------------------------------------------------------
    def _request_slots(self) -> torch.Tensor:
        own = [r.slots[r.prefix_len :] for r in self.running]
        return torch.cat(own) if own else torch.empty(0, dtype=torch.int64)

    @invariant()
    def conservation_and_single_ownership(self):
        a, cache = self.allocator, self.cache
        owners = a.owner_state(torch.arange(a.page_size, a.size + a.page_size))
        free = a.full_available_size() if hasattr(a, "full_available_size") else a.available_size()
        assert int((owners == FREE).sum()) == free
        assert int((owners == CACHED).sum()) == cache.total_size()
        cached = cache.all_values_flatten()
        assert cached.unique().numel() == cached.numel()
        assert bool((a.owner_state(cached) == CACHED).all())
        mine = self._request_slots()
        if mine.numel():
            assert bool((a.owner_state(mine) == HELD).all())
            assert not set(mine.tolist()) & set(cached.tolist())
        assert int((owners == HELD).sum()) == mine.numel()
        assert free + cache.protected_size() + cache.evictable_size() + mine.numel() == a.size

    def teardown(self):
        for policy in self.policies:
            policy.disarm()
        for r in list(self.running):
            self.cache.dec_lock_ref(r.handle)
        self.cache.evict(EvictParams(num_tokens=CAPACITY, swa_num_tokens=CAPACITY))


@pytest.mark.parametrize(
    "kind, page_size", [("radix", 1), ("radix", 4), ("block_hash", 4), ("swa_radix", 1)]
)
def test_faults_never_lose_or_share_a_slot(kind, page_size):
    run_state_machine_as_test(lambda: FaultMachine(kind, page_size), settings=SETTINGS)


@pytest.mark.parametrize(
    "kind, page_size", [("radix", 1), ("radix", 4), ("block_hash", 4), ("swa_radix", 1)]
)
def test_a_key_stored_while_the_policy_misbehaved_never_trips_a_later_unlock(kind, page_size):
    """The sequence hypothesis found: an unorderable key is stored during an eviction that the
    policy's rebuild survives; once the policy behaves again, unlocking the running request
    (the next policy call, before any eviction) must rebuild first, not raise."""
    m = FaultMachine(kind, page_size)
    m.start_request(tokens=[0])
    m.finish_request(pick=0)
    m.start_request(tokens=[1, 2, 3, 4])
    m.finish_request(pick=0)
    m.start_request(tokens=[1, 2, 3, 4])
    m.arm_free()
    m.evict(n=1)
    m.arm_free()
    m.arm_policy(after=2, trap=("key", "incomparable"), which=0)
    m.evict(n=1)
    m.conservation_and_single_ownership()
    m.teardown()  # disarms, unlocks every running request, evicts everything
    m.conservation_and_single_ownership()
    assert m.cache.total_size() == 0
