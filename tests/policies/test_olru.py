"""``olru``: conversation turns inferred from plain calls, ranking by learned reuse odds, the
shadow guard that follows whichever ranking is doing better, determinism."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kvplug.policies import LRUPolicy, OLRUOptions, OLRUPolicy
from kvplug_hookspecs import CandidateStats, EvictParams
from tests.cache_helpers import make_radix, put


def leaf(now: int, depth: int = 0, tokens: int = 4) -> CandidateStats:
    c = CandidateStats(now, num_tokens=tokens)
    c.depth = depth
    return c


def extend(p: OLRUPolicy, parent: CandidateStats, now: int) -> CandidateStats:
    """A request continued ``parent``: it stops being a leaf, its continuation is one."""
    p.discard(parent)
    child = leaf(now, depth=parent.depth + parent.num_tokens)
    p.add(child)
    return child


def test_turns_are_inferred_from_extensions_and_ghosts():
    p = OLRUPolicy(OLRUOptions(guard=False))
    first = leaf(1)
    p.add(first)
    second = extend(p, first, 2)
    third = extend(p, second, 3)
    assert [p.turn_of(c) for c in (first, second, third)] == [0, 1, 2]
    assert p.class_of(third) == 2 * 4  # turn 2+, not a tail, no hits
    # evicted, then the same start comes back: the ghost says it continues a conversation
    lone = leaf(4, depth=100)
    lone.content_id = 77
    p.add(lone)
    while p.pop() is not lone:
        pass
    p.discard(leaf(5, depth=900))  # (settles the eviction)
    again = leaf(6, depth=100)
    again.content_id = 77
    p.add(again)
    assert p.turn_of(again) == 1
    # a cache that knows the turn wins over the inference
    told = leaf(7, depth=5000)
    told.turn = 3
    p.add(told)
    assert p.turn_of(told) == 3


def teach(p: OLRUPolicy, rounds: int) -> int:
    """Each round: a first turn evicted unused, and a continuation reused 10 ticks later."""
    now = 10
    for _ in range(rounds):
        fresh, root = leaf(now, depth=10_000), leaf(now)
        p.add(fresh)
        p.add(root)
        cont = extend(p, root, now + 1)
        cont.last_access_time, cont.hit_count = now + 11, 1
        p.touch(cont)  # reused at age 10
        now += 12
        while p.pop() is not None:
            pass
    return now


def test_learned_odds_keep_an_older_continuation_over_a_younger_first_turn():
    p = OLRUPolicy(OLRUOptions(guard=False, prior=1.0))
    now = teach(p, 70)
    assert p.tau == pytest.approx(10.0)  # the mean age at reuse
    assert p.credit(4) > 0 > p.credit(0)  # turn 1 reused, turn 0 never
    root = leaf(now)
    p.add(root)
    old_continuation = extend(p, root, now + 1)
    young_first = leaf(now + 5, depth=20_000)
    p.add(young_first)
    assert p.pop() is young_first  # LRU would evict the continuation
    lru = LRUPolicy()
    for c in (old_continuation, young_first):
        lru.add(c)
    assert lru.pop() is old_continuation


def test_guard_starts_with_lru_and_follows_the_evidence():
    p = OLRUPolicy()
    assert p.use_learned is False and p.switches == 0
    a, b = leaf(1), leaf(2)
    p.add(a)
    p.add(b)
    p._score(5.0)  # the shadow (learned) ranking got a hit LRU missed
    assert p.use_learned is True and p.switches == 1
    p._score(-20.0)
    assert p.use_learned is False and p.switches == 2
    assert [p.pop(), p.pop(), p.pop()] == [a, b, None]  # both rankings rebuilt from the cache


def replay(trace: list[list[int]], capacity: int, policy: str) -> float:
    cache, allocator = make_radix(capacity=capacity, policy=policy)
    hit = total = 0
    for request in trace:
        tokens = request[: capacity // 2]
        m = cache.match_prefix(tokens)
        cache.inc_lock_ref(m.last_node)
        need = len(tokens) - m.prefix_len
        if allocator.available_size() < need:
            cache.evict(EvictParams(num_tokens=need - allocator.available_size()))
        cache.insert(tokens, torch.cat([m.device_indices, allocator.alloc(need)]))
        cache.dec_lock_ref(m.last_node)
        hit, total = hit + m.prefix_len, total + len(tokens)
    return hit / total


def conversations(n: int, flip_at: int) -> list[list[int]]:
    """Sessions of one system prompt + turns; before ``flip_at`` every continued conversation
    comes back, after it only first turns do (re-sent as is), so the learned odds flip."""
    trace, nxt, sessions = [], 1000, []
    for i in range(n):
        if i < flip_at and sessions and i % 3:
            s = sessions.pop(0)
            s += list(range(nxt, nxt + 3))
            nxt += 3
            trace.append(list(s))
            sessions.append(s)
        elif i >= flip_at and trace and i % 2:
            trace.append(list(trace[i - 7]))
        else:
            s = [0, 1, 2, 3, *range(nxt, nxt + 5)]
            nxt += 5
            trace.append(list(s))
            if i < flip_at:
                sessions.append(s)
            if len(sessions) > 12:
                sessions.pop(0)
    return trace


@pytest.mark.parametrize("capacity", [40, 80, 160, 320])
def test_never_meaningfully_worse_than_lru_when_the_signal_flips(capacity):
    trace = conversations(600, 300)
    lru, olru = replay(trace, capacity, "lru"), replay(trace, capacity, "olru")
    assert olru >= lru - 0.003
    if capacity == 320:  # room to keep conversations: the learned odds pay in the first half
        assert olru > lru


def test_deterministic_and_validated():
    trace = conversations(300, 150)
    assert replay(trace, 60, "olru") == replay(trace, 60, "olru")
    for bad in ({"tau_scale": 0.0}, {"guard_memory": 0}, {"max_credit": -1.0}, {"nope": 1}):
        with pytest.raises(ValidationError):
            OLRUOptions(**bad)
    with pytest.raises(TypeError, match="OLRUOptions"):
        OLRUPolicy(LRUPolicy())  # type: ignore[arg-type]


def test_through_a_radix_cache_a_continuation_is_turn_one():
    cache, allocator = make_radix(capacity=400, policy="olru")
    put(cache, allocator, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    cache.inc_lock_ref(m.last_node)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], torch.cat([m.device_indices, allocator.alloc(2)]))
    cache.dec_lock_ref(m.last_node)
    policy = cache.policy
    (cont,) = list(policy._live)
    assert (cont.depth, policy.turn_of(cont)) == (6, 1)


def test_admission_window_evicts_the_youngest_first_turn_while_the_head_is_young():
    p = OLRUPolicy(OLRUOptions(guard=False, prior=1.0, admission_window=2.0))
    now = teach(p, 70)  # tau = 10
    older, younger = leaf(now, depth=10_000), leaf(now + 3, depth=20_000)
    p.add(older)
    p.add(younger)
    p.now = now + 5  # the head (older) is 5 < 2 x tau ticks old: the youngest goes
    assert p.peek() is younger
    assert p.pop() is younger
    p.add(younger)  # (re-added: a trimmed tail)
    p.now = now + 25  # now older than 2 x tau: plain ranking
    assert p.pop() is older
    q = OLRUPolicy(OLRUOptions(guard=False, prior=1.0, admission_window=0.0))
    now = teach(q, 70)
    older, younger = leaf(now, depth=10_000), leaf(now + 3, depth=20_000)
    q.add(older)
    q.add(younger)
    q.now = now + 5
    assert q.pop() is older  # window off: odds-weighted LRU
