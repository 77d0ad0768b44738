"""``ReuseModel``: per class of candidate, the learned distribution of the age at reuse, and the
hit density it implies at every age.

Why a model of its own: a policy that ranks by "hits still expected per token per tick" needs,
per class, the probability ``P[b]`` that a candidate entering the class is reused at an age in
bin ``b`` (age: ticks since its last access). Two biases make the naive count wrong:

* Reuse after an eviction is still reuse. The policy reports it from ghosts (an insert of
  content evicted earlier), so the distribution is the workload's, not the policy's: a policy
  that evicts early would otherwise never see the late reuses it prevents.
* Recent entries have not lived long enough to be reused late (right censoring). Dividing the
  reuses at age ``a`` by *all* entries underestimates late reuse while the workload is young.
  Here the denominator of bin ``b`` counts only entries at least ``edges[b]`` ticks old: a
  window of the latest ``exposure_window`` entries is kept with their times; older entries are
  old enough for every bin that matters.

From ``P`` the density of a candidate now at the start of bin ``b`` is the best ratio, over how
long it may still stay (to the end of bin ``L >= b``), of the reuse it can still get to the
ticks it occupies until reused or dropped::

    density[b] = max_L  sum(P[b..L]) / sum(width[x] * (S[x] - P[x] / 2) for x in b..L)

with ``S[x]`` the share not reused before bin ``x``. Both sums are over the same survivors, so
the conditioning on "not reused yet" cancels. The maximum over ``L`` is what makes a young
candidate that is rarely reused before a typical age (a conversation's first turn) worth less
than an older one that is nearly there.

Classes with few entries borrow from all classes: ``prior`` pseudo-entries at the overall rates.
Counts halve every ``decay_every`` reuses so the model follows a drifting workload. The table is
recomputed with NumPy (O(classes x bins^2)) every ``recompute_every`` entries and reuses (a class
that stops being reused is seen through its entries alone), and at the 8th, 16th, 32nd, ...
reuse before that so it is useful early. Deterministic: a function of the call sequence.
"""

from __future__ import annotations

import math
from bisect import bisect_right

import numpy as np

__all__ = ["ReuseModel"]


class ReuseModel:
    """Reuse-age histograms per class and the hit-density table ``density[class][bin]``."""

    def __init__(
        self,
        classes: int,
        *,
        bins: int = 64,
        bins_per_doubling: int = 4,
        prior: float = 2.0,
        exposure_window: int = 32768,
        recompute_every: int = 256,
        decay_every: int = 8192,
        smoothing: int = 2,
    ) -> None:
        self.classes, self.bins, self._per_doubling = classes, bins, bins_per_doubling
        self._prior, self._recompute_every, self._decay_every = prior, recompute_every, decay_every
        self._smoothing = smoothing
        edges: list[int] = []
        k = 0
        while len(edges) <= bins:  # geometric, whole ticks, at least one tick wide
            edge = math.ceil(2.0 ** (k / bins_per_doubling) - 1.0)
            if not edges or edge > edges[-1]:
                edges.append(edge)
            k += 1
        self._edges = edges[:bins]
        self.edges = np.array(edges, dtype=np.float64)
        """Age bin ``b`` holds ages in ``[edges[b], edges[b + 1])`` (the last: and beyond)."""
        self._width = np.diff(self.edges)
        self._edges_np = np.array(self._edges, dtype=np.int64)
        self._upper = np.triu(np.ones((bins, bins), dtype=bool))
        self._reuses = np.zeros((classes, bins))
        self._mature = np.zeros(classes)  # entries older than the window (weights)
        n = max(1, exposure_window)
        self._times = np.zeros(n, dtype=np.int64)  # the window: entry times, classes, weights
        self._classes_of = np.full(n, -1, dtype=np.int64)
        self._weights = np.zeros(n)
        self._next = 0
        self._p = np.zeros((classes, bins))
        self.reuse_events = 0
        self._since = 0  # entries and reuses since the last recomputation
        """Reuses reported so far (hits and ghost hits)."""
        self.density: list[list[float]] = [[0.0] * bins for _ in range(classes)]
        """Hits per token per tick of a candidate of a class at the start of an age bin."""

    def bin(self, age: float) -> int:
        """The age bin of ``age`` ticks."""
        return bisect_right(self._edges, age) - 1 if age > 0 else 0

    def entered(self, cls: int, now: int) -> None:
        """A candidate entered class ``cls`` at tick ``now``."""
        i = self._next
        old = int(self._classes_of[i])
        if old >= 0:
            self._mature[old] += self._weights[i]
        self._times[i], self._classes_of[i], self._weights[i] = now, cls, 1.0
        self._next = (i + 1) % len(self._times)
        self._since += 1
        if self._since >= self._recompute_every and self.reuse_events >= 8:
            self.recompute(now)

    def reused(self, cls: int, age: float, now: int) -> None:
        """A candidate that entered ``cls`` was reused at tick ``now``, ``age`` ticks after its
        last access."""
        self._reuses[cls, self.bin(age)] += 1.0
        self.reuse_events = n = self.reuse_events + 1
        if n % self._decay_every == 0:
            self._reuses *= 0.5
            self._mature *= 0.5
            self._weights *= 0.5
        self._since += 1
        every = self._recompute_every
        if self._since >= every or (n < every and n >= 8 and n & (n - 1) == 0):
            self.recompute(now)

    def recompute(self, now: int) -> None:
        """Rebuild the density table at tick ``now``."""
        self._since = 0
        times, classes, weights = self._times, self._classes_of, self._weights
        if classes[-1] < 0:  # the window is not full yet
            live = classes >= 0
            times, classes, weights = times[live], classes[live], weights[live]
        bins, n = self.bins, self.classes
        # eligible[c, b]: entries of class c old enough to have reached age bin b
        reached = np.searchsorted(self._edges_np, now - times, side="right") - 1
        cells = classes * bins + np.clip(reached, 0, bins - 1)
        counts = np.bincount(cells, weights, minlength=n * bins).reshape(n, bins)
        eligible = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1] + self._mature[:, None]
        reuses = self._reuses
        overall = reuses.sum(axis=0) / np.maximum(eligible.sum(axis=0), 1e-9)
        # classes seen so far, and one row at the overall rates (what an unseen class gets)
        used = np.flatnonzero((reuses.sum(axis=1) > 0) | (eligible[:, 0] > 0))
        prior = self._prior
        p = np.vstack(
            [
                (reuses[used] + prior * overall) / np.maximum(eligible[used] + prior, 1e-9),
                overall[None, :],
            ]
        )
        for _ in range(self._smoothing):
            p = np.concatenate([p[:, :1], p, p[:, -1:]], axis=1)
            p = (p[:, :-2] + 2 * p[:, 1:-1] + p[:, 2:]) / 4
        survive = 1.0 - np.cumsum(p, axis=1) + p  # share not reused before each bin
        occupied = self._width * np.maximum(survive - p / 2.0, 1e-12)
        zero = np.zeros((len(p), 1))
        cum_p = np.concatenate([zero, np.cumsum(p, axis=1)], axis=1)
        cum_o = np.concatenate([zero, np.cumsum(occupied, axis=1)], axis=1)
        # ratio[c, b, L] = sum(p[b..L]) / sum(occupied[b..L]) for L >= b
        num = cum_p[:, None, 1:] - cum_p[:, :-1, None]
        den = cum_o[:, None, 1:] - cum_o[:, :-1, None]
        ratio = np.divide(num, den, out=np.zeros_like(num), where=self._upper)
        rows = np.maximum(ratio.max(axis=2), 0.0)
        unseen = rows[-1].tolist()  # unseen classes: the overall rates (one shared row)
        table = [unseen] * n
        for cls, row in zip(used.tolist(), rows[:-1].tolist(), strict=True):
            table[cls] = row
        self.density = table
        full_p = np.repeat(p[-1:], n, axis=0)
        full_p[used] = p[:-1]
        self._p = full_p

    def reuse_probability(self, cls: int) -> float:
        """The probability, at the last recomputation, that a candidate entering ``cls`` is
        reused at all (within the oldest age bin)."""
        return float(self._p[cls].sum())
