"""``gdsf``: GreedyDual-Size-Frequency with prefill cost by depth (Cherkasova 1998).

A candidate's priority is ``L + (hits + 1) * cost_per_token``: reused, deep (expensive to
recompute) tokens stay; ``L`` rises to each victim's priority, so candidates nobody touches age
out without a clock scan. The cost per token comes from an explicit
:class:`~kvplug.policies.cost.CostModel` (linear + quadratic in depth).
"""

from __future__ import annotations

from typing import Any

from kvplug_hookspecs import EvictionCandidate, FrozenModel, KeyedEvictionPolicy

from .cost import CostModel

__all__ = ["GDSFOptions", "GDSFPolicy"]


class GDSFOptions(FrozenModel):
    """Options of the ``gdsf`` policy."""

    cost: CostModel = CostModel()
    """What recomputing a token at a depth costs."""


class GDSFPolicy(KeyedEvictionPolicy):
    """Lowest ``L + (hits + 1) * cost per token`` first; ties to the older node."""

    def __init__(self, options: GDSFOptions | None = None) -> None:
        if options is None:
            options = GDSFOptions()
        if not isinstance(options, GDSFOptions):
            raise TypeError(f"gdsf options must be GDSFOptions, got {type(options).__name__}")
        super().__init__(options)
        self._cost = options.cost
        self.inflation = 0.0
        """``L``: the priority of the last victim."""

    def key(self, candidate: EvictionCandidate) -> Any:
        value = (candidate.hit_count + 1) * self._cost.per_token(
            candidate.depth, candidate.num_tokens
        )
        return (self.inflation + value, candidate.last_access_time)

    def pop(self) -> EvictionCandidate | None:
        candidate = self.peek()
        if candidate is not None:
            self.inflation = self._live[candidate][0][0]
        return super().pop()

    def clear(self) -> None:
        super().clear()
        self.inflation = 0.0
