"""The ``host`` tier: its token bound, its policy by name, chain protection, thread safety."""

from __future__ import annotations

import threading

import pytest

from kvplug.tiers.host import HostTier, HostTierOptions
from kvplug_hookspecs import ComponentSelection, StorageTier

from .helpers import chain, same_page, tier_context


def host(capacity: int, page_size: int = 1, policy: str = "lru", **options) -> HostTier:
    return HostTier(
        tier_context(page_size),
        HostTierOptions(
            capacity_tokens=capacity,
            eviction_policy=ComponentSelection(name=policy, options=options),
        ),
    )


def keys(pages):
    return [p.key for p in pages]


def test_is_a_storage_tier_and_round_trips_pages():
    tier = host(16, page_size=4)
    assert isinstance(tier, StorageTier)
    pages = chain(3, page_size=4)
    assert tier.put(pages) == []
    assert tier.contains(keys(pages)) == 3
    got = tier.get(keys(pages))
    assert all(same_page(g, p) for g, p in zip(got, pages, strict=True))
    s = tier.stats()
    assert (s.pages, s.tokens, s.capacity_tokens, s.stored_pages, s.loaded_pages) == (
        3,
        12,
        16,
        3,
        3,
    )
    assert s.bytes == 3 * 32 and s.medium == "CPU"


def test_contains_counts_from_the_first_key():
    tier = host(16)
    pages = chain(4)
    tier.put([pages[0], pages[1], pages[3]])
    assert tier.contains(keys(pages)) == 2
    assert tier.contains(keys(pages[1:])) == 1
    assert tier.contains([pages[2].key, pages[3].key]) == 0
    assert tier.get(keys(pages))[2] is None


def test_capacity_bound_and_eviction_order_tail_first():
    tier = host(4)
    a, b = chain(4, seed=1), chain(4, seed=2)
    assert tier.put(a) == []
    evicted = tier.put(b)
    # a's tail goes first: only a page no held page chains from is a candidate
    assert keys(evicted) == keys(a[::-1])
    assert tier.contains(keys(b)) == 4 and tier.contains(keys(a)) == 0
    s = tier.stats()
    assert (s.pages, s.tokens, s.evicted_pages, s.stored_pages) == (4, 4, 4, 8)


def test_only_pages_without_held_children_are_evicted():
    tier = host(5)
    a = chain(4, seed=1)
    other = chain(1, seed=2)
    tier.put(a)
    tier.put(other)
    tier.get(keys(a))  # a is now the most recent, yet its head can't go before its tail
    newer = chain(1, seed=3)
    assert keys(tier.put(newer)) == keys(other)  # the least recent candidate
    (victim,) = tier.put(chain(1, seed=4))
    assert victim.key == a[3].key  # then a's tail, never a[0..2] while a[3] is held
    assert tier.contains(keys(a)) == 3


def test_a_run_that_evicts_midway_keeps_its_head_behind_its_tail():
    # b needs room while a (stored by the same put) is pending: a becomes a candidate, x goes;
    # then b chains from a, so a is no candidate any more and the next eviction takes b
    tier = host(2)
    (x,) = chain(1, seed=1)
    a, b = chain(2, seed=2)
    tier.put([x])
    assert keys(tier.put([a, b])) == [x.key]
    assert keys(tier.put(chain(1, seed=3))) == [b.key]
    assert tier.contains([a.key]) == 1


def test_removing_a_tail_makes_its_parent_a_candidate():
    tier = host(3)
    a = chain(3, seed=1)
    tier.put(a)
    assert tier.remove([a[2].key, b"missing" * 4]) == 1
    tier.put(chain(1, seed=2))
    (victim,) = tier.put(chain(1, seed=3))
    assert victim.key == a[1].key


def test_policy_by_name_lfu_differs_from_lru():
    def run(policy: str) -> bytes:
        tier = host(4, policy=policy)
        singles = [chain(1, seed=s)[0] for s in range(4)]
        tier.put(singles)
        for _ in range(3):
            tier.get([singles[0].key])  # p0: many hits, long ago
        for p in singles[1:]:
            tier.get([p.key])  # p1..p3: one hit each, more recently
        (victim,) = tier.put(chain(1, seed=9))
        return victim.key

    singles = [chain(1, seed=s)[0] for s in range(4)]
    assert run("lru") == singles[0].key
    assert run("lfu") == singles[1].key


@pytest.mark.parametrize("policy", ["fifo", "s3fifo", "slru", "arc", "gdsf"])
def test_every_policy_keeps_the_bound(policy):
    tier = host(6, page_size=2, policy=policy)
    out = []
    for s in range(10):
        out += tier.put(chain(2, page_size=2, seed=s))
        st = tier.stats()
        assert st.tokens <= 6 and st.tokens == 2 * st.pages
    assert len(out) == 20 - 3 == tier.stats().evicted_pages


def test_put_of_a_held_page_is_a_no_op():
    tier = host(4)
    pages = chain(2)
    tier.put(pages)
    assert tier.put(pages) == []
    assert tier.stats().stored_pages == 2 and tier.stats().pages == 2


def test_clear_and_close():
    tier = host(8)
    tier.put(chain(4))
    tier.clear()
    assert tier.stats().pages == 0 and tier.stats().tokens == 0
    tier.put(chain(4, seed=5))
    assert tier.stats().pages == 4
    tier.close()
    assert tier.stats().pages == 0


THREADS, CHAINS, LENGTH = 4, 50, 4


@pytest.mark.parametrize("capacity", [THREADS * CHAINS * LENGTH, 64])
def test_concurrent_put_get_from_threads_exact_counts(capacity):
    tier = host(capacity)
    evicted: list[list] = [[] for _ in range(THREADS)]
    hits = [0] * THREADS
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(t: int) -> None:
        try:
            start.wait()
            for c in range(CHAINS):
                pages = chain(LENGTH, seed=t * CHAINS + c + 1)
                evicted[t] += tier.put(pages)
                got = tier.get(keys(pages))
                hits[t] += sum(g is not None for g in got)
                for g, p in zip(got, pages, strict=True):
                    assert g is None or same_page(g, p)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    total = THREADS * CHAINS * LENGTH
    out = [p.key for e in evicted for p in e]
    s = tier.stats()
    assert len(out) == len(set(out)) == s.evicted_pages == total - min(total, capacity)
    assert s.pages == s.tokens == min(total, capacity)
    assert s.stored_pages == total and s.loaded_pages == sum(hits)
    if capacity >= total:
        assert sum(hits) == total
    # what is held and what was pushed out are exactly the stored pages, each once
    held = {
        p.key
        for t in range(THREADS)
        for c in range(CHAINS)
        for p in chain(LENGTH, seed=t * CHAINS + c + 1)
        if tier.contains([p.key])
    }
    assert len(held) == s.pages and not held & set(out)
