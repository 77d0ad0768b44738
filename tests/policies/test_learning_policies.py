"""The learning policies (arc, s3fifo; lhd in test_lhd.py) and the cost-aware gdsf: exact small
scenarios, the feedback a FeedbackEvictionPolicy derives from plain calls, and determinism."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from kvplug.policies import (
    ARCOptions,
    ARCPolicy,
    CostModel,
    GDSFOptions,
    GDSFPolicy,
    LHDPolicy,
    S3FIFOPolicy,
)
from kvplug_hookspecs import CandidateStats, EvictionPolicy, EvictParams, FeedbackEvictionPolicy
from tests.cache_helpers import make_radix, put

LEARNING = ("arc", "s3fifo", "lhd", "olru", "gdsf")


def leaf(now: int, tokens: int = 4, content: int = 0, depth: int = 0) -> CandidateStats:
    c = CandidateStats(now, num_tokens=tokens)
    c.content_id, c.depth = content, depth
    return c


def hit(policy: EvictionPolicy, c: CandidateStats, now: int) -> None:
    c.last_access_time = now
    c.hit_count += 1
    policy.touch(c)


def drain(policy: EvictionPolicy) -> list[CandidateStats]:
    out = []
    while (c := policy.pop()) is not None:
        out.append(c)
    return out


# -- the feedback protocol -------------------------------------------------------------------


class Recorder(FeedbackEvictionPolicy):
    """LRU over a dict, recording every callback."""

    def __init__(self) -> None:
        super().__init__(ghost_capacity=2)
        self.events: list[tuple] = []
        self.members: dict[CandidateStats, None] = {}

    def on_insert(self, c, ghost):
        self.events.append(("insert", c.node_id, ghost and ghost.evicted_at))

    def on_hit(self, c, age):
        self.events.append(("hit", c.node_id, age))

    def on_shrink(self, c, old_tokens, age):
        self.events.append(("shrink", c.node_id, old_tokens, age))

    def on_evict(self, c, age):
        self.events.append(("evict", c.node_id, age))
        return 7

    def on_trim(self, c, freed):
        self.events.append(("trim", c.node_id, freed))

    def _enter(self, c):
        self.members[c] = None

    def _leave(self, c):
        del self.members[c]

    def _update(self, c):
        pass

    def _victim(self, remove):
        if not self.members:
            return None
        c = min(self.members, key=lambda m: (m.last_access_time, m.node_id))
        if remove:
            del self.members[c]
        return c

    def __len__(self):
        return len(self.members)

    def __contains__(self, c):
        return c in self.members

    def _clear(self):
        self.members.clear()


def test_feedback_is_derived_from_plain_calls():
    p = Recorder()
    a, b = leaf(1, content=11), leaf(2, content=22)
    p.add(a)
    p.add(b)
    hit(p, a, 5)  # reused 4 ticks after its insert
    p.discard(a)  # locked: not evictable, still known
    hit(p, a, 9)  # hits on a non-evictable candidate are still reported
    a.num_tokens = 2  # a request matched only its head: the cache split it
    p.add(a)
    assert p.pop() is b  # b (time 2) is older than a (time 9)
    b2 = leaf(12, content=22)  # b's content cached again
    p.add(b2)
    assert p.events == [
        ("insert", a.node_id, None),
        ("insert", b.node_id, None),
        ("hit", a.node_id, 4),
        ("hit", a.node_id, 4),
        ("shrink", a.node_id, 4, 0),
        ("evict", b.node_id, 7),
        ("insert", b2.node_id, 9),  # the ghost of b: evicted at time 9
    ]
    ghost_free = leaf(13, content=99)
    p.add(ghost_free)
    assert p.events[-1] == ("insert", ghost_free.node_id, None)


def test_insert_matches_ghosts_of_content_created_earlier():
    """vLLM offers a block when it is freed, after it was cached: ``add`` sees an old parent,
    ``insert`` an insert (ghost matched, what was known of the object forgotten)."""
    p = Recorder()
    a = leaf(1, content=11)
    p.add(a)
    assert p.pop() is a
    late = leaf(2, content=11)  # a's content cached again at 2, offered at 5
    late.last_access_time = 5
    p.add(late)
    assert p.events[-1] == ("insert", late.node_id, None)  # not created now: no ghost
    assert p.pop() is late
    again = leaf(6, content=11)
    again.last_access_time = 8
    p.insert(again)
    assert p.events[-1] == ("insert", again.node_id, 5)  # late's ghost, evicted at 5
    hit(p, again, 9)
    again.content_id, again.creation_time, again.hit_count = 33, 10, 0  # reused in place
    p.insert(again)  # a new content in a known object: a new insert, no stale hit
    assert p.events[-2:] == [("hit", again.node_id, 1), ("insert", again.node_id, None)]
    assert again in p and len(p) == 1


def test_exact_cut_is_not_a_new_candidate_and_ghosts_are_bounded():
    p = Recorder()
    cs = [leaf(i, content=100 + i) for i in range(1, 5)]
    for c in cs:
        p.add(c)
    victim = p.pop()
    victim.num_tokens = 2  # the cache freed only its tail and re-adds the head
    p.add(victim)
    assert p.events[-1] == ("trim", victim.node_id, 2)  # not evicted, not new, no "shrink"
    for _ in range(3):
        p.pop()
    assert p.ghost_count() == 2  # ghost_capacity


def test_keyed_policies_and_feedback_policies_meet_the_protocol():
    for policy in (ARCPolicy(), S3FIFOPolicy(), LHDPolicy(), GDSFPolicy(), Recorder()):
        assert isinstance(policy, EvictionPolicy)
        assert policy.pop() is None and policy.peek() is None and len(policy) == 0


# -- arc -------------------------------------------------------------------------------------


def test_arc_grows_recency_share_after_a_recency_ghost_hit():
    p = ARCPolicy(ARCOptions(initial_recency_fraction=0.0))
    a, b, c = leaf(1, content=1), leaf(2, content=2), leaf(3, content=3)
    for x in (a, b, c):
        p.add(x)
    hit(p, c, 4)  # c moves to the frequency list T2
    assert p.p == 0.0
    assert p.pop() is a  # T1 holds more than p = 0: its LRU goes (ghost in B1)
    a2 = leaf(5, content=1)  # a comes back: recency was cut too short
    p.add(a2)
    assert p.p == 4.0  # grown by a's size
    # a2 entered T2 (it had a ghost). T1 (b: 4 tokens) is not above p = 4, so T2 goes first
    # in LRU order (c at time 4, a2 at 5); without the ghost hit b would have gone next
    assert drain(p) == [c, a2, b]


def test_arc_shrinks_recency_share_after_a_frequency_ghost_hit():
    p = ARCPolicy(ARCOptions(initial_recency_fraction=1.0))
    a, b = leaf(1, content=1), leaf(2, content=2)
    p.add(a)
    p.add(b)
    hit(p, a, 3)  # a in T2
    start = p.p
    p.discard(b)
    assert p.pop() is a  # only T2 is evictable
    p.add(b)
    p.add(leaf(4, content=1))  # a's content again: frequency was cut too short
    assert p.p < start


# -- s3fifo ----------------------------------------------------------------------------------


def test_s3fifo_demotes_a_one_hit_wonder_and_keeps_the_reused():
    p = S3FIFOPolicy()
    a, b, c = leaf(1, content=1), leaf(2, content=2), leaf(3, content=3)
    for x in (a, b, c):
        p.add(x)
    hit(p, a, 4)  # a is reused while in the small queue
    # S holds everything (> 10%): its head a has a hit and moves to M; b, never reused, goes
    assert p.pop() is b
    assert p.queue_of(a) == "main"
    b2 = leaf(5, content=2)  # b's content again: a ghost hit enters M directly
    p.add(b2)
    assert p.queue_of(b2) == "main"
    assert p.pop() is c  # S still above its share: c (no hit) goes
    assert drain(p) == [a, b2]  # M in FIFO order


def test_s3fifo_gives_main_queue_second_chances():
    p = S3FIFOPolicy()
    a, b = leaf(1, content=1), leaf(2, content=2)
    p.add(a)
    p.add(b)
    hit(p, a, 3)
    hit(p, b, 4)
    assert drain(p) == [a, b]  # both promoted to M in S order, then FIFO with second chances
    x, y = leaf(5, content=7), leaf(6, content=8)
    p.add(x)
    p.add(y)  # both in S (no ghosts)
    hit(p, x, 7)
    hit(p, x, 8)
    assert p.pop() is y


# -- options ---------------------------------------------------------------------------------


def test_gdsf_options_are_validated():
    with pytest.raises(ValidationError, match="quadratic"):
        CostModel(quadratic=-1.0)
    with pytest.raises(TypeError, match="LHDOptions"):
        LHDPolicy(GDSFOptions())  # type: ignore[arg-type]


# -- gdsf ------------------------------------------------------------------------------------


def test_cost_model_is_linear_plus_quadratic_in_depth():
    cost = CostModel(linear=1.0, quadratic=0.5)
    assert cost.tokens_cost(0, 2) == 2 * 1.0 + 0.5 * (0 + 1)
    assert cost.tokens_cost(10, 1) == 1.0 + 0.5 * 10
    assert cost.per_token(4, 3) == 1.0 + 0.5 * 5


def test_gdsf_keeps_deep_and_reused_tokens():
    p = GDSFPolicy(GDSFOptions(cost=CostModel(linear=1.0, quadratic=0.01)))
    shallow, deep, reused = leaf(1, depth=0), leaf(2, depth=1000), leaf(3, depth=0)
    for c in (shallow, deep, reused):
        p.add(c)
    hit(p, reused, 4)
    assert p.pop() is shallow  # 1.0 x 1 < reused 1.0 x 2 < deep 11 x 1
    assert p.inflation > 0
    assert drain(p) == [reused, deep]


# -- through a real cache --------------------------------------------------------------------


def test_radix_fills_features_and_ghosts_match_a_longer_reinsert():
    cache, allocator = make_radix(capacity=400, policy="lhd")
    turn = list(range(100, 170))  # ids cover a content's first 64 tokens
    put(cache, allocator, [1, 2, 3, 4])
    put(cache, allocator, [1, 2, 3, 4, *turn])
    (first,) = cache.policy._live
    first_id = first.content_id
    assert (first.depth, first.num_tokens, first.new_tokens) == (4, 70, 70)
    assert first.content_id != 0
    put(cache, allocator, [1, 2, 3, 4, *turn[:66], 7, 7])  # splits first after 66 tokens
    tail = first
    assert (tail.depth, tail.num_tokens, tail.new_tokens) == (70, 4, 70)
    cache.evict(EvictParams(num_tokens=6))  # both leaves (LRU order: the guard starts in LRU)
    cache.evict(EvictParams(num_tokens=66))
    put(cache, allocator, [1, 2, 3, 4, *turn, 8, 8])  # the same start, longer
    (new,) = cache.policy._live
    assert new.depth == 4 and new.content_id == first_id
    # the matched ghost was taken, and the tail's too: the longer re-insert covers it (lhd)
    assert cache.policy.ghost_count() == 0


def _trace(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[s] * 4 for s in range(3)]
    return [
        rng.choice(systems) + [rng.randrange(6) for _ in range(rng.randrange(1, 7))]
        for _ in range(120)
    ]


@pytest.mark.parametrize("policy", LEARNING)
def test_policies_are_deterministic_through_a_radix_cache(policy):
    def run() -> list[int]:
        cache, allocator = make_radix(capacity=40, policy=policy)
        hits = []
        for tokens in _trace(3):
            m = cache.match_prefix(tokens)
            cache.inc_lock_ref(m.last_node)
            need = len(tokens) - m.prefix_len
            if allocator.available_size() < need:
                cache.evict(EvictParams(num_tokens=need - allocator.available_size()))
            new = allocator.alloc(need)
            cache.insert(tokens, torch.cat([m.device_indices, new]))
            cache.dec_lock_ref(m.last_node)
            hits.append(m.prefix_len)
        return hits

    assert run() == run()
