"""``ShadowGuard``: the cache the ranking *not* in use would have, and the evidence of which
ranking gets more hits.

Why: a learned policy must not be meaningfully worse than LRU on any workload, including one
where its learned signal misleads or flips. Running a second cache is too expensive, so the
shadow is kept as the *differences* from the real cache, over the same candidates:

* **watched** — cached here, evicted there: a later reuse here is a hit the shadow missed
  (evidence for the ranking in use);
* **phantoms** — evicted here, still held there (by ``content_id``): an insert re-covering
  their content is a hit the shadow would have had (evidence for the shadow).

The shadow holds as many tokens as the cache: every token evicted here (whole candidates and
exact cuts) is a debt the shadow pays by evicting *its own* victims, whatever their sizes; a
watched candidate reused here is fetched again there. It follows the tree too: a candidate whose
evicted content below it the shadow still holds (a phantom starting where it ends) is an inner
node there, so the shadow cannot evict it before those phantoms. Without these two rules the
shadow is handicapped (it frees the wrong number of tokens, or drops a parent and keeps a child
it can never hit) and the evidence merely favours whichever ranking is in use.

Evidence decays by ``1 - 1/memory`` per scored event. The policy switches rankings when the
shadow leads by a given number of standard deviations of the decayed evidence: every switch
costs hits (each ranking evicts what the other kept), so noise must not flip it. The new shadow
starts equal to the cache.

**Regret budget** (:meth:`ShadowGuard.due`). One ranking is the *reference* (LRU), the other
the *challenger* (the learned one); either may be in use first. While the challenger is in use,
every scored event is also summed, undecayed, into ``gain``: the tokens it has won (or, below
0, lost) against what the reference would have hit, over the whole run. ``volume`` counts the
tokens the policy has seen (every hit and every inserted token). The challenger is dropped as
soon as ``-gain`` exceeds ``budget * volume``, whatever the decayed evidence says, and it gets
the cache back only once half of that budget has regrown. So the estimated loss against the
reference never exceeds ``budget`` of the tokens seen (plus the one event that crossed it), at
any capacity: at a large capacity, where few events are scored, the decayed test alone can sit
below its threshold while the challenger loses. ``volume`` is at least the tokens queried when
outputs are not cached and at most about twice that when they are (an answer is rarely longer
than its prompt's new part), so a budget of 0.1 % bounds the estimated loss by 0.2-0.3 pp of
the queried tokens.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Protocol

from kvplug_hookspecs import CandidateStats, EvictionCandidate

from .heap import LazyHeap

__all__ = ["Ranking", "Recency", "ShadowGuard"]

Position = tuple[object, int]  # (namespace, token position)


class Ranking(Protocol):
    """A ranking over a set of candidates: what a policy and its shadow are made of."""

    def push(self, candidate: EvictionCandidate, cls: int) -> None: ...

    def remove(self, candidate: EvictionCandidate) -> None: ...

    def fill(self, classes: dict[EvictionCandidate, int]) -> None:
        """Add many candidates (with their classes) at once."""
        ...

    def victim(self) -> EvictionCandidate | None: ...

    def clear(self) -> None: ...

    def __contains__(self, candidate: object) -> bool: ...


class Recency:
    """The LRU ranking over a set of candidates (the guard's reference ranking)."""

    def __init__(self) -> None:
        self.heap = LazyHeap()

    def push(self, candidate: EvictionCandidate, cls: int) -> None:
        self.heap.push(candidate, candidate.last_access_time)

    def remove(self, candidate: EvictionCandidate) -> None:
        self.heap.remove(candidate)

    def fill(self, classes: dict[EvictionCandidate, int]) -> None:
        self.heap.fill((c, c.last_access_time) for c in classes)

    def victim(self) -> EvictionCandidate | None:
        return self.heap.peek()

    def clear(self) -> None:
        self.heap.clear()

    def __contains__(self, candidate: object) -> bool:
        return candidate in self.heap


class ShadowGuard:
    """The shadow of the ranking not in use, over the candidates of a policy."""

    def __init__(
        self,
        shadow: Ranking,
        *,
        memory: int,
        capacity: int,
        reference_in_use: bool = True,
    ) -> None:
        self.shadow = shadow
        """The ranking not in use, over what it would hold."""
        self._keep = 1.0 - 1.0 / memory
        self._capacity = capacity
        self.score = 0.0
        """Decayed evidence for the ranking in use (tokens; < 0: the shadow does better)."""
        self._energy = 0.0
        self.events = 0
        """Scored events so far."""
        self.gain = 0.0
        """Undecayed evidence summed while the challenger is in use (see the module docstring):
        the tokens it has won against the reference so far (< 0: lost)."""
        self._gain_energy = 0.0  # the sum of the squares of what ``gain`` summed
        self.volume = 0
        """Tokens seen: reused (every hit) and inserted; the regret budget is a share of it."""
        self.reference_in_use = reference_in_use
        """Whether the reference ranking (LRU; ``shadow`` is the other one) is in use."""
        self.debt = 0
        """Tokens the shadow holds beyond the cache (it evicts while this is positive)."""
        self._watched: dict[EvictionCandidate, None] = {}
        self._phantoms: OrderedDict[int, EvictionCandidate] = OrderedDict()
        self._below: dict[Position, int] = {}  # phantoms starting at a position
        self._blocked: dict[Position, dict[EvictionCandidate, int]] = {}  # inner nodes there
        self._blocked_at: dict[EvictionCandidate, Position] = {}
        self._tails: OrderedDict[Position, CandidateStats] = OrderedDict()  # cut tails held there

    # -- what the real cache does --------------------------------------------------------------

    def hold(self, candidate: EvictionCandidate, cls: int) -> None:
        """``candidate`` is evictable here: the shadow holds it too, unless it evicted it."""
        if candidate in self._watched:
            return
        self._unblock_one(candidate)
        end = (candidate.namespace, candidate.depth + candidate.num_tokens)
        if self._below.get(end):
            self.shadow.remove(candidate)
            self._block(candidate, cls, end)
        else:
            self.shadow.push(candidate, cls)

    def release(self, candidate: EvictionCandidate) -> None:
        """``candidate`` is no longer evictable here (in use, or an inner node): nor there."""
        self.shadow.remove(candidate)
        self._unblock_one(candidate)

    def evicted(self, candidate: EvictionCandidate) -> None:
        """The cache evicted ``candidate``; the shadow keeps it (a phantom) unless it had
        evicted it already, and pays the tokens with its own victims."""
        self.debt += candidate.num_tokens
        if candidate in self._watched:
            del self._watched[candidate]
        else:
            held = candidate in self.shadow or candidate in self._blocked_at
            cid = candidate.content_id
            if held and cid and cid not in self._phantoms:
                self._phantoms[cid] = candidate
                start = (candidate.namespace, candidate.depth)
                self._below[start] = self._below.get(start, 0) + 1
                if len(self._phantoms) > self._capacity:
                    _, oldest = self._phantoms.popitem(last=False)
                    self._forget(oldest)
            elif held:
                self.shadow.remove(candidate)
                self._unblock_one(candidate)
                self.debt -= candidate.num_tokens
        self._pay()

    def trimmed(self, candidate: EvictionCandidate, freed: int, cls: int) -> None:
        """An exact eviction freed ``freed`` tokens of ``candidate``'s tail here. Where the
        shadow still holds the candidate it keeps the tail: a phantom below it (the candidate
        is an inner node there until the tail goes), found again by where it starts."""
        self.debt += freed
        if candidate not in self._watched and candidate.content_id:
            tail = CandidateStats(candidate.last_access_time, num_tokens=freed)
            tail.namespace = candidate.namespace
            tail.depth = candidate.depth + candidate.num_tokens
            start = (tail.namespace, tail.depth)
            for key in (start, (tail.namespace, tail.depth + freed)):  # cut again: one tail
                old = self._tails.pop(key, None)
                if old is not None:
                    self._forget(old)
                    if key != start:
                        tail.num_tokens += old.num_tokens
                        self.debt += old.num_tokens  # still held, as part of the new tail
            self._tails[start] = tail
            self._below[start] = self._below.get(start, 0) + 1
            self.shadow.push(tail, cls)
            if len(self._tails) > self._capacity:
                _, oldest = self._tails.popitem(last=False)
                self._forget(oldest)
        self._pay()

    def inserted(self, candidate: EvictionCandidate) -> None:
        """``candidate`` is new here: if it starts where the shadow keeps a cut tail, that is
        the tail coming back (the shadow's hit)."""
        self.volume += candidate.num_tokens
        tail = self._tails.pop((candidate.namespace, candidate.depth), None)
        if tail is not None:
            self._forget(tail)
            self._evidence(-min(tail.num_tokens, candidate.num_tokens))

    def reused(self, candidate: EvictionCandidate, tokens: int, fetched: int) -> None:
        """A request reused ``tokens`` of ``candidate`` here; if the shadow had evicted it, that
        is its miss, and it fetches ``fetched`` tokens again."""
        self.volume += tokens
        if candidate in self._watched:
            del self._watched[candidate]
            self._evidence(tokens)
            self.debt += fetched
            self._pay()

    def returned(self, content_ids: list[int], limit: int) -> None:
        """An insert re-covers evicted content (these ids, at most ``limit`` tokens): what the
        shadow still holds of it would have been its hit."""
        tokens = 0
        for cid in content_ids:
            phantom = self._phantoms.pop(cid, None)
            if phantom is not None:
                tokens += phantom.num_tokens
                self._forget(phantom)
                end = (phantom.namespace, phantom.depth + phantom.num_tokens)
                tail = self._tails.pop(end, None)  # its cut tail, held below it
                if tail is not None:
                    tokens += tail.num_tokens
                    self._forget(tail)
        if tokens:
            self._evidence(-min(tokens, limit))

    def switched(self, shadow: Ranking, live: dict[EvictionCandidate, int]) -> None:
        """The rankings swapped: ``shadow`` is the new one not in use; it starts equal to the
        cache (``live``: evictable candidates and their classes)."""
        self.shadow = shadow
        self.clear()
        self.score = -self.score  # the evidence that made it switch, for the new ranking
        self.reference_in_use = not self.reference_in_use
        shadow.fill(live)

    def clear(self) -> None:
        self.shadow.clear()
        self._watched.clear()
        self._phantoms.clear()
        self._tails.clear()
        self._below.clear()
        self._blocked.clear()
        self._blocked_at.clear()
        self.debt = 0

    def switch_due(self, confidence: float, warmup: int = 0) -> bool:
        """Whether the shadow leads by ``confidence`` standard deviations of the evidence (the
        lead of a random walk of noise grows only with the square root of the evidence; a real
        advantage grows with the evidence itself), and not before ``warmup`` scored events."""
        if self.events < warmup or self.score >= 0:
            return False
        return bool(-self.score > confidence * math.sqrt(self._energy))

    def due(self, *, handover: float, fallback: float, budget: float, warmup: int = 0) -> bool:
        """Whether to swap rankings now. The challenger in use is dropped when the reference
        leads by ``fallback`` standard deviations, or at once when its loss so far exceeds
        ``budget`` of the tokens seen; the reference in use hands over when the challenger
        leads by ``handover`` deviations (not before ``warmup`` scored events), and only while
        less than half the budget is spent."""
        allowed = budget * self.volume
        if not self.reference_in_use:
            noise = fallback * math.sqrt(self._gain_energy)
            return -self.gain - noise > allowed or self.switch_due(fallback)
        return -self.gain <= allowed / 2 and self.switch_due(handover, warmup)

    # -- internals ------------------------------------------------------------------------------

    def _evidence(self, delta: float) -> None:
        self.score = self.score * self._keep + delta
        self._energy = self._energy * self._keep + delta * delta
        self.events += 1
        if not self.reference_in_use:
            self.gain += delta
            self._gain_energy += delta * delta

    def _pay(self) -> None:
        """The shadow evicts its own victims until it holds no more tokens than the cache."""
        shadow = self.shadow
        while self.debt > 0:
            victim = shadow.victim()
            if victim is None:
                self.debt = 0
                return
            shadow.remove(victim)
            self.debt -= victim.num_tokens
            start = (victim.namespace, victim.depth)
            if self._phantoms.get(victim.content_id) is victim:
                del self._phantoms[victim.content_id]
                self._forget(victim, evicted=True)
            elif (tail := self._tails.get(start)) is victim and tail is not None:  # a cut tail
                del self._tails[start]
                self._forget(tail, evicted=True)
            else:  # cached here (or being cut here right now), evicted there
                self._unblock_one(victim)
                self._watched[victim] = None
                if len(self._watched) > self._capacity:
                    del self._watched[next(iter(self._watched))]

    def _forget(self, phantom: EvictionCandidate, *, evicted: bool = False) -> None:
        """The shadow no longer holds ``phantom`` (evicted there, or back here); the caller took
        it out of the phantoms."""
        if not evicted:
            self.shadow.remove(phantom)
            self.debt -= phantom.num_tokens
        self._unblock_one(phantom)
        start = (phantom.namespace, phantom.depth)
        count = self._below.get(start, 0) - 1
        if count > 0:
            self._below[start] = count
        else:
            self._below.pop(start, None)
            for parent, cls in self._blocked.pop(start, {}).items():
                del self._blocked_at[parent]
                self.shadow.push(parent, cls)  # a leaf there now

    def _block(self, candidate: EvictionCandidate, cls: int, end: Position) -> None:
        self._blocked.setdefault(end, {})[candidate] = cls
        self._blocked_at[candidate] = end

    def _unblock_one(self, candidate: EvictionCandidate) -> None:
        end = self._blocked_at.pop(candidate, None)
        if end is not None:
            group = self._blocked[end]
            del group[candidate]
            if not group:
                del self._blocked[end]
