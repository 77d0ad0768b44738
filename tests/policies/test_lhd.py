"""``lhd`` and its parts: the reuse-age model (exact densities, the censoring correction), the
shadow guard (token-balanced, tree-consistent evidence), and the policy's ranking, class
inference and guard through a real radix cache."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from kvplug.policies import CostModel, LHDOptions, LHDPolicy
from kvplug.policies.reuse import ReuseModel
from kvplug.policies.shadow import Recency, ShadowGuard
from kvplug_hookspecs import CandidateStats, EvictionPolicy, EvictParams
from tests.cache_helpers import make_radix, put
from tests.policies.test_olru import conversations, replay


def leaf(now: int, tokens: int = 4, content: int = 0, depth: int = 0, turn: int = -1):
    c = CandidateStats(now, num_tokens=tokens)
    c.content_id, c.depth, c.turn = content, depth, turn
    return c


def hit(policy: EvictionPolicy, c: CandidateStats, now: int) -> None:
    c.last_access_time = now
    c.hit_count += 1
    policy.touch(c)


# -- the reuse model -------------------------------------------------------------------------


def exact_model(classes: int = 2) -> ReuseModel:
    return ReuseModel(classes, prior=0.0, smoothing=0, recompute_every=1 << 20)


def test_edges_are_whole_ticks_then_geometric():
    m = exact_model()
    assert m.edges[:12].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 15]
    assert [m.bin(a) for a in (0, 1, 8, 9, 10, 11)] == [0, 1, 7, 8, 8, 9]
    assert m.bin(10**12) == m.bins - 1


def test_density_is_reuse_per_tick_of_occupancy():
    m = exact_model()
    for i in range(20):  # class 0: always reused at age 10; class 1: never
        m.entered(0, i * 20)
        m.entered(1, i * 20)
        m.reused(0, 10, i * 20 + 10)
    m.recompute(1000)
    # from age 0: one reuse per 10 ticks held (9 ticks whole, half of the 2-tick bin of age 10)
    assert m.density[0][0] == pytest.approx(0.1)
    assert m.density[0][m.bin(9)] == pytest.approx(1.0)  # 1 reuse per tick in bin [9, 11)
    assert m.density[0][m.bin(11)] == 0.0  # past the reuse age: nothing more to expect
    assert not any(m.density[1])
    assert m.reuse_probability(0) == pytest.approx(1.0)
    assert m.reuse_probability(1) == 0.0


def test_young_entries_do_not_count_against_late_reuse():
    m = exact_model(1)
    for i in range(10):
        m.entered(0, i)
        m.reused(0, 100, i + 100)
    for i in range(10):
        m.entered(0, 950 + i)  # too young to have been reused at 100 yet
    m.recompute(1000)
    assert m.reuse_probability(0) == pytest.approx(1.0)  # not 0.5
    m2 = ReuseModel(1, prior=0.0, smoothing=0, exposure_window=1)  # every entry "old"
    for i in range(10):
        m2.entered(0, i)
        m2.reused(0, 100, i + 100)
    for i in range(10):
        m2.entered(0, 950 + i)
    m2.recompute(1000)
    assert m2.reuse_probability(0) == pytest.approx(10 / 19)  # only the latest is too young


def test_the_table_is_ready_early_and_counts_decay():
    m = ReuseModel(1, prior=0.0, smoothing=0, recompute_every=256, decay_every=16)
    for i in range(8):
        m.entered(0, i)
        m.reused(0, 3, i + 3)
    assert m.density[0][0] > 0  # recomputed at the 8th reuse, not the 256th
    for i in range(8, 16):
        m.entered(0, i)
        m.reused(0, 3, i + 3)
    assert m._reuses.sum() == pytest.approx(8.0)  # halved at the 16th reuse


# -- the shadow guard ------------------------------------------------------------------------


def guard_over(*cs: CandidateStats) -> ShadowGuard:
    guard = ShadowGuard(Recency(), memory=1 << 30, capacity=100)
    for c in cs:
        guard.hold(c, 0)
    return guard


def test_the_shadow_pays_evicted_tokens_with_its_own_victims():
    small = [leaf(i, tokens=4, content=10 + i) for i in range(1, 4)]  # oldest: the shadow's
    big = leaf(9, tokens=10, content=99)
    guard = guard_over(*small, big)
    guard.evicted(big)  # the cache (another ranking) evicted the young big one
    assert guard.debt == -2  # three 4-token victims paid the 10 tokens
    assert set(guard._watched) == set(small)
    assert guard._phantoms == {99: big}
    guard.returned([99], limit=10)  # big's content back: the shadow would have hit it
    assert guard.score == -10 and guard.switch_due(0.9) and not guard.switch_due(1.1)
    assert guard.debt == -12  # the shadow kept it: the cache fetched 10 tokens it did not
    guard.reused(small[0], 4, 4)  # a hit the shadow missed: evidence for the ranking in use
    assert guard.score == pytest.approx(-6) and guard.debt == -8


def test_the_regret_budget_drops_a_losing_challenger_whatever_the_deviations():
    """While the challenger is in use its evidence is summed undecayed (``gain``); a loss over
    ``budget`` of the tokens seen (by ``fallback`` deviations of that sum) hands the cache back
    at once, and it returns only once half that budget has regrown with the traffic (and it
    leads again)."""
    guard = ShadowGuard(Recency(), memory=1 << 30, capacity=100)
    rules = {"handover": 2.0, "fallback": 0.5, "budget": 0.01}
    for _ in range(5):  # the reference in use: nothing counts against the budget
        guard._evidence(-10.0)
    assert guard.gain == 0.0 and guard.due(**rules)  # the challenger leads by 50 > 2 * 22.4
    guard.switched(Recency(), {})  # the challenger (some learned ranking) in use
    assert not guard.reference_in_use and guard.score == pytest.approx(50.0)
    guard.volume = 1000  # tokens seen: a budget of 10
    for delta in (-4.0, -5.0, -2.0):  # losing (the decayed score is still 39 > 0)
        guard._evidence(delta)
        assert not guard.due(**rules)  # 11 - 0.5 * sqrt(16 + 25 + 4) = 7.6 < 10
    guard._evidence(-6.0)  # 17 - 0.5 * sqrt(81) = 12.5 > 10
    assert guard.gain == -17.0 and guard.due(**rules) and not guard.switch_due(0.5)
    guard.switched(Recency(), {})
    assert guard.reference_in_use and guard.gain == -17.0
    for _ in range(10):  # the challenger leads again, by many deviations
        guard._evidence(-30.0)
    assert guard.switch_due(2.0)
    assert not guard.due(**rules)  # ... but 17 > half the budget of 1000 tokens
    guard.volume = 3400  # the budget regrew: 17 <= 34 / 2
    assert guard.due(**rules)
    guard.reused(leaf(1, tokens=5, content=1), 5, 5)  # a hit: 5 more tokens seen
    assert guard.volume == 3405


def test_a_parent_of_a_phantom_is_an_inner_node_in_the_shadow():
    parent = leaf(1, tokens=8, content=1, depth=0)
    child = leaf(5, tokens=4, content=2, depth=8)  # starts where parent ends
    other = leaf(3, tokens=8, content=3, depth=100)
    guard = guard_over(child, other)
    guard.evicted(child)  # the cache evicted the child; the shadow pays with ``other``
    assert guard._watched == {other: None} and guard._phantoms == {2: child}
    guard.hold(parent, 0)  # a leaf in the cache, an inner node in the shadow
    assert parent not in guard.shadow
    guard.debt = 1
    guard._pay()  # the shadow must evict the child before the parent
    assert guard._phantoms == {} and parent in guard.shadow


def test_the_shadow_keeps_a_cut_tail_below_the_candidate():
    a = leaf(1, tokens=8, content=1, depth=10)
    b = leaf(2, tokens=8, content=2, depth=50)
    guard = guard_over(a, b)
    b.num_tokens = 5  # the cache cut b's tail; the shadow pays 3 tokens its way (a)
    guard.trimmed(b, 3, 0)
    assert guard._watched == {a: None} and guard.debt == -5
    assert set(guard._tails) == {(None, 55)}
    guard.hold(b, 0)  # b is re-added here: an inner node there, above its tail
    assert b not in guard.shadow
    c = leaf(3, tokens=4, content=3, depth=55)  # b's continuation starts where it was cut
    guard.inserted(c)
    assert guard.score == -3  # the shadow would have hit the tail
    assert b in guard.shadow and not guard._tails
    a.num_tokens = 6
    guard.trimmed(a, 2, 0)  # cut here, already evicted there: only the debt
    assert not guard._tails and guard.debt == -5 + 2 - 3


# -- the policy ------------------------------------------------------------------------------


def exact_lhd(**options) -> LHDPolicy:
    base = {"guard": False, "prior": 0.0, "smoothing": 0, "size_classes": 1}
    return LHDPolicy(LHDOptions(**{**base, **options}))


def teach(p: LHDPolicy, now: int, rounds: int = 20) -> int:
    """Later turns (turn 1) are reused 10 ticks after their insert; first turns never."""
    for i in range(rounds):
        first, later = leaf(now, content=1000 + 2 * i), leaf(now, content=1001 + 2 * i, turn=1)
        p.add(first)
        p.add(later)
        hit(p, later, now + 10)
        p.discard(later)  # extended by its next turn: no longer a leaf
        p.discard(first)
        now += 11
    p.model.recompute(now + 1000)
    return now + 1000


def test_lhd_ranks_by_learned_density_not_recency():
    p = exact_lhd()
    now = teach(p, 1)
    later_turn, first_turn = leaf(0, turn=1), leaf(0)
    assert p.density(first_turn, 3) == 0.0
    assert p.density(later_turn, 0) == pytest.approx(0.1)  # 1 reuse per 10 ticks held
    old_later = leaf(now - 5, content=7, turn=1)
    young_first = leaf(now - 1, content=8)
    p.add(old_later)
    p.add(young_first)
    assert p.pop() is young_first  # LRU would evict old_later
    assert p.pop() is old_later


def test_lhd_evicts_the_youngest_of_a_class_reused_only_late():
    p = exact_lhd(turn_classes=1, hit_classes=False)
    now = 1
    for i in range(20):  # reused exactly at age 100, half of them
        c = leaf(now, content=5000 + i)
        p.add(c)
        if i % 2 == 0:
            hit(p, c, now + 100)
        p.discard(c)
        now += 101
    p.model.recompute(now)
    old, young = leaf(now - 90, content=1), leaf(now - 1, content=2)
    p.add(old)
    p.add(young)
    assert p.density(old, 90) > p.density(young, 1)
    assert p.pop() is young  # it has 99 ticks to wait; old has 10
    q = exact_lhd(turn_classes=1, hit_classes=False, ends="oldest")
    q.model = p.model
    q.now = p.now
    q.add(old)
    q.add(young)
    assert q.pop() is old


def test_lhd_cost_aware_weights_density_by_depth():
    p = exact_lhd(cost_aware=True, cost=CostModel(linear=1.0, quadratic=0.5))
    teach(p, 1)
    shallow, deep = leaf(0, turn=1, depth=0), leaf(0, turn=1, depth=10)
    assert p.density(deep, 0) == pytest.approx(p.density(shallow, 0) * (1 + 0.5 * 11.5) / 1.75)


def test_lhd_partial_pages_first():
    p = LHDPolicy(LHDOptions(partial_pages="evict_first"))
    a, b = leaf(1), leaf(2)
    b.partial_page = True
    p.add(a)
    p.add(b)
    assert [p.pop(), p.pop(), p.pop()] == [b, a, None]
    assert LHDOptions().partial_pages == "rank"


def test_lhd_options_are_validated():
    for bad in (
        {"turn_classes": 0},
        {"size_classes": 17},
        {"recompute_every": 4},
        {"guard_memory": 0},
        {"ends": "middle"},
        {"nope": 1},
    ):
        with pytest.raises(ValidationError):
            LHDOptions(**bad)
    with pytest.raises(TypeError, match="LHDOptions"):
        LHDPolicy(CostModel())  # type: ignore[arg-type]


# -- through a radix cache -------------------------------------------------------------------


def test_turns_are_inferred_from_extensions_splits_and_ghosts():
    cache, allocator = make_radix(capacity=400, policy="lhd")
    p = cache.policy
    system = [1, 2, 3, 4]
    first = list(range(100, 140))
    put(cache, allocator, system + first)
    (c0,) = p._live
    assert p.turn_of(c0) == 0
    put(cache, allocator, system + first[:-2] + [7, 7, 7])  # split: the head reused
    new = next(c for c in p._live if c is not c0)
    assert (new.depth, c0.depth) == (42, 42)  # both below the reused head
    assert p.turn_of(new) == 1  # the new leaf continues the conversation
    assert p.class_of(c0) == 0  # the unused tail of the split: the tail class
    assert p.class_of(new) != 0
    # the conversation's turn-1 leaf evicted, then its next turn re-inserts it, longer
    cache.evict(EvictParams(num_tokens=5))
    put(cache, allocator, system + first[:-2] + [7, 7, 7, 8, 8])
    assert max(p.turn_of(c) for c in p._live) == 2


def test_a_reinsert_credits_the_evicted_content_it_covers():
    cache, allocator = make_radix(capacity=400, policy="lhd")
    p = cache.policy
    put(cache, allocator, [1, 2, *range(10, 30)])  # turn 0
    put(cache, allocator, [1, 2, *range(10, 30), *range(40, 60)])  # turn 1 extends it
    reuses = p.model.reuse_events
    cache.evict(EvictParams(num_tokens=20))  # turn 1's leaf
    cache.evict(EvictParams(num_tokens=22))  # then turn 0's (a leaf again)
    put(cache, allocator, [1, 2, *range(10, 30), *range(40, 60), 9])  # both come back
    assert p.model.reuse_events == reuses + 2  # turn 0's ghost, and turn 1's under it
    assert max(p.turn_of(c) for c in p._live) == 2


def chat_trace(n: int, seed: int = 2) -> list[list[int]]:
    """Multi-turn chats under one system prompt, exponential think times, every turn continued
    with probability 0.7: no class of turn is likelier to come back (LRU's best case)."""
    rng, next_id = random.Random(seed), [5]

    def take(k: int) -> list[int]:
        next_id[0] += k
        return list(range(next_id[0] - k, next_id[0]))

    system, events = take(8), []
    while len(events) < n:
        t, history = rng.uniform(0, n), list(system)
        while True:
            history = history + take(rng.randint(2, 8))
            events.append((t, list(history)))
            history += take(rng.randint(2, 6))
            t += rng.expovariate(1 / 60)
            if rng.random() < 0.3:
                break
    events.sort(key=lambda e: e[0])
    return [p for _, p in events][:n]


def replay_hits(
    trace: list[list[int]], capacity: int, policy: str, **options
) -> tuple[int, object]:
    cache, allocator = make_radix(capacity=capacity, policy=policy, **options)
    hits = 0
    for tokens in trace:
        m = cache.match_prefix(tokens)
        cache.inc_lock_ref(m.last_node)
        need = len(tokens) - m.prefix_len
        if allocator.available_size() < need:
            cache.evict(EvictParams(num_tokens=need - allocator.available_size()))
        cache.insert(tokens, torch.cat([m.device_indices, allocator.alloc(need)]))
        cache.dec_lock_ref(m.last_node)
        hits += m.prefix_len
    return hits, cache.policy


def test_the_guard_keeps_lru_where_the_learned_classes_mislead():
    trace = chat_trace(1500)
    lru, _ = replay_hits(trace, 591, "lru")
    guarded, policy = replay_hits(trace, 591, "lhd")
    unguarded, _ = replay_hits(trace, 591, "lhd", guard=False)
    assert (lru, unguarded) == (24369, 24113)  # per-turn noise costs hits: turns mean nothing
    assert guarded == lru and policy.switches == 0  # the shadow's evidence never favoured it
    assert replay_hits(trace, 591, "lhd")[0] == guarded  # deterministic


def test_the_guard_hands_over_to_the_learned_ranking_when_it_leads():
    rng = random.Random(1)
    prompts = [[s] * 16 for s in range(100, 130)]  # shared prompts, Zipf-like popularity
    weights = [1 / (r + 1) for r in range(len(prompts))]
    next_id, trace = 1000, []
    for _ in range(1500):
        suffix = list(range(next_id, next_id + rng.randint(2, 8)))  # unique: never reused
        next_id += 8
        trace.append(rng.choices(prompts, weights)[0] + suffix)
    lru, _ = replay_hits(trace, 200, "lru")
    guarded, policy = replay_hits(trace, 200, "lhd")
    assert policy.use_learned and policy.switches == 1
    assert (lru, guarded) == (13540, 16340)  # the unique suffixes go first, the prompts stay


@pytest.mark.parametrize("capacity", [30, 40, 50, 60, 80])
def test_never_meaningfully_worse_than_lru_when_the_signal_flips(capacity):
    """olru's adversarial trace: continued conversations come back in the first half, only
    re-sent first turns in the second. The model re-learns (its table follows entries, not only
    reuses) and the guard follows whichever ranking leads."""
    trace = conversations(600, 300)
    lru, lhd = replay(trace, capacity, "lru"), replay(trace, capacity, "lhd")
    assert lhd >= lru - 0.003
