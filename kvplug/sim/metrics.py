"""What a simulated run reports, and the prefill cost model behind "compute saved".

Recomputing a token at depth ``d`` (``d`` tokens before it) costs ``linear + quadratic * d``:
the linear term is the token's own projections and MLP, the quadratic term its attention over
everything before it. A hit on a ``h``-token prefix saves ``linear * h + quadratic * h(h-1)/2``;
the report divides that by the cost of every prompt computed from scratch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import Field

from kvplug_hookspecs import FrozenModel

__all__ = ["PrefillCost", "RunResult"]


class PrefillCost(FrozenModel):
    """Cost of computing one prompt token at depth ``d``: ``linear + quadratic * d``."""

    linear: float = Field(1.0, ge=0)
    quadratic: float = Field(1.0 / 4096, ge=0)

    def prefix(self, tokens: int) -> float:
        """Cost of computing the first ``tokens`` tokens of a prompt."""
        return self.linear * tokens + self.quadratic * tokens * (tokens - 1) / 2


@dataclass
class RunResult:
    """One policy x capacity run. Rates are fractions (0..1); times are seconds."""

    trace: str
    cache: str
    policy: str
    capacity_tokens: int
    page_size: int
    timing: str
    eviction: str
    requests: int
    completed: int
    aborted: int
    preemptions: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    prefill_saved: float
    evicted_tokens: int
    shortfall_requested_tokens: int
    shortfall_freed_tokens: int
    over_eviction: float
    cache_us_per_request: float
    wall_seconds: float
    # storage tiers (empty without): ``tiers`` the hierarchy's spec, hits and bytes per tier,
    # and prefill seconds under the storage config's cost model (TierCostModel)
    tiers: str = ""
    device_hit_tokens: int = 0
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    demotions_dropped: int = 0
    prefill_seconds: float = 0.0
    prefill_seconds_saved: float = 0.0

    def tier_hit_rate(self, tier: str) -> float:
        """Prompt tokens loaded from ``tier`` over all prompt tokens."""
        hits = self.tier_hit_tokens.get(tier, 0)
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_rate(self) -> float:
        """Prompt tokens found in the device pool over all prompt tokens."""
        return self.device_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


FIELDS: tuple[str, ...] = tuple(RunResult.__dataclass_fields__)
