"""Storage hierarchies in a simulation: the ``--tiers`` flag and bookkeeping stand-ins.

A simulated pool keeps no KV, so neither do its tiers: every configured tier becomes an
in-memory bookkeeping tier (``host`` as it is; ``disk``, ``redis`` and others as the ``memory``
tier under their name, medium, latency and bandwidth), with the capacity it has or is given.
Demotion runs on the caller's thread (``background = false``), so a run is deterministic.

``--tiers`` gives hierarchies by a short spec, fastest tier first: ``host=10x`` (ten times the
device capacity of the run), ``host=10x,disk=50M`` (tokens, K/M/G suffixes), ``redis=2x:lfu``
(a tier's own eviction policy after a colon); ``none`` is the device alone. Several
hierarchies are separated by ``;`` and each runs beside the others.
"""

from __future__ import annotations

import re
from typing import Any

from kvplug_hookspecs import ComponentSelection, StorageConfig

from ..tiers.disk import DiskTierOptions
from ..tiers.redis_tier import RedisTierOptions
from .capacity import SimulationError, parse_capacity

__all__ = [
    "NO_TIERS",
    "bookkeeping_storage",
    "combined_tokens",
    "parse_hierarchies",
    "tier_selections",
    "tiers_label",
]

NO_TIERS = "none"
_UNBOUNDED = 1 << 50
_TIER_RE = re.compile(r"^\s*([a-z][a-z0-9_\-]*)\s*=\s*([^:]+?)\s*(?::\s*([a-z][a-z0-9_\-]*))?\s*$")
_MEDIA = {"host": "CPU", "cpu": "CPU", "disk": "Disk", "redis": "Redis", "valkey": "Redis"}
_COSTS = {
    "disk": (DiskTierOptions.model_fields["latency_s"].default,
             DiskTierOptions.model_fields["bandwidth_bytes_per_s"].default),
    "redis": (RedisTierOptions.model_fields["latency_s"].default,
              RedisTierOptions.model_fields["bandwidth_bytes_per_s"].default),
}  # fmt: skip


def parse_hierarchies(text: str) -> list[str]:
    """Split and check a ``--tiers`` value; each spec is resolved per run (``10x`` needs the
    run's device capacity)."""
    specs = [part.strip() for part in text.split(";") if part.strip()]
    if not specs:
        raise SimulationError("--tiers is empty: give e.g. 'host=10x' or 'none;host=10x'")
    for spec in specs:
        tier_selections(spec, 1)  # the syntax, with a stand-in capacity
    return specs


def _size(text: str, device_tokens: int) -> int:
    if text.lower().endswith("x"):
        try:
            factor = float(text[:-1])
        except ValueError:
            raise SimulationError(f"tier size {text!r}: expected e.g. 10x or 5M") from None
        if factor <= 0:
            raise SimulationError(f"tier size {text!r} must be positive")
        return max(1, int(factor * device_tokens))
    return parse_capacity(text)


def tier_selections(spec: str, device_tokens: int) -> list[dict[str, Any]]:
    """The bookkeeping tiers of one ``--tiers`` hierarchy at this device capacity."""
    if spec.strip().lower() == NO_TIERS:
        return []
    out = []
    for part in spec.split(","):
        match = _TIER_RE.match(part.lower())
        if match is None:
            raise SimulationError(f"tier {part.strip()!r}: expected NAME=SIZE[:POLICY]")
        name, size, policy = match.groups()
        options: dict[str, Any] = {"capacity_tokens": _size(size, device_tokens)}
        if policy:
            options["eviction_policy"] = policy
        out.append(_stand_in(name, options))
    return out


def combined_tokens(spec: str | None, device_tokens: int) -> int:
    """The tokens a ``--tiers`` hierarchy holds below a device of ``device_tokens``."""
    if spec is None:
        return 0
    return sum(t["options"]["capacity_tokens"] for t in tier_selections(spec, device_tokens))


def _stand_in(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A bookkeeping tier for tier ``name``: ``host`` itself, else ``memory`` dressed as it."""
    if name in ("host", "cpu"):
        return {"name": "host", "options": options}
    latency, bandwidth = _COSTS.get(name, (None, None))
    extra: dict[str, Any] = {"label": name, "medium": _MEDIA.get(name, name.capitalize())}
    if latency is not None:
        extra.update(latency_s=latency, bandwidth_bytes_per_s=bandwidth)
    return {"name": "memory", "options": {**extra, **options}}


def bookkeeping_storage(
    storage: StorageConfig, spec: str | None, device_tokens: int, bytes_per_token: int
) -> dict[str, Any] | None:
    """The storage section of a simulated run: the config's tiers as bookkeeping stand-ins
    (a disk's ``capacity_bytes`` turned into tokens, a Redis server unbounded) followed by the
    ``--tiers`` spec's; ``None`` when there are none."""
    tiers: list[dict[str, Any]] = []
    for tier in storage.tiers:
        tiers.append(_config_stand_in(tier, bytes_per_token))
    if spec is not None:
        tiers.extend(tier_selections(spec, device_tokens))
    if not tiers:
        return None
    data = storage.model_dump(mode="json")
    data.update(tiers=tiers, background=False)
    return data


def _config_stand_in(tier: ComponentSelection, bytes_per_token: int) -> dict[str, Any]:
    options = dict(tier.options)
    if tier.name in ("host", "cpu", "memory"):
        return {"name": tier.name, "options": options}
    if tier.name == "disk":
        capacity = int(
            options.get("capacity_bytes", DiskTierOptions.model_fields["capacity_bytes"].default)
        ) // max(1, bytes_per_token)
    else:
        capacity = _UNBOUNDED
    keep: dict[str, Any] = {
        k: options[k] for k in ("latency_s", "bandwidth_bytes_per_s") if k in options
    }
    selection = _stand_in(tier.name, {"capacity_tokens": max(1, capacity), **keep})
    return selection


def tiers_label(spec: str | None) -> str:
    """How a run's hierarchy is shown in reports (``""``: the device alone)."""
    if spec is None or spec.strip().lower() == NO_TIERS:
        return ""
    return spec.replace(" ", "")
