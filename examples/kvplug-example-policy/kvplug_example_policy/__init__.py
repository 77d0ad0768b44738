"""The ``largest_first`` eviction policy, shipped as a third-party kvplug plugin.

Evicting the largest cached leaf first frees the shortfall with the fewest victims, which keeps
many short shared prefixes (system prompts) cached under memory pressure.
"""

from __future__ import annotations

from typing import Literal

from kvplug_hookspecs import (
    EvictionCandidate,
    EvictionPolicyRegistration,
    FrozenModel,
    KeyedEvictionPolicy,
    hookimpl,
)

__all__ = ["LargestFirstOptions", "LargestFirstPolicy", "kvplug_eviction_policies"]


class LargestFirstOptions(FrozenModel):
    """Options of ``largest_first``: how to order leaves of equal size."""

    tie_break: Literal["lru", "fifo"] = "lru"


class LargestFirstPolicy(KeyedEvictionPolicy):
    """Evict the candidate holding the most tokens; ties by recency or by age."""

    def __init__(self, options: LargestFirstOptions | None = None) -> None:
        super().__init__(options or LargestFirstOptions())
        self.touch_changes_key = self.options.tie_break == "lru"  # fifo order never moves

    def key(self, candidate: EvictionCandidate) -> tuple[int, int]:
        if self.options.tie_break == "lru":
            return (-candidate.num_tokens, candidate.last_access_time)
        return (-candidate.num_tokens, candidate.creation_time)


@hookimpl
def kvplug_eviction_policies():
    yield EvictionPolicyRegistration(
        name="largest_first",
        factory=LargestFirstPolicy,
        options_model=LargestFirstOptions,
        description="evict the largest cached leaf first (example third-party plugin)",
    )
