"""``lhd``: learned hit density (after Beckmann et al., "LHD: Improving Cache Hit Rate by
Maximizing Hit Density", NSDI 2018), adapted to leaf-only prefix caches.

A candidate's value is the hits it is still expected to get per token per tick it keeps its
slots. Hits are worth their tokens and occupancy costs tokens, so size cancels for a token hit
rate; ``cost_aware`` weights the density by what recomputing a token at the candidate's depth
costs (:class:`~kvplug.policies.cost.CostModel`). The policy evicts the lowest density.

**What it learns.** Per class of candidate, the distribution of the age at reuse
(:class:`~kvplug.policies.reuse.ReuseModel`): every hit, every request that reused a leaf's head
(the radix cache split it), and every insert matching the ghost of an evicted candidate is a
reuse at an age; entries are counted with their times so recent ones do not bias late ages. The
density of a class at an age is the best ratio of the reuse still to come to the ticks still to
be occupied. Everything adapts during the run (no training file) and is deterministic.

**Classes** (features a prefix cache knows, or that the policy infers):

* the conversation turn: 0, 1, ..., ``turn_classes - 1`` or more. The cache's ``turn`` when the
  engine gives one; otherwise inferred: a new leaf starting where an earlier leaf ended, or where
  a request split one, continues its conversation; a leaf re-inserted after its eviction
  continues the ghost's; and a split's head, when it becomes a leaf again, belongs to the turn
  that split it;
* the size of the request's addition (``new_tokens``), in factors of 4 (``size_classes``);
* hit at least once (``hit_classes``);
* the tail of a split: what a request did not reuse of a leaf (``tail_class``: one class; such
  tails are rarely reused).

On the Mooncake conversation trace a first turn is continued about 30 % of the time, a turn
that continued a conversation 40-75 % (more the longer the conversation), short first turns
least, and no continuation comes much before 100 requests later. LRU ignores all of it.

**Ranking.** Within a class, candidates sit in two heaps by last access. Density first rises with
age (reuse has not begun) and then falls (reuse becomes unlikely), so a class's lowest density
is at its oldest or its youngest member (``ends="both"``; ``"oldest"`` looks only at the
oldest). An eviction compares those two per non-empty class: O(classes + log N). At small
capacities evicting the youngest of a rarely-continued class is what keeps a subset of first
turns long enough to be continued, instead of every one of them too briefly.

**Guard against losing to LRU** (:class:`~kvplug.policies.shadow.ShadowGuard`). The ranking
not in use runs as a shadow, kept as its differences from the cache: candidates it evicted that
are still cached here, and evicted content (whole candidates and cut tails) it still holds. It
holds as many tokens as the cache and follows the tree. A reuse here of what it evicted is
evidence for the ranking in use; an insert re-covering what it still holds is evidence for the
shadow. LRU is in use at the start; the rankings swap when the shadow leads by
``guard_confidence`` standard deviations of the decayed evidence (LRU takes it back at
``guard_fallback``), so the policy falls back to LRU where the learned classes mislead (or the
workload flips) and returns when they help. A regret budget bounds what the decayed test can
miss (few events at a large capacity): once the learned ranking's estimated loss over the run
exceeds ``guard_budget`` of the tokens seen, LRU takes the cache back at once (see
:mod:`.shadow`).

Measured (``benchmarks/bench_policies.py``, Mooncake conversation trace, page 1): 25.1 / 20.4 /
7.4 % of the LRU-Belady gap closed at 1 / 3 / 5 % capacity; on five synthetic workloads up to
+10 points over LRU, and level with or above LRU in all 30 cells. The rest of the gap is
foresight no online feature gives: evicting first exactly what never comes back (knowing
*whether*, not when) reaches a 28.6 % hit rate at 3 % capacity; this ranking with its class
statistics taken from the whole trace in advance, about 16 %, no more than it learns online.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated, Literal, NamedTuple

from pydantic import Field

from kvplug_hookspecs import EvictionCandidate, FeedbackEvictionPolicy, FrozenModel, Ghost

from .cost import CostModel
from .heap import LazyHeap
from .reuse import ReuseModel
from .shadow import Recency, ShadowGuard

__all__ = ["LHDOptions", "LHDPolicy"]


_TAIL = 0  # the class of split tails (when ``tail_class``)
_SIBLINGS = 8  # evicted candidates remembered per start position (the latest)


class LHDOptions(FrozenModel):
    """Options of the ``lhd`` policy."""

    turn_classes: Annotated[int, Field(ge=1, le=16, strict=True)] = 4
    """Classes by conversation turn: 0, 1, ..., ``turn_classes - 1`` or more (1: no turns)."""
    size_classes: Annotated[int, Field(ge=1, le=16, strict=True)] = 10
    """Classes by the tokens the creating request added, one per factor of 4 (1: no sizes)."""
    hit_classes: bool = True
    """A candidate hit at least once is a class of its own."""
    tail_class: bool = True
    """The unused tail of a split leaf is one class."""
    ends: Literal["both", "oldest"] = "both"
    """Which members of each class are weighed: the oldest and the youngest, or the oldest."""
    age_bins: Annotated[int, Field(ge=8, le=256, strict=True)] = 64
    """Age histogram bins (``bins_per_doubling`` per factor of two of age)."""
    bins_per_doubling: Annotated[int, Field(ge=1, le=16, strict=True)] = 4
    smoothing: Annotated[int, Field(ge=0, le=8, strict=True)] = 2
    """Passes of a [1, 2, 1] filter over each class's reuse-age histogram (few reuses in a
    narrow bin must not read as a sure reuse at that age)."""
    prior: Annotated[float, Field(ge=0.0)] = 2.0
    """Pseudo-entries per class at the overall reuse rates (small classes borrow strength)."""
    recompute_every: Annotated[int, Field(ge=8, strict=True)] = 256
    """Entries and reuses between recomputations of the density table (also at the 8th, 16th,
    32nd, ... reuse before): a workload that stops reusing a class is followed too."""
    decay_every: Annotated[int, Field(ge=16, strict=True)] = 8192
    """Reuses between halvings of the learned counts (follows a drifting workload)."""
    exposure_window: Annotated[int, Field(ge=1, strict=True)] = 32768
    """Latest class entries kept with their times (see :mod:`kvplug.policies.reuse`)."""
    cost_aware: bool = False
    """Weight density by the prefill cost per token at the candidate's depth (``cost``)."""
    cost: CostModel = CostModel()
    partial_pages: Literal["rank", "evict_first"] = "rank"
    """``evict_first``: candidates ending in a partial page go before anything else."""
    guard: bool = True
    """Follow LRU whenever it has been doing better (see the module docstring)."""
    guard_start: Literal["lru", "learned"] = "lru"
    """The ranking in use at the start (the guard hands the cache to the other on evidence)."""
    guard_warmup: Annotated[int, Field(ge=0, strict=True)] = 0
    """Scored events before the first switch."""
    guard_memory: Annotated[int, Field(ge=1, strict=True)] = 2000
    """Guard evidence decays by ``1 - 1/guard_memory`` per scored event."""
    guard_confidence: Annotated[float, Field(ge=0.0, le=16.0)] = 2.0
    """The learned ranking takes over from LRU when its lead is this many standard deviations
    of the decayed evidence (switching back and forth on noise costs hits)."""
    guard_fallback: Annotated[float, Field(ge=0.0, le=16.0)] = 1.0
    """LRU takes the cache back when its lead is this many standard deviations (sooner than
    the learned ranking gets it: a loss is what the guard is for)."""
    guard_budget: Annotated[float, Field(ge=0.0, le=1.0)] = 0.001
    """LRU takes the cache back at once when the learned ranking's estimated loss against it
    over the run exceeds this share of the tokens seen (see :mod:`kvplug.policies.shadow`)."""
    ghost_entries: Annotated[int, Field(ge=0, strict=True)] = 16384
    """Evicted candidates remembered (reuse after eviction, the inferred turn, the guard)."""
    lineage_entries: Annotated[int, Field(ge=0, strict=True)] = 4096
    """Recently extended or split candidates remembered to infer the turn of new ones."""


class _Gone(NamedTuple):
    """What the policy keeps of an evicted candidate to credit a reuse that re-covers it."""

    cls: int
    last_access: int
    end: int
    turn: int
    content_id: int


class _Density:
    """The learned ranking over a set of candidates: lowest density at a class's ends."""

    def __init__(self, policy: LHDPolicy) -> None:
        self.policy = policy
        self.oldest: dict[int, LazyHeap] = {}
        self.youngest: dict[int, LazyHeap] = {}
        self.members: dict[EvictionCandidate, int] = {}

    def push(self, candidate: EvictionCandidate, cls: int) -> None:
        old = self.members.get(candidate)
        if old is not None and old != cls:
            self.remove(candidate)
        self.members[candidate] = cls
        oldest = self.oldest.get(cls)
        if oldest is None:
            oldest = self.oldest[cls] = LazyHeap()
            self.youngest[cls] = LazyHeap()
        oldest.push(candidate, candidate.last_access_time)
        self.youngest[cls].push(candidate, -candidate.last_access_time)

    def fill(self, classes: dict[EvictionCandidate, int]) -> None:
        by_class: dict[int, list[EvictionCandidate]] = {}
        for candidate, cls in classes.items():
            self.remove(candidate)  # a member moves to its (maybe new) class
            by_class.setdefault(cls, []).append(candidate)
        for cls, group in by_class.items():
            self.members.update(dict.fromkeys(group, cls))
            if cls not in self.oldest:
                self.oldest[cls], self.youngest[cls] = LazyHeap(), LazyHeap()
            self.oldest[cls].fill((c, c.last_access_time) for c in group)
            self.youngest[cls].fill((c, -c.last_access_time) for c in group)

    def remove(self, candidate: EvictionCandidate) -> None:
        cls = self.members.pop(candidate, None)
        if cls is not None:
            oldest = self.oldest[cls]
            oldest.remove(candidate)
            self.youngest[cls].remove(candidate)
            if not oldest:
                del self.oldest[cls], self.youngest[cls]

    def victim(self) -> EvictionCandidate | None:
        policy = self.policy
        now, density, age_bin = policy.now, policy.model.density, policy.model.bin
        weight = policy.weight if policy.cost_aware else None
        both = policy.options.ends == "both"
        best: EvictionCandidate | None = None
        best_key: tuple[float, int, int] = (0.0, 0, 0)
        for cls, heap in self.oldest.items():
            head = heap.peek()
            if head is None:
                continue
            row = density[cls]
            young = self.youngest[cls].peek() if both else head
            for end in (head,) if young is head or young is None else (head, young):
                last = end.last_access_time
                value = row[age_bin(now - last)]
                if weight is not None:
                    value *= weight(end)
                key = (value, last, end.node_id)
                if best is None or key < best_key:
                    best, best_key = end, key
        return best

    def clear(self) -> None:
        self.oldest.clear()
        self.youngest.clear()
        self.members.clear()

    def __contains__(self, candidate: object) -> bool:
        return candidate in self.members


class LHDPolicy(FeedbackEvictionPolicy):
    """Evict the lowest learned hit density (see the module docstring)."""

    def __init__(self, options: LHDOptions | None = None) -> None:
        if options is None:
            options = LHDOptions()
        if not isinstance(options, LHDOptions):
            raise TypeError(f"lhd options must be LHDOptions, got {type(options).__name__}")
        super().__init__(options, ghost_capacity=options.ghost_entries)
        o = options
        self._turns, self._sizes = o.turn_classes, o.size_classes
        self._per_size = o.turn_classes * (2 if o.hit_classes else 1)
        self._offset = 1 if o.tail_class else 0
        self.model = ReuseModel(
            self._offset + o.size_classes * self._per_size,
            bins=o.age_bins,
            bins_per_doubling=o.bins_per_doubling,
            prior=o.prior,
            exposure_window=o.exposure_window,
            recompute_every=o.recompute_every,
            decay_every=o.decay_every,
            smoothing=o.smoothing,
        )
        """The learned reuse ages and densities per class."""
        self.cost_aware = o.cost_aware
        self._cost = o.cost
        self._partial_first = o.partial_pages == "evict_first"
        self._partial = LazyHeap()  # partial pages, when they go first
        self._live: dict[EvictionCandidate, None] = {}
        self._class: dict[EvictionCandidate, int] = {}  # live (and popped, until settled)
        self._turn: dict[EvictionCandidate, int] = {}
        self._tail: dict[EvictionCandidate, None] = {}
        self._lineage: OrderedDict[tuple[object, int], int] = OrderedDict()
        self._heads: OrderedDict[tuple[object, int], int] = OrderedDict()
        # evicted candidates by where they start, and per evicted content the descendants that
        # were evicted before it (a later insert re-covering both is a reuse of both)
        self._gone: OrderedDict[tuple[object, int], list[_Gone]] = OrderedDict()
        self._below: OrderedDict[int, list[_Gone]] = OrderedDict()
        self._ends: dict[EvictionCandidate, int] = {}  # the end of candidates cut by evictions
        self.use_learned = not o.guard or o.guard_start == "learned"
        """Whether the learned ranking is in use (else LRU; the guard switches)."""
        self._learned = _Density(self)
        self._recency = Recency()
        self.guard: ShadowGuard | None = None
        """The shadow of the ranking not in use (``None`` without ``guard``)."""
        if o.guard:
            self.guard = ShadowGuard(
                self._recency if self.use_learned else self._learned,
                memory=o.guard_memory,
                capacity=o.ghost_entries,
                reference_in_use=not self.use_learned,
            )
        self.switches = 0
        """Times the guard changed ranking."""

    # -- classes -------------------------------------------------------------------------------

    def turn_of(self, candidate: EvictionCandidate) -> int:
        """The candidate's conversation turn: the cache's, or the one inferred (0: none)."""
        return max(candidate.turn, self._turn.get(candidate, 0))

    def class_of(self, candidate: EvictionCandidate, hit_count: int | None = None) -> int:
        """The candidate's class (see the module docstring)."""
        if self._offset and candidate in self._tail:
            return _TAIL
        turn = min(self.turn_of(candidate), self._turns - 1)
        size = min(self._sizes - 1, max(0, candidate.new_tokens.bit_length() - 1) // 2)
        cls = self._offset + size * self._per_size + turn
        if self.options.hit_classes:
            hits = candidate.hit_count if hit_count is None else hit_count
            if hits > 0:
                cls += self._turns
        return cls

    def density(self, candidate: EvictionCandidate, age: int) -> float:
        """The learned hits per token per tick of ``candidate`` at ``age`` (its class's)."""
        value = self.model.density[self.class_of(candidate)][self.model.bin(age)]
        return value * self.weight(candidate) if self.cost_aware else value

    def weight(self, candidate: EvictionCandidate) -> float:
        """Value of a hit per token: the prefill cost per token at the candidate's depth."""
        return self._cost.per_token(candidate.depth, candidate.num_tokens)

    # -- learning ------------------------------------------------------------------------------

    def _entered(self, candidate: EvictionCandidate) -> None:
        self.model.entered(self.class_of(candidate), self.now)

    def _reused(self, cls: int, age: int) -> None:
        self.model.reused(cls, age, self.now)

    def _remember(
        self, table: OrderedDict[tuple[object, int], int], key: tuple[object, int], turn: int
    ) -> None:
        table.pop(key, None)
        table[key] = turn
        if len(table) > self.options.lineage_entries:
            table.popitem(last=False)

    def _check_guard(self) -> None:
        """Swap the rankings when the shadow leads (O(N), rare)."""
        guard, o = self.guard, self.options
        if guard is None or not guard.due(
            handover=o.guard_confidence,
            fallback=o.guard_fallback,
            budget=o.guard_budget,
            warmup=o.guard_warmup,
        ):
            return
        self.use_learned = not self.use_learned
        self.switches += 1
        active = self._active
        active.clear()
        live = {c: self._class[c] for c in self._live if c not in self._partial}
        active.fill(live)
        guard.switched(self._recency if self.use_learned else self._learned, live)

    @property
    def _active(self) -> _Density | Recency:
        return self._learned if self.use_learned else self._recency

    # -- feedback ------------------------------------------------------------------------------

    def on_insert(self, candidate: EvictionCandidate, ghost: Ghost | None) -> None:
        key = (candidate.namespace, candidate.depth)
        turn = self._lineage.pop(key, -1) + 1
        if candidate.creation_time < self.now:  # an inner node became a leaf: a split's head?
            turn = max(turn, self._heads.pop(key, 0))
        if ghost is not None:
            turn = max(turn, (ghost.tag & 0xFF) + 1)
            self._reused(ghost.tag >> 8, ghost.age + self.now - ghost.evicted_at)
            covered = self._recovered(candidate)
            for gone in covered:
                turn = max(turn, gone.turn + 1)
            if self.guard is not None:
                ids = [candidate.content_id, *(gone.content_id for gone in covered)]
                self.guard.returned(ids, candidate.num_tokens)
                self._check_guard()
        if turn:
            self._turn[candidate] = turn
        self._entered(candidate)
        if self.guard is not None and candidate.creation_time >= self.now:
            self.guard.inserted(candidate)
            self._check_guard()

    def on_hit(self, candidate: EvictionCandidate, age: int) -> None:
        self._reused(self.class_of(candidate, candidate.hit_count - 1), age)
        self._entered(candidate)
        self._guard_reuse(candidate, candidate.num_tokens, candidate.num_tokens)

    def on_shrink(self, candidate: EvictionCandidate, old_tokens: int, age: int) -> None:
        # a request reused the head and went on elsewhere: the head's conversation continues
        self._reused(self.class_of(candidate), age)
        turn = self.turn_of(candidate)
        self._remember(self._lineage, (candidate.namespace, candidate.depth), turn)
        head_start = candidate.depth - (old_tokens - candidate.num_tokens)
        self._remember(self._heads, (candidate.namespace, head_start), turn + 1)
        self._guard_reuse(candidate, old_tokens - candidate.num_tokens, old_tokens)
        if self._offset and candidate not in self._tail:
            self._tail[candidate] = None
            self._entered(candidate)
            if candidate in self._live:
                self._update(candidate)

    def on_trim(self, candidate: EvictionCandidate, freed: int) -> None:
        if self.guard is not None:  # only its tail went here
            self.guard.trimmed(candidate, freed, self._class[candidate])
        end = candidate.depth + candidate.num_tokens + freed
        self._ends[candidate] = max(end, self._ends.get(candidate, 0))

    def on_evict(self, candidate: EvictionCandidate, age: int) -> int:
        cls = self._class.pop(candidate, None)
        if cls is None:
            cls = self.class_of(candidate)
        self._tail.pop(candidate, None)
        turn = min(self._turn.pop(candidate, 0), 0xFF)
        if candidate.content_id:
            self._left(candidate, cls, turn)
        else:
            self._ends.pop(candidate, None)
        if self.guard is not None:
            self.guard.evicted(candidate)
        return turn | cls << 8

    def _left(self, candidate: EvictionCandidate, cls: int, turn: int) -> None:
        """Remember an evicted candidate, and the evicted descendants it now covers."""
        namespace, end = candidate.namespace, candidate.depth + candidate.num_tokens
        end = max(end, self._ends.pop(candidate, 0))  # where it ended before exact evictions
        below: list[_Gone] = []
        for child in self._gone.pop((namespace, end), ()):
            below.append(child)
            below.extend(self._below.pop(child.content_id, ()))
        cid = candidate.content_id
        if below:
            self._below[cid] = below
            if len(self._below) > self.ghost_capacity:
                self._below.popitem(last=False)
        gone = _Gone(cls, candidate.last_access_time, end, turn, cid)
        siblings = self._gone.setdefault((namespace, candidate.depth), [])
        siblings.append(gone)
        if len(siblings) > _SIBLINGS:  # e.g. every first turn below one system prompt
            del siblings[0]
        if len(self._gone) > self.ghost_capacity:
            self._gone.popitem(last=False)

    def _recovered(self, candidate: EvictionCandidate) -> list[_Gone]:
        """``candidate`` re-inserts evicted content: credit the evicted descendants it covers
        too (their own ghosts cannot match: their start is inside it). Returns them."""
        key = (candidate.namespace, candidate.depth)
        cid = candidate.content_id
        same = [g for g in self._gone.get(key, ()) if g.content_id != cid]
        if same:
            self._gone[key] = same
        else:
            self._gone.pop(key, None)
        end = candidate.depth + candidate.num_tokens
        covered = [gone for gone in self._below.pop(cid, ()) if gone.end <= end]
        for gone in covered:
            self._reused(gone.cls, self.now - gone.last_access)
            self._ghosts.pop(gone.content_id, None)
        return covered

    def _guard_reuse(self, candidate: EvictionCandidate, tokens: int, fetched: int) -> None:
        if self.guard is not None:
            self.guard.reused(candidate, tokens, fetched)
            self._check_guard()

    # -- ranking -------------------------------------------------------------------------------

    def _enter(self, candidate: EvictionCandidate) -> None:
        self._class[candidate] = cls = self.class_of(candidate)
        self._live[candidate] = None
        if self._partial_first and candidate.partial_page:
            self._partial.push(candidate, candidate.last_access_time)
            return
        self._active.push(candidate, cls)
        if self.guard is not None:
            self.guard.hold(candidate, cls)

    def _leave(self, candidate: EvictionCandidate) -> None:
        if candidate in self._live:
            del self._live[candidate]
            self._class.pop(candidate, None)
            self._partial.remove(candidate)
            self._active.remove(candidate)
            if self.guard is not None:
                self.guard.release(candidate)
            # it stopped being a leaf (extended) or is in use: a new candidate starting where it
            # ends continues its conversation
            end = (candidate.namespace, candidate.depth + candidate.num_tokens)
            self._remember(self._lineage, end, self.turn_of(candidate))

    def _update(self, candidate: EvictionCandidate) -> None:
        self._enter(candidate)

    def _victim(self, remove: bool) -> EvictionCandidate | None:
        victim = self._partial.peek()
        if victim is None:
            victim = self._active.victim()
            if victim is None:
                return None
        if remove:
            self._partial.remove(victim)
            self._active.remove(victim)
            del self._live[victim]
        return victim

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, candidate: object) -> bool:
        return candidate in self._live

    def _clear(self) -> None:
        self._learned.clear()
        self._recency.clear()
        if self.guard is not None:
            self.guard.clear()
        self._partial.clear()
        self._live.clear()
        self._class.clear()
        self._turn.clear()
        self._tail.clear()
        self._lineage.clear()
        self._heads.clear()
        self._gone.clear()
        self._below.clear()
        self._ends.clear()
