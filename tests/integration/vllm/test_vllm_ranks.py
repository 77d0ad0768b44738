"""Each block rank makes exactly its policy's choices on the same candidates.

The rank reads per-block lists; the policy gets one candidate object per cached content. Both
see the same life of every block, as the vLLM queue drives them: cached (new content, or content
evicted earlier computed again, in any block: the ghosts' case), hit while in use, freed (its
recency), offered or withdrawn as a candidate, taken back by a request, or evicted by ``pop``.
Needs no vLLM. Each machine runs twice: on the compiled heaps (``kvplug._speedups.BlockHeap``,
where it was built) and on the Python reference heaps.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvplug import get_registry, speedups
from kvplug.integrations.vllm.ranks import (
    ARCRank,
    BlockStats,
    BlockTable,
    KeyedRank,
    PolicyRank,
    S3FIFORank,
    rank_for,
)
from kvplug.policies.builtin import LFUPolicy, SLRUOptions, SLRUPolicy

pytestmark = pytest.mark.vllm

RANKED = ["lru", "lfu", "slru", "priority", "s3fifo", "arc"]
N = 5


def new_policy(name: str, **options: Any) -> Any:
    registration = get_registry().get("eviction_policy", name)
    return registration.factory(registration.options_model(**options))


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("lru", KeyedRank),
        ("lfu", KeyedRank),
        ("slru", KeyedRank),
        ("priority", KeyedRank),
        ("s3fifo", S3FIFORank),
        ("arc", ARCRank),
    ],
)
def test_rank_for_builtin_policies(name: str, kind: type) -> None:
    was = speedups.native_enabled()
    try:
        speedups.use_native(False)  # the reference
        assert type(rank_for(new_policy(name), BlockTable(4))) is kind
        if speedups.use_native(True):  # the compiled versions
            native = "BlockHeap" if kind is KeyedRank else kind.__name__
            assert type(rank_for(new_policy(name), BlockTable(4))) is speedups.native_type(native)
    finally:
        speedups.use_native(was)


def test_no_rank_for_subclasses_and_other_policies() -> None:
    class MyLFU(LFUPolicy):
        pass

    assert rank_for(MyLFU(), BlockTable(4)) is None
    assert rank_for(new_policy("fifo"), BlockTable(4)) is None


def test_lfu_and_slru_keys() -> None:
    """Fewest hits first, then least recently freed; slru: under ``protected_hits`` first."""
    for policy, expected in (
        (LFUPolicy(), [3, 1, 2, 4]),
        # slru: 1, 2 and 3 are probationary (under 2 hits), in LRU order; 4 is protected
        (SLRUPolicy(SLRUOptions(protected_hits=2)), [1, 2, 3, 4]),
    ):
        table = BlockTable(5)
        rank = rank_for(policy, table)
        assert rank is not None
        for block_id, (hits, last) in {1: (1, 10), 2: (1, 20), 3: (0, 30), 4: (2, 5)}.items():
            table.created[block_id], table.hits[block_id] = 1, hits
            table.last[block_id] = last
            rank.add(block_id)
        assert [rank.pop() for _ in range(5)] == [*expected, -1]


class RankAgainstPolicy(RuleBasedStateMachine):
    """One rank and its policy (through :class:`PolicyRank`, fresh stats per content)."""

    def __init__(self) -> None:
        super().__init__()
        self.state = ["new"] * N  # new, used, free (not a candidate), in, evicted

    name = "lru"
    options: ClassVar[dict[str, Any]] = {}
    native = True  # the compiled heaps (where built), else the Python reference

    @initialize()
    def start(self) -> None:
        name = self.name
        self.table = BlockTable(N)
        was = speedups.native_enabled()
        speedups.use_native(self.native)  # the rank's heaps are chosen when it is made
        try:
            self.rank = rank_for(new_policy(name, **self.options), self.table)
        finally:
            speedups.use_native(was)
        self.reference = _FreshPolicyRank(
            BlockTable(N), new_policy(name, **self.options), [None] * N
        )
        self.clock = 0
        self.gone: list[Any] = []  # contents evicted so far

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def both(self, update: Any) -> None:
        update(self.table)
        update(self.reference.table)

    @rule(
        block=st.integers(1, N - 1),
        tokens=st.sampled_from([0, 16, 16, 32]),
        back=st.integers(-3, 5),
    )
    def cache(self, block: int, tokens: int, back: int) -> None:
        """New content, or (``back >= 0``) content evicted earlier, computed again."""
        if self.state[block] not in ("new", "used", "evicted"):
            return
        now = self.tick()
        content = self.gone[-1 - back % len(self.gone)] if back >= 0 and self.gone else (block, now)

        def renew(table: BlockTable) -> None:
            table.created[block] = table.last[block] = now
            table.hits[block], table.tokens[block] = 0, tokens
            table.content[block] = content

        self.both(renew)
        self.reference.renew(block)
        self.state[block] = "used"

    @rule(block=st.integers(1, N - 1))
    def hit(self, block: int) -> None:
        if self.state[block] != "used":
            return
        now = self.tick()

        def hit(table: BlockTable) -> None:
            table.hits[block] += 1
            table.last[block] = now

        self.both(hit)

    @rule(block=st.integers(1, N - 1), join=st.booleans())
    def free(self, block: int, join: bool) -> None:
        if self.state[block] != "used":
            return
        now = self.tick()

        def free(table: BlockTable) -> None:
            table.last[block] = now

        self.both(free)
        self.state[block] = "free"
        if join:
            self.join(block)

    @rule(block=st.integers(1, N - 1))
    def join(self, block: int) -> None:
        if self.state[block] == "free":
            self.rank.add(block)
            self.reference.add(block)
            self.state[block] = "in"

    @rule(block=st.integers(1, N - 1))
    def leave(self, block: int) -> None:
        """No longer a candidate, still free (it gained a cached successor)."""
        if self.state[block] == "in":
            self.rank.discard(block)
            self.reference.discard(block)
            self.state[block] = "free"

    @rule(block=st.integers(1, N - 1))
    def take(self, block: int) -> None:
        """A request reuses the free cached block (vLLM's ``touch``): a hit."""
        if self.state[block] not in ("free", "in"):
            return
        self.rank.discard(block)
        self.reference.discard(block)
        self.state[block] = "used"
        self.hit(block)

    @rule(with_add=st.integers(0, N - 1))
    def pop(self, with_add: int) -> None:
        if with_add and self.state[with_add] == "free":
            got, expected = self.rank.pushpop(with_add), self.reference.pushpop(with_add)
            self.state[with_add] = "in"
        else:
            got, expected = self.rank.pop(), self.reference.pop()
        assert got == expected
        if got >= 0:
            self.state[got] = "evicted"
            self.gone.append(self.table.content[got])

    @invariant()
    def same_candidates(self) -> None:
        assert len(self.rank) == len(self.reference)
        assert self.rank.peek() == self.reference.peek()
        assert all((b in self.rank) == (self.state[b] == "in") for b in range(N))
        if self.name == "arc":
            assert self.rank.p == self.reference.policy.p


class _FreshPolicyRank(PolicyRank):
    """:class:`PolicyRank` with a new candidate object per content (the policy's own view)."""

    def __init__(self, table: BlockTable, policy: Any, blocks: list[Any]) -> None:
        super().__init__(table, policy, blocks)
        self.table = table

    def renew(self, block_id: int) -> None:
        self._stats[block_id] = BlockStats(block_id, 0, 0)
        self._stamp[block_id] = 0

    def stats(self, block_id: int) -> BlockStats | None:
        table = self._table
        stats = self._stats[block_id]
        if stats is None:
            return None
        if self._stamp[block_id] != table.created[block_id]:
            self._stamp[block_id] = table.created[block_id]
            stats.creation_time = table.created[block_id]
            stats.num_tokens = table.tokens[block_id]
            stats.content_id = hash(table.content[block_id])
        stats.last_access_time = table.last[block_id]
        stats.hit_count = table.hits[block_id]
        return stats


def _machine(name: str, native: bool = True, **options: Any) -> Any:
    machine = type(
        f"RankAgainst_{name}{'' if native else '_python'}",
        (RankAgainstPolicy,),
        {"name": name, "options": options, "native": native},
    )
    test = machine.TestCase
    test.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
    return test


TestLRURank = _machine("lru")
TestLFURank = _machine("lfu")
TestSLRURank = _machine("slru")
TestPriorityRank = _machine("priority")
TestS3FIFORank = _machine("s3fifo")
TestARCRank = _machine("arc")
# ghosts bounded as the policies bound them: the oldest are forgotten first
TestS3FIFORankFewGhosts = _machine("s3fifo", ghost_entries=2)
TestARCRankFewGhosts = _machine("arc", ghost_entries=2)
TestARCRankNoGhosts = _machine("arc", ghost_entries=0, initial_recency_fraction=0.25)
# the same on the Python reference heaps
TestLRURankPython = _machine("lru", native=False)
TestLFURankPython = _machine("lfu", native=False)
TestSLRURankPython = _machine("slru", native=False)
TestS3FIFORankPython = _machine("s3fifo", native=False)
TestARCRankPython = _machine("arc", native=False)
TestARCRankFewGhostsPython = _machine("arc", native=False, ghost_entries=2)
