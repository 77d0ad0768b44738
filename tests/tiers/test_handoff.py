"""When the demotion worker gets its work: at once, or at the end of the engine's step
(``handoff="step"``); and the pages a radix cache's worker hashes are the pages it evicted."""

from __future__ import annotations

import pytest
import torch

import kvplug
from kvplug.caches.block_hashing import BlockHasher
from kvplug.engine import Request, Scheduler, SchedulerOptions
from kvplug.eviction import evict_from_tree_cache
from kvplug.tiers import TierHierarchy
from kvplug.tiers.host import HostTier, HostTierOptions
from kvplug_hookspecs import CacheKey, StorageConfig

from .helpers import namespace, tier_context


def hierarchy(handoff: str, queue_pages: int = 4096) -> tuple[TierHierarchy, HostTier]:
    host = HostTier(tier_context(), HostTierOptions(capacity_tokens=1024))
    config = StorageConfig(handoff=handoff, queue_pages=queue_pages)
    h = TierHierarchy([host], config, namespace(), pool=None, page_size=1, kv_bytes_per_token=64)
    return h, host


def pages(i: int, n: int) -> tuple[list[bytes], list[tuple[int, ...]], list[bytes | None]]:
    keys = [bytes([i, j]) * 16 for j in range(n)]
    return keys, [(i * 100 + j,) for j in range(n)], [None, *keys[:-1]]


def test_step_handoff_holds_a_steps_demotions_until_end_step() -> None:
    h, host = hierarchy("step")
    h.demote(*pages(1, 3), torch.arange(3))
    h.demote(*pages(2, 2), torch.arange(2))
    assert h.held_pages == 5
    assert host.stats().stored_pages == 0  # not even queued: the worker cannot have it
    h.end_step()
    assert h.held_pages == 0
    h.flush()
    assert host.stats().stored_pages == 5 and h.stats.demoted_pages == 5
    assert host.contains(pages(1, 3)[0]) == 3
    h.close()


def test_flush_and_close_hand_over_what_a_step_holds() -> None:
    h, host = hierarchy("step")
    h.demote(*pages(1, 2), torch.arange(2))
    h.flush()  # without end_step: flush hands the step's demotions over first
    assert host.stats().stored_pages == 2
    h.demote(*pages(2, 3), torch.arange(3))
    h.close()  # stores what is held, then stops the worker
    assert h.stats.demoted_pages == 5 and h.held_pages == 0


def test_held_demotions_count_in_the_queue_bound() -> None:
    h, host = hierarchy("step", queue_pages=4)
    h.demote(*pages(1, 3), torch.arange(3))
    h.demote(*pages(2, 2), torch.arange(2))  # 3 + 2 > 4: dropped, not held
    assert (h.held_pages, h.stats.dropped_pages) == (3, 2)
    h.end_step()
    h.flush()
    h.demote(*pages(3, 4), torch.arange(4))  # the bound is free again once stored
    assert h.held_pages == 4
    h.close()
    assert host.stats().stored_pages == 7


def test_immediate_handoff_holds_nothing() -> None:
    h, host = hierarchy("immediate")
    h.demote(*pages(1, 3), torch.arange(3))
    assert h.held_pages == 0
    h.flush()
    assert host.stats().stored_pages == 3
    h.close()


def radix_with_host(page: int, capacity: int) -> kvplug.KVCacheStack:
    return kvplug.build(
        {
            "allocator": "standard" if page == 1 else "paged",
            "prefix_cache": "radix",
            "pool": {"capacity_tokens": capacity, "page_size": page, "store_kv": False},
            "storage": {
                "tiers": [{"name": "host", "options": {"capacity_tokens": 4096}}],
                "background": False,
            },
        }
    )


def insert(stack: kvplug.KVCacheStack, ids: list[int]) -> None:
    cache = stack.prefix_cache
    m = cache.match_prefix(CacheKey(ids))
    new = stack.allocator.alloc(len(ids) - m.prefix_len)
    cache.insert(CacheKey(ids), torch.cat((m.device_indices, new)))


@pytest.mark.parametrize("page", [1, 4])
def test_a_radix_eviction_demotes_its_pages_under_their_chained_digests(page: int) -> None:
    """A leaf and its parent evicted by one call (the parent after the leaf, unlinked), and a
    leaf an exact eviction cuts: the worker's digests equal the hasher's over each page's whole
    prefix, and every demoted page's parent is the page before it."""
    stack = radix_with_host(page, capacity=40)
    a = list(range(1, 9))  # 8 tokens
    ab = a + list(range(101, 109))  # a's child: 8 more
    c = list(range(201, 217))  # 16 tokens under the root
    for ids in (a, ab, c):
        insert(stack, ids)
    cache, storage = stack.prefix_cache, stack.storage
    assert storage is not None
    hasher = BlockHasher()

    def digests(ids: list[int]) -> list[bytes]:
        return list(hasher.chain(hasher.root(None), ids, page, len(ids) // page))

    # LRU: ab's leaf (8), then a (8, now a leaf), then 4 of c's 16 (cut to its first 12)
    evict_from_tree_cache(cache, 8 + 8 + 4 + stack.allocator.available_size())
    demoted = digests(ab) + digests(c)[12 // page :]
    host = storage.tiers[0]
    assert host.contains(digests(ab)) == 16 // page
    assert host.contains(digests(c)) == 0  # its head is still on the device
    assert host.contains(digests(c)[12 // page :]) == 4 // page
    assert storage.stats.demoted_pages == len(demoted)
    got = {p.key: p for p in host.get(demoted) if p is not None}
    chains = [digests(ab), digests(c)]
    for chain in chains:
        for i, key in enumerate(chain):
            if key in got:
                assert got[key].parent == (chain[i - 1] if i else None)
    assert got[digests(c)[12 // page]].token_ids == tuple(c[12 : 12 + page])
    stack.close()


def test_the_scheduler_hands_each_steps_demotions_to_the_worker() -> None:
    """With ``handoff="step"`` kvplug's scheduler ends every step with ``end_step``: nothing
    stays held after a step, and every page it evicted reaches the host tier."""
    stack = kvplug.build(
        {
            "pool": {"capacity_tokens": 24, "store_kv": False},
            "storage": {
                "tiers": [{"name": "host", "options": {"capacity_tokens": 4096}}],
                "handoff": "step",
            },
        }
    )
    storage = stack.storage
    assert storage is not None
    scheduler = Scheduler(stack, None, SchedulerOptions(timing="sequential", debug=True))
    for i in range(6):
        scheduler.add_request(Request(i, [i * 100 + t for t in range(1, 11)], 2, arrival_ms=i))
    held_after_steps = []
    while not scheduler.idle:
        scheduler.step()
        held_after_steps.append(storage.held_pages)
    assert set(held_after_steps) == {0}
    storage.flush()
    evicted = stack.prefix_cache.stats.evicted_tokens
    assert evicted > 0
    assert storage.stats.demoted_pages + storage.stats.dropped_pages == evicted
    stack.close()


# -- the index of stored pages (every tier private) ------------------------------------------


def private_pair(host_tokens: int, memory_tokens: int) -> TierHierarchy:
    from kvplug.tiers.host import MemoryTierOptions, memory_tier

    host = HostTier(tier_context(), HostTierOptions(capacity_tokens=host_tokens))
    memory = memory_tier(tier_context(), MemoryTierOptions(capacity_tokens=memory_tokens))
    config = StorageConfig(background=False)
    return TierHierarchy(
        [host, memory], config, namespace(), pool=None, page_size=1, kv_bytes_per_token=64
    )


def test_may_hold_answers_from_the_pages_the_hierarchy_stored() -> None:
    h = private_pair(1, 1)
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    h.demote([a, b], [(10,), (11,)], [None, a], torch.arange(2))
    # host: b; memory: a (pushed down)
    assert h.may_hold(None, (10,)) and h.may_hold(a, (11,))
    assert not h.may_hold(None, (11,))  # b's tokens, but under another parent
    assert not h.may_hold(a, (12,))
    assert h.stored_parents((11,)) == {a} and not h.stored_parents((12,))
    h.demote([c], [(12,)], [None], torch.arange(1))
    # host: c; memory: b; a pushed out of the last tier: forgotten
    assert not h.may_hold(None, (10,))
    assert h.may_hold(a, (11,)) and h.may_hold(None, (12,))
    h.clear()
    assert not h.may_hold(None, (12,))
    h.close()


def test_a_page_copied_up_stays_indexed_when_the_lower_copy_goes() -> None:
    h = private_pair(1, 1)
    a, b = bytes([1]) * 32, bytes([2]) * 32
    h.demote([a], [(10,)], [None], torch.arange(1))
    h.demote([b], [(20,)], [None], torch.arange(1))  # host: b; memory: a
    keys, runs = h.locate(iter([a]))
    assert runs == [(1, 1)]
    # the prefetch copies a up: the host pushes b down, the memory pushes its a out; the
    # host's copy of a is still there, so a must still be found
    assert h.prefetch(keys, [(10,)], runs) == 1
    assert h.may_hold(None, (10,)) and h.may_hold(None, (20,))
    assert h.locate(iter([a])) == ([a], [(0, 1)])
    h.close()


def test_a_tier_that_is_not_private_turns_the_index_off(tmp_path) -> None:
    from kvplug.tiers.disk import DiskTier, DiskTierOptions

    host = HostTier(tier_context(), HostTierOptions(capacity_tokens=4))
    disk = DiskTier(tier_context(), DiskTierOptions(path=str(tmp_path)))
    h = TierHierarchy(
        [host, disk], StorageConfig(background=False), namespace(), pool=None, page_size=1,
        kv_bytes_per_token=64,
    )  # fmt: skip
    assert h.may_hold(None, (1, 2, 3))  # a restart may find pages there: always ask the tiers
    assert not h.indexed and h.stored_parents((1, 2, 3)) is None
    h.close()


def test_a_run_hasher_hashes_a_repeatedly_cut_head_once() -> None:
    """The uncut keys of a leaf cut again and again are prefixes of each other: the digests
    are the hasher's every time, and only the first key is hashed."""
    from kvplug.caches.tiered import RunHasher

    calls: list[int] = []

    class Counting(BlockHasher):
        def chain(self, parent, ids, page_size, num_pages, extra_key=None):
            calls.append(num_pages)
            return super().chain(parent, ids, page_size, num_pages, extra_key)

    plain, runs = BlockHasher(), RunHasher(Counting())
    key = tuple(range(100, 132))  # 8 pages of 4
    start = plain.root(None)
    for cut in (32, 28, 20, 8):
        want = list(plain.chain(start, key[:cut], 4, cut // 4))
        assert runs.digests(None, key[:cut], 4, None) == want
    assert calls == [8]
    other = (7, *key[1:16])  # a sibling from the same start: hashed on its own
    assert runs.digests(None, other, 4, None) == list(plain.chain(start, other, 4, 4))
    assert calls == [8, 4]


class CountingTier(HostTier):
    """A host tier that records the pages of every ``put``."""

    def __init__(self) -> None:
        super().__init__(tier_context(), HostTierOptions(capacity_tokens=1024))
        self.puts: list[list[bytes]] = []

    def put(self, pages):  # type: ignore[no-untyped-def]
        self.puts.append([p.key for p in pages])
        return super().put(pages)


def test_a_batch_of_demotions_reaches_the_tier_as_one_put_in_order() -> None:
    """The demotions a step hands over are taken as one batch and stored with one ``put``
    (pages in demotion order); a prefetch between them keeps its place."""
    host = CountingTier()
    h = TierHierarchy(
        [host], StorageConfig(handoff="step"), namespace(), pool=None, page_size=1,
        kv_bytes_per_token=64,
    )  # fmt: skip
    first, second = pages(1, 3), pages(2, 2)
    h.demote(*first, torch.arange(3))
    h.demote(*second, torch.arange(2))
    h.end_step()
    h.flush()
    assert host.puts == [first[0] + second[0]]
    assert h.stats.demoted_pages == 5 and h.held_pages == 0
    h.close()
