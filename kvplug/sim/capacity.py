"""Capacities as people write them (``3M``, ``5%``), and the simulator's own error."""

from __future__ import annotations

import re

from ..errors import KvplugError

__all__ = ["SimulationError", "parse_capacity"]


class SimulationError(KvplugError, ValueError):
    """A simulation that cannot run as asked (bad capacity, belady on an unsupported trace)."""


_CAPACITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg%]?)\s*$", re.IGNORECASE)
_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_capacity(text: str, unique_tokens: int | None = None) -> int:
    """``"3M"`` → 3,000,000 tokens; ``"5%"`` → 5 % of the trace's unique prompt tokens."""
    match = _CAPACITY.match(text)
    if match is None:
        raise SimulationError(
            f"capacity {text!r}: expected tokens with an optional K/M/G suffix, or a percentage"
        )
    value, suffix = float(match.group(1)), match.group(2).lower()
    if suffix == "%":
        if unique_tokens is None:
            raise SimulationError(f"capacity {text!r}: a percentage needs the trace's size")
        tokens = int(unique_tokens * value / 100)
    else:
        tokens = int(value * _SUFFIX[suffix])
    if tokens < 1:
        raise SimulationError(f"capacity {text!r} is less than one token")
    return tokens
