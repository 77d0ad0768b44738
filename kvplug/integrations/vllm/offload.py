"""vLLM's CPU-offload tier ranked by a kvplug eviction policy (a ``CachePolicy`` by module path).

vLLM resolves an out-of-tree offload policy as ``getattr(import_module(cache_policy_module_path),
eviction_policy)`` and builds it with ``cache_capacity=``. So, in the connector's extra config:

* ``"eviction_policy": "kvplug_slru"`` runs kvplug's ``slru`` (any registered policy name works
  after ``kvplug_``; a module ``__getattr__`` makes the class), with the options the kvplug
  selection gives that policy, else its defaults;
* ``"eviction_policy": "KvplugCachePolicy"`` runs the policy the kvplug selection names:
  ``offload_eviction_policy``, else ``eviction_policy`` (``--additional-config`` or
  ``KVPLUG_VLLM``), else ``lru``;

both with ``"cache_policy_module_path": "kvplug.integrations.vllm.offload"``.

vLLM's manager owns chunk memory, ref counts and events; this class keeps the chunks and their
statistics (one :class:`ChunkStats` per resident chunk) and asks the policy for victims among
the evictable ones. A request's access counts one hit on each chunk it reused and refreshes the
recency of every chunk it touched, tail first, so that under LRU a prefix's head outlives its
tail as in vLLM's own LRU. Unlike the GPU pool, victims are not restricted to chain leaves: a
non-recency policy may evict a chunk whose successors stay offloaded but unreachable until
they are evicted in turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, cast

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from kvplug_hookspecs import CandidateStats, ComponentSelection, EvictionPolicy

from .config import policy_factory, selected_config

__all__ = ["ChunkStats", "KvplugCachePolicy", "policy_class"]

_PREFIX = "kvplug_"


class ChunkStats(CandidateStats):
    """Statistics of one resident offloaded chunk (``key`` finds it)."""

    __slots__ = ("key",)

    def __init__(self, key: OffloadKey, now: int) -> None:
        super().__init__(now, num_tokens=1)
        self.key = key
        self.content_id = int.from_bytes(bytes(key[:8]), "little")


def _configured_selection(name: str | None) -> ComponentSelection:
    """The selection for policy ``name`` (or the configured one when ``None``)."""
    additional: Any = None
    try:
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
        additional = current.additional_config if current is not None else None
    except ImportError:  # pragma: no cover - helper missing in some vLLM releases
        pass
    config = selected_config(additional)
    chosen = None
    if config is not None:
        chosen = config.offload_eviction_policy or config.eviction_policy
    if name is None:
        return chosen or ComponentSelection(name="lru")
    if chosen is not None and chosen.name == name:
        return chosen
    return ComponentSelection(name=name)


class KvplugCachePolicy(CachePolicy):  # type: ignore[misc]
    """A vLLM offload ``CachePolicy`` whose victims a kvplug ``EvictionPolicy`` chooses."""

    policy_name: ClassVar[str | None] = None
    """The kvplug policy this class runs (``None``: the one the kvplug selection names)."""

    def __init__(self, cache_capacity: int, policy: EvictionPolicy | None = None) -> None:
        super().__init__(cache_capacity)
        if policy is None:
            policy = policy_factory(_configured_selection(self.policy_name))()
        self.policy = policy
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.stats: dict[OffloadKey, ChunkStats] = {}
        self._clock = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        stats = ChunkStats(key, self._tick())
        self.chunks[key] = chunk
        self.stats[key] = stats
        if chunk.ref_cnt == 0:
            self.policy.add(stats)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self.policy.discard(self.stats.pop(key))

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext | None = None) -> None:
        """A use without a hit (vLLM 0.33 calls it for loads): refresh recency, tail first."""
        self._access(list(keys), ())

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        for keys in key_groups:
            self._access(keys, reused_keys)

    def _access(self, keys: Sequence[OffloadKey], reused: Iterable[OffloadKey]) -> None:
        reused = set(reused)
        policy, stats_of = self.policy, self.stats
        for key in reversed(keys):  # tail first: the head ends most recent
            stats = stats_of.get(key)
            if stats is None:
                continue
            stats.last_access_time = self._tick()
            if key in reused:
                stats.hit_count += 1
            policy.touch(stats)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Evict exactly ``n`` evictable chunks not in ``protected``, or change nothing."""
        if n == 0:
            return []
        policy = self.policy
        chosen: list[ChunkStats] = []
        skipped: list[ChunkStats] = []
        try:
            while len(chosen) < n:
                candidate = policy.pop()
                if candidate is None:
                    break
                stats = cast(ChunkStats, candidate)
                (skipped if stats.key in protected else chosen).append(stats)
        finally:
            for stats in skipped:
                policy.add(stats)
            if len(chosen) < n:
                for stats in chosen:
                    policy.add(stats)
        if len(chosen) < n:
            return None
        evicted = []
        for stats in chosen:
            del self.stats[stats.key]
            evicted.append((stats.key, self.chunks.pop(stats.key)))
        return evicted

    def clear(self) -> None:
        self.chunks.clear()
        self.stats.clear()
        self.policy.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self.policy.add(self.stats[key])

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.policy.discard(self.stats[key])


_classes: dict[str, type[KvplugCachePolicy]] = {}


def policy_class(name: str) -> type[KvplugCachePolicy]:
    """The ``CachePolicy`` class running kvplug policy ``name`` (validated now)."""
    cls = _classes.get(name)
    if cls is None:
        policy_factory(ComponentSelection(name=name))  # unknown names list the valid ones
        cls = type(
            f"{_PREFIX}{name}",
            (KvplugCachePolicy,),
            {"policy_name": name, "__module__": __name__},
        )
        _classes[name] = cls
    return cls


def __getattr__(attribute: str) -> Any:
    """``kvplug_<policy>``: the class vLLM's factory asks this module for."""
    if attribute.startswith(_PREFIX) and len(attribute) > len(_PREFIX):
        return policy_class(attribute[len(_PREFIX) :])
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")
