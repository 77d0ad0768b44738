"""``lhd``: learned hit density (after Beckmann et al., "LHD: Improving Cache Hit Rate by
Maximizing Hit Density", NSDI 2018), adapted to leaf-only prefix caches.

A candidate's value is the hits it is still expected to get per unit of time it keeps its slots
occupied. LHD learns, online and per class of candidate, how reuse depends on age (ticks since
the last access): every hit adds an event "reused at age a", every eviction an event "left at age
a without reuse", and an insert of content that was evicted earlier (a ghost) turns that
eviction into a hit at the longer age. From the event histograms it computes, per class and age
bin, ``density = E[hits after age a] / E[remaining lifetime after age a]`` and evicts the
candidate with the lowest density. Hits are worth their tokens and occupancy costs tokens, so
size cancels for a token hit rate; ``cost_aware`` weights a candidate's density by what
recomputing a token at its depth costs (:class:`~kvplug.policies.cost.CostModel`).

Classes are hit-count buckets (0, 1, ..., ``hit_classes - 1`` or more), optionally times depth
buckets (``depth_classes``) and "split" (``split_classes``: a request reused only the head of
the leaf). Within a class candidates sit in a heap by last access. Past the typical reuse age
density falls with age, so a class's oldest member is its candidate (``ends="oldest"``, the
default); ``ends="both"`` also weighs its youngest (density rising, then falling, with age: it
can stop admitting fresh content at small capacities, and measured worse than LRU at larger
ones). An eviction compares one or two heads per class, O(classes + log N). Densities are
recomputed every ``recompute_every`` events and the histograms decay, so the policy follows a
drifting workload. Everything is a function of the call sequence: deterministic.

**Guard against losing to LRU.** The global LRU victim is the oldest of the heads, so every
eviction knows both choices for free. When they differ, the candidate one ranking keeps and the
other would evict is watched: a hit on a candidate kept only by the learned ranking, or an
insert matching the ghost of one the LRU ranking evicted, scores for the learned ranking; a hit
on a candidate kept only by LRU, or a ghost of one the learned ranking evicted, scores for LRU.
The policy uses whichever ranking leads (decayed score; LRU at the start, and until
``guard_warmup`` events were scored; the learned ranking needs a lead of ``guard_margin`` of
all evidence), and keeps scoring the other one in the shadow, so it switches back when the
signal flips. An exact eviction that frees only a candidate's tail is watched the same way: a
later reuse of the head means the tail would have been reused.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field

from kvplug_hookspecs import EvictionCandidate, FeedbackEvictionPolicy, FrozenModel, Ghost

from .cost import CostModel
from .heap import LazyHeap

__all__ = ["LHDOptions", "LHDPolicy"]

_LEARNED_EVICTED = 1  # ghost tag bits: this eviction was the learned ranking's deviation
_LRU_EVICTED = 2  # ... or LRU's (the learned ranking would have kept it)


class LHDOptions(FrozenModel):
    """Options of the ``lhd`` policy."""

    hit_classes: Annotated[int, Field(ge=1, le=16, strict=True)] = 3
    """Classes by hit count: 0, 1, ..., ``hit_classes - 1`` or more."""
    depth_classes: Annotated[int, Field(ge=1, le=8, strict=True)] = 1
    """Classes by depth: below 1k tokens, then one per factor of 4 (a conversation's turns go
    deeper; a first turn right below a system prompt is less often continued)."""
    split_classes: bool = False
    """A leaf a request matched only the head of (its tail diverged) is its own class."""
    age_bins: Annotated[int, Field(ge=8, le=256, strict=True)] = 80
    """Age histogram bins (``bins_per_doubling`` per factor of two of age)."""
    bins_per_doubling: Annotated[int, Field(ge=1, le=16, strict=True)] = 4
    recompute_every: Annotated[int, Field(ge=1, strict=True)] = 256
    """Events (hits + evictions) between recomputations of the density table."""
    decay: Annotated[float, Field(gt=0.0, le=1.0)] = 0.9
    """Factor the histograms are multiplied by at each recomputation (forgets old behaviour)."""
    min_events: Annotated[float, Field(ge=0.0)] = 8.0
    """Ages with fewer (decayed) events at or beyond them have density 0: evicted oldest first."""
    prior: Annotated[float, Field(ge=0.0)] = 0.1
    """Weight of all classes' events added to each class's (small classes borrow strength)."""
    cost_aware: bool = False
    """Weight density by the prefill cost per token at the candidate's depth (``cost``)."""
    cost: CostModel = CostModel()
    partial_pages: Literal["rank", "evict_first"] = "rank"
    """``evict_first``: candidates ending in a partial page go before anything else."""
    deviate_below: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5
    """Evict another candidate than LRU's only when its density is below this share of the LRU
    victim's (a confident model overrules recency; a noisy one does not)."""
    guard: bool = True
    """Follow LRU whenever it has been doing better (see the module docstring)."""
    guard_memory: Annotated[int, Field(ge=1, strict=True)] = 2000
    """Guard evidence decays by ``1 - 1/guard_memory`` per scored event."""
    guard_margin: Annotated[float, Field(ge=0.0, le=1.0)] = 0.3
    """The learned ranking takes over only when its evidence leads by this share of all scored
    evidence; LRU takes over as soon as it leads."""
    guard_warmup: Annotated[int, Field(ge=0, strict=True)] = 2000
    """Scored events before the learned ranking may take over at all."""
    ghost_entries: Annotated[int, Field(ge=0, strict=True)] = 16384
    """Evicted candidates remembered (to learn reuse after eviction, and for the guard)."""


class LHDPolicy(FeedbackEvictionPolicy):
    """Evict the lowest learned hit density (see the module docstring)."""

    def __init__(self, options: LHDOptions | None = None) -> None:
        if options is None:
            options = LHDOptions()
        if not isinstance(options, LHDOptions):
            raise TypeError(f"lhd options must be LHDOptions, got {type(options).__name__}")
        super().__init__(options, ghost_capacity=options.ghost_entries)
        o = options
        self._hit_classes = o.hit_classes
        self._depth_classes = o.depth_classes
        self._classes = o.hit_classes * o.depth_classes * (2 if o.split_classes else 1)
        self._bins = o.age_bins
        self._per_doubling = o.bins_per_doubling
        self._partial_first = o.partial_pages == "evict_first"
        self._cost = o.cost if o.cost_aware else None
        self._heaps = [LazyHeap() for _ in range(self._classes + 1)]  # the last: partial pages
        self._young = [LazyHeap() for _ in range(self._classes)]  # youngest first
        self._heap_of: dict[EvictionCandidate, int] = {}
        self._split: dict[EvictionCandidate, None] = {}
        self._split_classes = o.split_classes
        self._rep = [2.0 ** (b / self._per_doubling) - 1.0 for b in range(self._bins)]
        self._hits = [[0.0] * self._bins for _ in range(self._classes)]
        self._ends = [[0.0] * self._bins for _ in range(self._classes)]
        self._density = [[0.0] * self._bins for _ in range(self._classes)]
        self._events = 0
        self._guard = o.guard
        self._keep = 1.0 - 1.0 / o.guard_memory
        self.score = 0.0
        self._scale = 0.0
        self._scored = 0
        """Decayed evidence for the learned ranking over LRU (tokens; > 0: learned leads)."""
        self.use_learned = not o.guard
        self._kept_by_learned: dict[EvictionCandidate, None] = {}
        self._kept_by_lru: dict[EvictionCandidate, None] = {}
        self._deviation = 0
        # candidates whose tail a deviating eviction cut (the cache kept the head): a later reuse
        # of the head means the tail would have been reused too
        self._cut: dict[EvictionCandidate, tuple[int, int]] = {}

    # -- classes, bins and values --------------------------------------------------------------

    def class_of(self, candidate: EvictionCandidate, hit_count: int | None = None) -> int:
        """The candidate's class: hit-count bucket x depth bucket (x split or not)."""
        hits = candidate.hit_count if hit_count is None else hit_count
        cls = min(max(hits, 0), self._hit_classes - 1)
        if self._depth_classes > 1:
            depth = max(0, candidate.depth.bit_length() - 9) // 2  # <1k, <4k, <16k, ...
            cls = cls * self._depth_classes + min(self._depth_classes - 1, depth)
        if self._split_classes:
            cls = cls * 2 + (candidate in self._split)
        return cls

    def _bin(self, age: int) -> int:
        if age <= 0:
            return 0
        return min(self._bins - 1, int(self._per_doubling * math.log2(1 + age)))

    def _weight(self, candidate: EvictionCandidate) -> float:
        """Value of a hit per token (1, or the prefill cost per token at its depth)."""
        cost = self._cost
        if cost is None:
            return 1.0
        return cost.per_token(candidate.depth, candidate.num_tokens)

    def density(self, candidate: EvictionCandidate, age: int) -> float:
        """The learned hits per unit of time of ``candidate`` at ``age`` (its class's)."""
        return self._density[self.class_of(candidate)][self._bin(age)]

    # -- learning ------------------------------------------------------------------------------

    def _event(self) -> None:
        self._events += 1
        if self._events % self.options.recompute_every == 0:
            self._recompute()

    def _recompute(self) -> None:
        """Density per class and age bin from the decayed event histograms (LHD's recurrence)."""
        bins, rep, prior = self._bins, self._rep, self.options.prior
        all_hits = [sum(h[b] for h in self._hits) for b in range(bins)]
        all_ends = [sum(e[b] for e in self._ends) for b in range(bins)]
        for c in range(self._classes):
            hits, ends, density = self._hits[c], self._ends[c], self._density[c]
            hit_tail = event_tail = life_tail = 0.0
            for b in range(bins - 1, -1, -1):
                h = hits[b] + prior * all_hits[b]
                e = h + ends[b] + prior * all_ends[b]
                hit_tail += h
                event_tail += e
                life_tail += e * rep[b]
                # expected ticks still to be spent by a candidate now at age rep[b] (+1 per event)
                remaining = life_tail - event_tail * rep[b] + event_tail
                # too few events this old to trust: rank as worthless (oldest goes first)
                enough = event_tail >= self.options.min_events
                density[b] = hit_tail / remaining if enough and remaining > 0 else 0.0
            decay = self.options.decay
            for b in range(bins):
                hits[b] *= decay
                ends[b] *= decay

    def _score(self, delta: float) -> None:
        self.score = self.score * self._keep + delta
        self._scale = self._scale * self._keep + abs(delta)
        self._scored += 1
        margin = self.options.guard_margin * self._scale
        if self.score > margin and self._scored >= self.options.guard_warmup:
            self.use_learned = True
        elif self.score < 0:
            self.use_learned = False

    # -- feedback ------------------------------------------------------------------------------

    def on_insert(self, candidate: EvictionCandidate, ghost: Ghost | None) -> None:
        if ghost is None:
            return
        # evicted too early: it would have been a hit at the longer age
        cls = ghost.tag & 0xFF
        ends = self._ends[cls]
        b = self._bin(ghost.age)
        ends[b] = max(0.0, ends[b] - 1.0)
        self._hits[cls][self._bin(ghost.age + self.now - ghost.evicted_at)] += 1.0
        self._event()
        deviation = ghost.tag >> 8
        if self._guard and deviation:
            value = ghost.num_tokens * self._weight(candidate)
            self._score(-value if deviation == _LEARNED_EVICTED else value)

    def on_hit(self, candidate: EvictionCandidate, age: int) -> None:
        cls = self.class_of(candidate, candidate.hit_count - 1)
        self._reused(cls, candidate, age, candidate.num_tokens)

    def _reused(self, cls: int, candidate: EvictionCandidate, age: int, tokens: int) -> None:
        self._hits[cls][self._bin(age)] += 1.0
        self._event()
        if self._guard:
            cut = self._cut.pop(candidate, None)
            if cut is not None:
                value = cut[1] * self._weight(candidate)
                self._score(-value if cut[0] == _LEARNED_EVICTED else value)
            if candidate in self._kept_by_learned:
                del self._kept_by_learned[candidate]
                self._score(tokens * self._weight(candidate))
            elif candidate in self._kept_by_lru:
                del self._kept_by_lru[candidate]
                self._score(-tokens * self._weight(candidate))

    def on_evict(self, candidate: EvictionCandidate, age: int) -> int:
        cls = self.class_of(candidate)
        self._ends[cls][self._bin(age)] += 1.0
        self._event()
        self._kept_by_learned.pop(candidate, None)
        self._kept_by_lru.pop(candidate, None)
        self._split.pop(candidate, None)
        self._cut.pop(candidate, None)
        tag, self._deviation = cls | self._deviation << 8, 0
        return tag

    def on_trim(self, candidate: EvictionCandidate, freed: int) -> None:
        deviation, self._deviation = self._deviation, 0
        if self._guard and deviation and freed > 0:
            self._cut[candidate] = (deviation, freed)
            if len(self._cut) > 4 * self.ghost_capacity + 64:
                del self._cut[next(iter(self._cut))]

    def on_shrink(self, candidate: EvictionCandidate, old_tokens: int, age: int) -> None:
        # a request reused the head: a hit at this age for the class the candidate was in
        self._reused(self.class_of(candidate), candidate, age, old_tokens - candidate.num_tokens)
        if self._split_classes and candidate not in self._split:
            self._split[candidate] = None
            if candidate in self._heap_of:
                self._update(candidate)

    # -- ranking -------------------------------------------------------------------------------

    def _enter(self, candidate: EvictionCandidate) -> None:
        if self._partial_first and candidate.partial_page:
            heap_id = self._classes
        else:
            heap_id = self.class_of(candidate)
        self._heap_of[candidate] = heap_id
        self._heaps[heap_id].push(candidate, candidate.last_access_time)
        if heap_id < self._classes:
            self._young[heap_id].push(candidate, -candidate.last_access_time)

    def _leave(self, candidate: EvictionCandidate) -> None:
        heap_id = self._heap_of.pop(candidate, None)
        if heap_id is not None:
            self._heaps[heap_id].remove(candidate)
            if heap_id < self._classes:
                self._young[heap_id].remove(candidate)

    def _update(self, candidate: EvictionCandidate) -> None:
        self._leave(candidate)
        self._enter(candidate)

    def _victim(self, remove: bool) -> EvictionCandidate | None:
        heaps = self._heaps
        partial = heaps[-1].peek()
        if partial is not None:
            if remove:
                self._leave(partial)
            return partial
        now, densities, cost_aware = self.now, self._density, self._cost is not None
        learned = oldest = None
        learned_key: tuple[float, int, int] = (0.0, 0, 0)
        for heap_id in range(len(heaps) - 1):
            head = heaps[heap_id].peek()
            if head is None:
                continue
            if oldest is None or (head.last_access_time, head.node_id) < (
                oldest.last_access_time,
                oldest.node_id,
            ):
                oldest = head
            youngest = self._young[heap_id].peek()
            for end in (head,) if youngest is head else (head, youngest):
                assert end is not None
                last = end.last_access_time
                d = densities[heap_id][self._bin(now - last)]
                key = (d * self._weight(end) if cost_aware else d, last, end.node_id)
                if learned is None or key < learned_key:
                    learned, learned_key = end, key
        if learned is None or oldest is None:
            return None
        if learned is not oldest:
            # deviate from LRU only when the model is clearly surer: its victim's density must be
            # below ``deviate_below`` times the LRU victim's
            d_oldest = densities[self._heap_of[oldest]][self._bin(now - oldest.last_access_time)]
            if cost_aware:
                d_oldest *= self._weight(oldest)
            if learned_key[0] >= self.options.deviate_below * d_oldest:
                learned = oldest
        victim = learned if self.use_learned else oldest
        if remove:
            if self._guard and learned is not oldest:
                kept = oldest if victim is learned else learned
                watch = self._kept_by_learned if victim is learned else self._kept_by_lru
                watch[kept] = None
                if len(watch) > 4 * self.ghost_capacity + 64:
                    del watch[next(iter(watch))]
                self._deviation = _LEARNED_EVICTED if victim is learned else _LRU_EVICTED
            self._leave(victim)
        return victim

    def __len__(self) -> int:
        return len(self._heap_of)

    def __contains__(self, candidate: object) -> bool:
        return candidate in self._heap_of

    def _clear(self) -> None:
        for heap in self._heaps + self._young:
            heap.clear()
        self._heap_of.clear()
        self._split.clear()
        self._kept_by_learned.clear()
        self._kept_by_lru.clear()
        self._cut.clear()
