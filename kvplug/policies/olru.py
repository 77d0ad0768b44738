"""``olru``: odds-weighted LRU — recency, shifted by the learned reuse odds of a candidate's class.

Why: on prefix-cache traces the content worth keeping is mostly the *continuation of a
conversation*. On the Mooncake conversation trace a first turn is continued about 30 % of the
time, a turn that itself continued a conversation 40-70 % of the time (more the longer the
conversation), and a leaf's tail that the next turn did not reuse (a split or trimmed tail) far
less; hit counts say almost nothing (a continued leaf stops being a leaf). LRU ignores all of
this. (``lhd`` learns the same classes' full reuse-age distributions and gains more.)

How: a candidate's rank is ``last_access_time + credit[class]`` (smallest evicted first), with
``credit = tau * ln(p_class / p_all)``. Under a reuse hazard that decays with age roughly like
``exp(-age / tau)`` this is exactly "evict the lowest probability of reuse": a class twice as
likely to be reused is kept ``tau * ln 2`` ticks longer than LRU would keep it. Everything is
learned online, per class, with decaying counts:

* ``p_class``: reuses (a hit, a request reusing the head of a leaf, or an insert matching the
  ghost of an evicted candidate) per candidate that entered the class;
* ``tau``: ``tau_scale`` times the mean age at reuse (hits and ghost hits).

**Admission window** (option, off by default). Reuse of a first turn rarely comes before its
typical reuse age, and at small capacities LRU evicts first turns just before their
conversations come back. With ``admission_window = w``, while the learned ranking's victim would
be a first turn younger than ``w * tau``, the *youngest* first turn goes instead: the cache keeps
a subset of first turns long enough to be reused. The guard's shadow applies the window too.
On ``benchmarks/bench_policies.py`` ``w = 2`` closes 8.9 / 13.1 / 2.7 % of the LRU-Belady gap
on the conversation trace at 1 / 3 / 5 % capacity (10.6 / 6.1 / 1.7 % without), but its worst
cell is 0.25 points below LRU (synthetic chat at 3 %; 0.01 without), so it is off by default.

**Guard against losing to LRU.** The ranking not in use runs as a shadow: a heap over what that
ranking would hold, i.e. the cache's candidates minus those it would have evicted ("watched":
still cached here) plus those evicted here that it would still hold ("phantoms", by content).
At each eviction where the two disagree the shadow evicts its own head instead. A later reuse of
a watched candidate is a hit the shadow missed; an insert matching a phantom's content is a hit
the shadow would have had. The decayed token score picks the ranking (LRU at the start; the
learned one as soon as it leads by ``guard_margin`` of the evidence, and back the same way), so
the policy falls back to LRU on traces where the classes mislead and returns when they help.

Cost per eviction: two or three heap heads, O(log N); per access two or three heap pushes; the
learned ranking is re-keyed (O(N)) at most once per N/4 reuses. Deterministic.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Annotated

from pydantic import Field

from kvplug_hookspecs import EvictionCandidate, FeedbackEvictionPolicy, FrozenModel, Ghost

from .heap import LazyHeap

__all__ = ["OLRUOptions", "OLRUPolicy"]

_TURNS = 3  # turn classes: 0, 1, 2 or more


class OLRUOptions(FrozenModel):
    """Options of the ``olru`` policy."""

    tau_scale: Annotated[float, Field(gt=0.0, le=16.0)] = 1.0
    """Credit per unit of log-odds, as a multiple of the learned mean age at reuse."""
    max_credit: Annotated[float, Field(gt=0.0, le=64.0)] = 3.0
    """Credits are clamped to ``± max_credit * tau``."""
    admission_window: Annotated[float, Field(ge=0.0, le=64.0)] = 0.0
    """A first turn (turn 0, not a tail, never hit) at the head of the learned ranking that is
    younger than ``admission_window * tau`` stays; the youngest first turn goes instead (0: off;
    see the module docstring for what 2 measured).
    Reuse of a first turn rarely comes before its typical reuse age, so keeping a subset that
    long beats keeping every first turn briefly."""
    turn_classes: bool = True
    """Class by conversation turn (0, 1, 2+): the cache's ``turn`` or the inferred one."""
    tail_classes: bool = True
    """A leaf whose head a request reused without it (the radix cache split it) is a class."""
    hit_classes: bool = True
    """A candidate hit at least once is a class."""
    decay_every: Annotated[int, Field(ge=16, strict=True)] = 4096
    """Reuse events between halvings of the learned counts (follows a drifting workload)."""
    prior: Annotated[float, Field(ge=0.0)] = 8.0
    """Pseudo-entries per class at the overall reuse rate (small classes stay near LRU)."""
    guard: bool = True
    """Follow LRU whenever it has been doing better (see the module docstring)."""
    guard_memory: Annotated[int, Field(ge=1, strict=True)] = 2000
    """Guard evidence decays by ``1 - 1/guard_memory`` per scored event."""
    guard_margin: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    """The learned ranking takes over when its evidence leads by this share of all evidence."""
    guard_warmup: Annotated[int, Field(ge=0, strict=True)] = 0
    """Scored events before the learned ranking may take over at all."""
    ghost_entries: Annotated[int, Field(ge=0, strict=True)] = 16384
    """Evicted candidates remembered (reuse after eviction, the inferred turn, the guard)."""
    lineage_entries: Annotated[int, Field(ge=0, strict=True)] = 4096
    """Recently extended or split candidates remembered to infer the turn of new ones."""


class OLRUPolicy(FeedbackEvictionPolicy):
    """Evict the smallest ``last_access_time + credit[class]`` (see the module docstring)."""

    def __init__(self, options: OLRUOptions | None = None) -> None:
        if options is None:
            options = OLRUOptions()
        if not isinstance(options, OLRUOptions):
            raise TypeError(f"olru options must be OLRUOptions, got {type(options).__name__}")
        super().__init__(options, ghost_capacity=options.ghost_entries)
        o = options
        self._classes = _TURNS * 4
        self._entries = [0.0] * self._classes
        self._reuses = [0.0] * self._classes
        self._credit = [0.0] * self._classes
        self._reuse_age = 0.0  # decayed sum of ages at reuse
        self._reuse_count = 0.0
        self._events = 0
        self._rekeyed_at = 0
        self.tau = 0.0
        """The learned time scale (ticks): ``tau_scale`` times the mean age at reuse."""
        self._active = LazyHeap()  # the ranking in use, over the evictable candidates
        self._shadow = LazyHeap()  # the other ranking, as it would have evolved (the guard)
        self._live: dict[EvictionCandidate, None] = {}
        self._young = LazyHeap()  # first turns, youngest first (the admission window)
        self._window = o.admission_window
        self._class: dict[EvictionCandidate, int] = {}
        self._turn: dict[EvictionCandidate, int] = {}
        self._tail: dict[EvictionCandidate, None] = {}
        self._lineage: OrderedDict[tuple[object, int], int] = OrderedDict()
        self._guard = o.guard
        self._keep = 1.0 - 1.0 / o.guard_memory
        self.score = 0.0
        """Decayed evidence for the learned ranking over LRU (tokens; > 0: learned leads)."""
        self._scale = 0.0
        self._scored = 0
        self.use_learned = not o.guard
        self.switches = 0
        """Times the guard changed ranking."""
        # the shadow ranking's differences from the real cache: cached candidates it evicted,
        # and evicted candidates (by content) it still holds
        self._watched: dict[EvictionCandidate, None] = {}
        self._phantoms: OrderedDict[int, EvictionCandidate] = OrderedDict()
        self._pair: tuple[EvictionCandidate, EvictionCandidate | None] | None = None

    # -- classes -------------------------------------------------------------------------------

    def turn_of(self, candidate: EvictionCandidate) -> int:
        """The candidate's conversation turn: the cache's, or the one inferred (0: none)."""
        return max(candidate.turn, self._turn.get(candidate, 0))

    def class_of(self, candidate: EvictionCandidate, hit_count: int | None = None) -> int:
        """Turn class (0, 1, 2+) x tail x hit."""
        o = self.options
        hits = candidate.hit_count if hit_count is None else hit_count
        turn = min(self.turn_of(candidate), _TURNS - 1) if o.turn_classes else 0
        tail = o.tail_classes and candidate in self._tail
        hit = o.hit_classes and hits > 0
        return turn * 4 + tail * 2 + hit

    def credit(self, cls: int) -> float:
        """Ticks the class is kept beyond (> 0) or short of (< 0) LRU's choice."""
        return self._credit[cls]

    # -- learning ------------------------------------------------------------------------------

    def _entered(self, cls: int) -> None:
        self._entries[cls] += 1.0

    def _reused(self, cls: int, age: int) -> None:
        self._reuses[cls] += 1.0
        self._reuse_age += max(0, age)
        self._reuse_count += 1.0
        self._events += 1
        if self._events % 64 == 0:
            self._recompute()

    def _recompute(self) -> None:
        o = self.options
        if self._events % o.decay_every == 0:
            for counts in (self._entries, self._reuses):
                for c in range(self._classes):
                    counts[c] *= 0.5
            self._reuse_age *= 0.5
            self._reuse_count *= 0.5
        total_entries = sum(self._entries)
        if total_entries <= 0 or self._reuse_count <= 0:
            return
        p_all = min(1.0, sum(self._reuses) / total_entries)
        if p_all <= 0:
            return
        self.tau = o.tau_scale * self._reuse_age / self._reuse_count
        bound = o.max_credit * self.tau
        for c in range(self._classes):
            p = (self._reuses[c] + o.prior * p_all) / (self._entries[c] + o.prior)
            credit = self.tau * math.log(max(p, 1e-6) / p_all)
            self._credit[c] = max(-bound, min(bound, credit))
        # re-key the candidates ranked with older credits (new pushes use the new ones): O(N),
        # so only once per N / 4 reuses (amortised O(1) per reuse on any cache size)
        heap = self._active if self.use_learned else self._shadow
        if 4 * (self._events - self._rekeyed_at) >= len(heap):
            self._rekeyed_at = self._events
            heap.rekey(self._learned_key)

    def _score(self, delta: float) -> None:
        """Evidence from the shadow: ``delta`` tokens for the learned ranking (< 0: for LRU)."""
        self.score = self.score * self._keep + delta
        self._scale = self._scale * self._keep + abs(delta)
        self._scored += 1
        margin = self.options.guard_margin * self._scale
        if self._scored < self.options.guard_warmup:
            return
        lead = self.score > margin if not self.use_learned else self.score < -margin
        if lead:  # the ranking in the shadow leads
            self._switch()

    def _switch(self) -> None:
        """Swap the rankings; the new shadow starts equal to the cache (O(N), rare)."""
        self.use_learned = not self.use_learned
        self.switches += 1
        for candidate in self._phantoms.values():
            self._class.pop(candidate, None)
        self._phantoms.clear()
        self._watched.clear()
        self._active, self._shadow = self._shadow, self._active
        live = list(self._live)
        learned = self.use_learned
        for heap, ranks_learned in ((self._active, learned), (self._shadow, not learned)):
            heap.clear()
            for candidate in live:
                heap.push(candidate, self._key(candidate, ranks_learned))

    def _remember(self, namespace: object, position: int, turn: int) -> None:
        lineage = self._lineage
        key = (namespace, position)
        lineage.pop(key, None)
        lineage[key] = turn
        if len(lineage) > self.options.lineage_entries:
            lineage.popitem(last=False)

    # -- feedback ------------------------------------------------------------------------------

    def on_insert(self, candidate: EvictionCandidate, ghost: Ghost | None) -> None:
        turn = self._lineage.pop((candidate.namespace, candidate.depth), -1) + 1
        if ghost is not None:
            turn = max(turn, (ghost.tag & 0xFF) + 1)
            self._reused(ghost.tag >> 8, ghost.age + self.now - ghost.evicted_at)
            phantom = self._phantoms.pop(candidate.content_id, None)
            if phantom is not None:  # evicted here, still held by the other ranking: its hit
                self._shadow.remove(phantom)
                self._class.pop(phantom, None)
                self._score(-ghost.num_tokens if self.use_learned else ghost.num_tokens)
        if turn:
            self._turn[candidate] = turn
        self._entered(self.class_of(candidate))

    def on_hit(self, candidate: EvictionCandidate, age: int) -> None:
        self._reused(self.class_of(candidate, candidate.hit_count - 1), age)
        self._entered(self.class_of(candidate))
        self._watched_reuse(candidate, candidate.num_tokens)

    def on_shrink(self, candidate: EvictionCandidate, old_tokens: int, age: int) -> None:
        # a request reused the head and went on elsewhere: the head's conversation continues
        self._reused(self.class_of(candidate), age)
        self._remember(candidate.namespace, candidate.depth, self.turn_of(candidate))
        self._watched_reuse(candidate, old_tokens - candidate.num_tokens)
        if candidate not in self._tail:
            self._tail[candidate] = None
            self._entered(self.class_of(candidate))
            if candidate in self._live:
                self._update(candidate)

    def on_trim(self, candidate: EvictionCandidate, freed: int) -> None:
        self._pair = None  # only its tail went: it stays cached in both rankings

    def on_evict(self, candidate: EvictionCandidate, age: int) -> int:
        cls = self.class_of(candidate)
        self._tail.pop(candidate, None)
        self._watched.pop(candidate, None)
        turn = min(self._turn.pop(candidate, 0), 0xFF)
        pair, self._pair = self._pair, None
        other = pair[1] if pair is not None and pair[0] is candidate else candidate
        shadow = self._shadow
        if other is candidate or other is None or not candidate.content_id:
            shadow.remove(candidate)
            self._class.pop(candidate, None)
        else:  # the rankings disagree: the shadow evicts ``other`` and keeps this one
            shadow.remove(other)
            if other in self._live:
                self._watched[other] = None
                if len(self._watched) > self.ghost_capacity:
                    del self._watched[next(iter(self._watched))]
            else:  # a phantom
                if self._phantoms.get(other.content_id) is other:
                    del self._phantoms[other.content_id]
                self._class.pop(other, None)
            old = self._phantoms.pop(candidate.content_id, None)
            if old is not None:
                shadow.remove(old)
                self._class.pop(old, None)
            self._phantoms[candidate.content_id] = candidate
            if len(self._phantoms) > self.ghost_capacity:
                _, dropped = self._phantoms.popitem(last=False)
                shadow.remove(dropped)
                self._class.pop(dropped, None)
        return turn | cls << 8

    def _watched_reuse(self, candidate: EvictionCandidate, tokens: int) -> None:
        """A reuse of a cached candidate the shadow ranking had evicted: the real one's hit."""
        if candidate in self._watched:
            del self._watched[candidate]
            self._score(tokens if self.use_learned else -tokens)

    # -- ranking -------------------------------------------------------------------------------

    def _learned_key(self, candidate: EvictionCandidate) -> float:
        return candidate.last_access_time + self._credit[self._class[candidate]]

    def _key(self, candidate: EvictionCandidate, learned: bool) -> float:
        if learned:
            return self._learned_key(candidate)
        return candidate.last_access_time

    def _enter(self, candidate: EvictionCandidate) -> None:
        self._class[candidate] = cls = self.class_of(candidate)
        self._live[candidate] = None
        if self._window:
            if cls == 0:
                self._young.push(candidate, -candidate.last_access_time)
            else:
                self._young.remove(candidate)
        self._active.push(candidate, self._key(candidate, self.use_learned))
        if self._guard and candidate not in self._watched:
            self._shadow.push(candidate, self._key(candidate, not self.use_learned))

    def _leave(self, candidate: EvictionCandidate) -> None:
        if candidate in self._live:
            del self._live[candidate]
            self._active.remove(candidate)
            self._shadow.remove(candidate)
            self._young.remove(candidate)
            # it stopped being a leaf (extended) or is in use: a new candidate starting where it
            # ends continues its conversation
            end = candidate.depth + candidate.num_tokens
            self._remember(candidate.namespace, end, self.turn_of(candidate))

    def _update(self, candidate: EvictionCandidate) -> None:
        self._enter(candidate)

    def _victim(self, remove: bool) -> EvictionCandidate | None:
        victim = self._active.peek()
        if (
            victim is not None
            and self.use_learned
            and self._window
            and self._class[victim] == 0
            and self.now - victim.last_access_time < self._window * self.tau
        ):
            victim = self._young.peek()  # the admission window: the youngest first turn goes
        if victim is None or not remove:
            return victim
        if self._guard:
            self._pair = (victim, self._shadow_victim())
        self._active.remove(victim)
        self._young.remove(victim)
        del self._live[victim]
        return victim

    def _shadow_victim(self) -> EvictionCandidate | None:
        """The shadow ranking's victim (the learned one applies the admission window too)."""
        head = self._shadow.peek()
        if (
            head is not None
            and not self.use_learned
            and self._window
            and self._class.get(head) == 0
            and self.now - head.last_access_time < self._window * self.tau
        ):
            young = self._young.peek()
            if young is not None and young in self._shadow:
                return young
        return head

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, candidate: object) -> bool:
        return candidate in self._live

    def _clear(self) -> None:
        self._active.clear()
        self._shadow.clear()
        self._young.clear()
        self._live.clear()
        self._class.clear()
        self._turn.clear()
        self._tail.clear()
        self._lineage.clear()
        self._watched.clear()
        self._phantoms.clear()
        self._pair = None
