"""Every cache against bad input and broken plugins: the error, and the full state unchanged.

Each case builds a populated cache (two prefixes sharing a head, a third one locked by a running
request, slots held by another request), snapshots everything a caller can observe
(``tests.faults.state``: free count, every slot's owner, every cached token's slot, lock counts
and statistics, sizes, counters, the clock), makes one bad call, and compares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvplug.allocators import PagedAllocator, StandardAllocator, SWAAllocator
from kvplug.caches.block_hash import BlockHashCache
from kvplug.caches.chunk import ChunkCache
from kvplug.caches.radix import RadixCache
from kvplug.caches.swa_radix import SWARadixCache
from kvplug.errors import PolicyError
from kvplug_hookspecs import CacheKey, EvictParams
from tests.cache_helpers import DEVICE
from tests.faults import TRAPS, Boom, FaultyPolicy, failing_free, state

KINDS = ("radix", "radix_paged", "swa_radix", "block_hash", "chunk")
TREE_KINDS = KINDS[:-1]

A = list(range(0, 8))
B = list(range(0, 4)) + list(range(20, 24))  # shares A's first 4 tokens (one page)
C = list(range(30, 38))


class Scenario:
    """A populated cache: A and B cached and unlocked, C cached and locked, ``held`` slots."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        page = 4 if kind in ("radix_paged", "block_hash") else 1
        if kind == "swa_radix":
            self.allocator: Any = SWAAllocator(64, 48, 4, device=DEVICE)
        elif page > 1:
            self.allocator = PagedAllocator(64, page, device=DEVICE)
        else:
            self.allocator = StandardAllocator(64, device=DEVICE)
        factory = {
            "radix": RadixCache,
            "radix_paged": RadixCache,
            "swa_radix": SWARadixCache,
            "block_hash": BlockHashCache,
            "chunk": ChunkCache,
        }[kind]
        self.cache: Any = factory(self.allocator, FaultyPolicy, page_size=page)
        self.slots = {}
        for name, tokens in (("A", A), ("B", B), ("C", C)):
            m = self.cache.match_prefix(tokens)
            new = self.allocator.alloc(len(tokens) - m.prefix_len)
            slots = torch.cat([m.device_indices, new])
            self.cache.insert(tokens, slots)
            self.slots[name] = slots
        self.handle = self.cache.match_prefix(C).last_node
        self.cache.inc_lock_ref(self.handle)
        self.b_handle = self.cache.match_prefix(B).last_node
        self.held = self.allocator.alloc(4)  # a running request's own slots

    def policies(self) -> list[FaultyPolicy]:
        if self.kind == "swa_radix":
            return [self.cache.full_policy, self.cache.swa_policy]
        return [self.cache.policy] if hasattr(self.cache, "policy") else []

    def snapshot(self) -> dict[str, Any]:
        return state(self.cache, self.allocator)


def _other_node(kind: str) -> Any:
    """A lock handle from another cache of the same kind."""
    return Scenario(kind).b_handle


# -- bad input --------------------------------------------------------------------------------

BAD_KEYS: list[tuple[Any, type[Exception], str]] = [
    ([1.5, 2, 3, 4], TypeError, "position 0 is 1.5"),
    ([1, 2, "x", 4], TypeError, "position 2 is 'x'"),
    ([1, 2, 3, None], TypeError, "position 3 is None"),
    ([1, 2**63, 3, 4], ValueError, "int64: position 1"),
    ([-(2**63) - 1, 2, 3, 4], ValueError, "int64: position 0"),
    ("abcd", TypeError, "str"),
    (b"abcd", TypeError, "bytes"),
    (5, TypeError, "int"),
    (torch.ones(2, 2, dtype=torch.int64), TypeError, "1-D"),
    (torch.ones(4), TypeError, "1-D integers"),
    (CacheKey([1, 2, 3, 4], extra_key=5), TypeError, "extra_key must be a str or None, got int"),
    (CacheKey([1, 2, 3, 4], extra_key=b"x"), TypeError, "extra_key must be a str or None"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("operation", ["match_prefix", "insert", "touch_prefix"])
@pytest.mark.parametrize("key, error, match", BAD_KEYS)
def test_a_bad_key_is_rejected_and_changes_nothing(kind, operation, key, error, match):
    s = Scenario(kind)
    if not hasattr(s.cache, operation):
        pytest.skip(f"{kind} has no {operation}")
    before = s.snapshot()
    call: Callable[[], Any] = {
        "match_prefix": lambda: s.cache.match_prefix(key),
        "insert": lambda: s.cache.insert(key, s.held),
        "touch_prefix": lambda: s.cache.touch_prefix(key),
    }[operation]
    with pytest.raises(error, match=match):
        call()
    assert s.snapshot() == before


def _bad_inserts(s: Scenario) -> list[tuple[Any, Any, dict[str, Any], type[Exception], str]]:
    """(key, indices, keyword arguments, error, message) for insert with a fresh 4-token key."""
    new = [50, 51, 52, 53]
    held, a = s.held, s.slots["A"]
    freed = s.allocator.alloc(4)
    s.allocator.free(freed)
    page = s.allocator.page_size
    out_of_range = torch.arange(4, device=held.device) + s.allocator.size + page
    return [
        (new, held[:3], {}, ValueError, "3 slots but the key has 4 tokens"),
        (new, held.float(), {}, TypeError, "integer tensor"),
        (new, held.tolist(), {}, TypeError, "torch.Tensor"),
        (new, held.view(2, 2), {}, TypeError, "1-D"),
        (new, torch.arange(4, device=held.device), {}, ValueError, "padding"),
        (new, out_of_range, {}, ValueError, "out of range"),
        (new, freed, {}, ValueError, "is free, expected held"),
        (new, a[:4], {}, ValueError, "owned by the cache, expected held"),
        (new, held[[0, 1, 2, 0]], {}, ValueError, "given twice in one call"),
        (new, held, {"priority": 1.5}, TypeError, "priority must be an int"),
        (new, held, {"priority": True}, TypeError, "priority must be an int, got bool"),
    ]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", range(11))
def test_a_bad_insert_is_rejected_and_changes_nothing(kind, case):
    s = Scenario(kind)
    key, indices, kwargs, error, match = _bad_inserts(s)[case]
    if kind == "chunk" and "owned by the cache" in match:
        pytest.skip("a chunk cache owns nothing")
    before = s.snapshot()
    with pytest.raises(error, match=match):
        s.cache.insert(key, indices, **kwargs)
    assert s.snapshot() == before


@pytest.mark.parametrize("kind", ["radix", "radix_paged", "block_hash"])
def test_a_negative_hits_after_is_rejected(kind):
    s = Scenario(kind)
    before = s.snapshot()
    with pytest.raises(ValueError, match="hits_after must be >= 0"):
        s.cache.insert([50, 51, 52, 53], s.held, hits_after=-1)
    assert s.snapshot() == before


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_the_same_slots_under_a_second_key_are_rejected(kind):
    s = Scenario(kind)
    before = s.snapshot()
    with pytest.raises(ValueError, match="owned by the cache"):
        s.cache.insert(list(range(60, 68)), s.slots["C"])
    assert s.snapshot() == before


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize(
    "handle, error, match",
    [
        ("ancestor", ValueError, "not locked"),
        ("root", ValueError, "not locked"),
        ("unlocked", ValueError, "not locked"),
        ("int", TypeError, "int"),
        ("foreign", ValueError, "not cached"),
    ],
)
def test_unlocking_a_handle_never_locked_is_rejected(kind, handle, error, match):
    s = Scenario(kind)
    s.cache.inc_lock_ref(s.b_handle)
    node = {
        "ancestor": s.b_handle.parent,
        "root": s.cache.root,
        "unlocked": s.cache.match_prefix(A).last_node,
        "int": 42,
        "foreign": _other_node(kind),
    }[handle]
    before = s.snapshot()
    with pytest.raises(error, match=match):
        s.cache.dec_lock_ref(node)
    assert s.snapshot() == before
    # and the locks still come off exactly as they went on
    s.cache.dec_lock_ref(s.b_handle)
    s.cache.dec_lock_ref(s.handle)
    assert s.cache.protected_size() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_bad_lock_handles_and_evict_params_are_rejected(kind):
    s = Scenario(kind)
    before = s.snapshot()
    with pytest.raises(TypeError):
        s.cache.inc_lock_ref(42)
    with pytest.raises(TypeError, match="EvictParams"):
        s.cache.evict(5)
    with pytest.raises(TypeError, match="EvictParams"):
        s.cache.evict({"num_tokens": 4})
    assert s.snapshot() == before


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_a_lock_count_never_goes_negative(kind):
    s = Scenario(kind)
    s.cache.dec_lock_ref(s.handle)
    before = s.snapshot()
    with pytest.raises(ValueError, match="not locked"):
        s.cache.dec_lock_ref(s.handle)
    assert s.snapshot() == before
    assert s.cache.protected_size() == 0


# -- broken policies --------------------------------------------------------------------------


def _operations(s: Scenario) -> dict[str, Callable[[], Any]]:
    fresh = s.allocator.alloc(8)
    return {
        "insert_new": lambda: s.cache.insert(list(range(40, 48)), fresh),
        "insert_extend": lambda: s.cache.insert(
            A + list(range(60, 64)), torch.cat([s.slots["A"], s.held])
        ),
        "insert_duplicate": lambda: s.cache.insert(A, fresh),
        "match_prefix": lambda: s.cache.match_prefix(A[:6]),
        "evict": lambda: s.cache.evict(EvictParams(num_tokens=12, swa_num_tokens=12)),
        "evict_partial": lambda: s.cache.evict(EvictParams(num_tokens=4, swa_num_tokens=2)),
        "inc_lock_ref": lambda: s.cache.inc_lock_ref(s.b_handle),
        "dec_lock_ref": lambda: s.cache.dec_lock_ref(s.handle),
    }


OPERATIONS = (
    "insert_new",
    "insert_extend",
    "insert_duplicate",
    "match_prefix",
    "evict",
    "evict_partial",
    "inc_lock_ref",
    "dec_lock_ref",
)


POLICY_SLOTS = [(kind, 0) for kind in TREE_KINDS] + [("swa_radix", 1)]  # swa: full, window


@pytest.mark.parametrize("kind, which", POLICY_SLOTS)
@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("method, mode", TRAPS)
def test_a_broken_policy_leaves_the_cache_as_it_was(kind, which, operation, method, mode):
    s = Scenario(kind)
    policies = s.policies()
    call = _operations(s)[operation]
    before = s.snapshot()
    policies[which].arm(method, mode=mode)
    try:
        call()
    except PolicyError as exc:
        message = str(exc)
        assert "tests.faults.FaultyPolicy failed in" in message
        assert policies[which].tripped
        assert s.snapshot() == before
        policies[which].disarm()
        call()  # the same call works once the plugin behaves
    else:
        # the operation did not reach the trap, or the policy absorbed it (a foreign or
        # unordered key it never compared): nothing to check but the invariants
        policies[which].disarm()
    _check_invariants(s)


def _check_invariants(s: Scenario) -> None:
    """Conservation and single ownership, through the public API."""
    cache, allocator = s.cache, s.allocator
    cached = cache.all_values_flatten()
    assert cached.numel() == cache.total_size()
    assert cached.unique().numel() == cached.numel()  # no slot cached twice
    owners = allocator.owner_state(cached)
    assert bool((owners == 2).all())  # every cached slot is the cache's


# -- a failing allocator.free -----------------------------------------------------------------


@pytest.mark.parametrize("kind", TREE_KINDS)
@pytest.mark.parametrize("operation", ["evict", "evict_partial", "insert_duplicate", "reset"])
def test_a_failing_free_leaves_the_cache_as_it_was(kind, operation):
    s = Scenario(kind)
    if operation == "reset":
        s.cache.dec_lock_ref(s.handle)
        call: Callable[[], Any] = s.cache.reset
    else:
        call = _operations(s)[operation]
    before = s.snapshot()
    with failing_free(s.allocator), pytest.raises(Boom):
        call()
    assert s.snapshot() == before
    call()
    _check_invariants(s)


def test_chunk_insert_with_a_failing_free_gives_the_slots_back():
    s = Scenario("chunk")
    before = s.snapshot()
    with failing_free(s.allocator), pytest.raises(Boom):
        s.cache.insert([1, 2, 3, 4], s.held)
    assert s.snapshot() == before
