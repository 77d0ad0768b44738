"""Pydantic models for every parameter that crosses the plugin boundary.

All models are frozen and forbid unknown fields: a bad value raises ``pydantic.ValidationError``
naming the field; nothing is silently clamped or dropped.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "TORCH_DTYPES",
    "BlockHashConfig",
    "CacheCleared",
    "ComponentSelection",
    "EvictParams",
    "EvictResult",
    "FrozenModel",
    "KVCacheConfig",
    "KVEventsConfig",
    "MetricsConfig",
    "NoOptions",
    "PoolGeometry",
    "PrefixRemoved",
    "PrefixStored",
    "StorageConfig",
    "TierCostModel",
    "TierNamespace",
    "TierStats",
]

NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
PositiveInt = Annotated[int, Field(gt=0, strict=True)]


class FrozenModel(BaseModel):
    """Base of every boundary model: immutable, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class NoOptions(FrozenModel):
    """Options model of a component that takes no options."""


class EvictParams(FrozenModel):
    """How many tokens a cache must free, per pool.

    ``num_tokens`` counts full-attention slots, ``swa_num_tokens`` sliding-window slots and
    ``mamba_num`` state slots of hybrid models. An allocator's ``shortfall()`` builds this from
    what a request needs minus what is free: it is the shortfall, never the request size.
    """

    num_tokens: NonNegativeInt = 0
    swa_num_tokens: NonNegativeInt = 0
    mamba_num: NonNegativeInt = 0

    @property
    def is_empty(self) -> bool:
        """True when nothing needs freeing in any pool."""
        return self.num_tokens == 0 and self.swa_num_tokens == 0 and self.mamba_num == 0


class EvictResult(FrozenModel):
    """What an eviction actually freed, per pool (the fields of ``EvictParams``)."""

    num_tokens: NonNegativeInt = 0
    swa_num_tokens: NonNegativeInt = 0
    mamba_num: NonNegativeInt = 0


TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
"""dtype names a KV pool accepts (the ``torch`` attribute names)."""

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?)$")


class PoolGeometry(FrozenModel):
    """Shape of the KV pool: how many token slots, how they are paged, and the tensor layout.

    ``capacity_tokens`` counts usable slots; pools add one reserved padding page on top, as
    SGLang does. ``device="auto"`` means CUDA when torch sees one, else the CPU.
    ``store_kv=False`` keeps the slot bookkeeping but allocates no K/V buffers (a simulator's
    pool: a 3M-token capacity then costs no memory).
    """

    capacity_tokens: PositiveInt = 65536
    page_size: PositiveInt = 1
    num_layers: PositiveInt = 1
    kv_heads: PositiveInt = 1
    head_dim: PositiveInt = 64
    dtype: Literal[TORCH_DTYPES] = "float16"  # type: ignore[valid-type]
    device: str = "auto"
    store_kv: bool = True

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError(
                f"unknown device {value!r}; "
                "expected 'auto', 'cpu', 'cuda', 'cuda:N', 'mps' or 'xpu'"
            )
        return value

    @model_validator(mode="after")
    def _page_divides_capacity(self) -> PoolGeometry:
        if self.capacity_tokens % self.page_size:
            raise ValueError(
                f"capacity_tokens={self.capacity_tokens} is not a multiple of "
                f"page_size={self.page_size}"
            )
        return self


_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]*$")


class ComponentSelection(FrozenModel):
    """One component chosen by name; ``options`` are validated later by that plugin's own model.

    A bare string is accepted as shorthand: ``"lru"`` means ``{"name": "lru"}``.
    """

    name: str
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, value: Any) -> Any:
        # Say what a selection is, rather than pydantic's "valid dictionary or instance".
        if isinstance(value, str):
            return {"name": value}
        if not isinstance(value, (dict, ComponentSelection)):
            raise ValueError(
                "expected a component name or a table with a 'name' (and 'options'), "
                f"got {type(value).__name__}"
            )
        return value

    @field_validator("name")
    @classmethod
    def _normalise_name(cls, value: str) -> str:
        name = value.strip().lower()
        if not _NAME_RE.match(name):
            raise ValueError(f"invalid component name {value!r}")
        return name


class KVEventsConfig(FrozenModel):
    """Publishing the cache's KV events in vLLM's wire format (``kvplug.cluster``).

    The fields, their names and defaults are vLLM's ``KVEventsConfig``: ``publisher="zmq"`` (or
    ``enable_kv_cache_events=true`` with no publisher, as in vLLM) publishes ``KVEventBatch``es
    on a ZMQ PUB socket at ``endpoint`` (bound when it holds ``*``, ``::``, or is ``ipc://`` /
    ``inproc://``, else connected), topic ``topic``; ``replay_endpoint`` (a ROUTER socket)
    resends the last ``buffer_steps`` batches from a requested sequence number; ``hwm`` is the
    PUB socket's send high-water mark; ``max_queue_size`` bounds the batches waiting for the
    sender thread (the oldest are dropped, and counted, past it). ``"null"`` (the default) is off.

    kvplug's own: ``publisher="inproc"`` cuts the same per-step batches without ZMQ, for a
    consumer in the same process (``stack.observers[0].batcher.take_batches()``, e.g. a
    simulated KV-aware router); ``hashes`` puts block hashes on the wire as 64-bit ints (vLLM's
    default) or bytes; ``data_parallel_rank`` is written in every batch (vLLM's publisher writes
    its rank, 0 without data parallelism).
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq", "inproc"] = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: PositiveInt = 10_000
    hwm: NonNegativeInt = 100_000
    max_queue_size: PositiveInt = 100_000
    topic: str = ""
    hashes: Literal["int", "bytes"] = "int"
    data_parallel_rank: NonNegativeInt = 0

    @model_validator(mode="before")
    @classmethod
    def _publisher_from_enable(cls, value: Any) -> Any:
        # vLLM: with no publisher named, enable_kv_cache_events picks "zmq", else "null".
        if isinstance(value, dict) and value.get("publisher") is None:
            value = {k: v for k, v in value.items() if k != "publisher"}
            if value.get("enable_kv_cache_events"):
                value["publisher"] = "zmq"
        return value

    @property
    def enabled(self) -> bool:
        """True when a publisher is selected."""
        return self.publisher != "null"


class MetricsConfig(FrozenModel):
    """Prometheus metrics of the cache (``kvplug.cluster.metrics``), served over HTTP.

    ``port``: where ``/metrics`` is served (``0`` picks a free port; ``None`` serves nothing,
    e.g. when the engine already serves the default registry). ``host``: the address to bind.
    ``namespace``: the metric name prefix, ``kvplug`` by default (``kvplug:prefix_cache_hits``);
    ``vllm`` gives vLLM's own names, for dashboards built on them, when no vLLM engine exports
    into the same registry. ``labels``: constant labels on every metric (vLLM's dashboards
    select on ``model_name`` and ``engine``).
    """

    port: Annotated[int, Field(ge=0, le=65535, strict=True)] | None = 8000
    host: str = "127.0.0.1"
    namespace: Annotated[str, Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_]*$")] = "kvplug"
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _label_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.match(r"^[a-zA-Z_][a-zA-Z0-9_]*$", name) or name.startswith("__"):
                raise ValueError(f"invalid Prometheus label name {name!r}")
        return value


class BlockHashConfig(FrozenModel):
    """How prefix caches hash their pages (``kvplug.caches.block_hashing``).

    ``scheme="kvplug"`` (default): kvplug's fast chain (``algorithm`` ``sha256`` or
    ``blake2b`` over each page's packed int64 tokens). ``scheme="vllm"``: bit-identical to
    vLLM's prefix-cache block hashes for the same tokens, block size and extra keys
    (``algorithm`` is vLLM's ``prefix_caching_hash_algo``: ``sha256`` (pickle), ``sha256_cbor``,
    ``xxhash``, ``xxhash_cbor``), chained from vLLM's ``NONE_HASH``: the hash of
    ``none_hash_seed`` when given, else of ``PYTHONHASHSEED`` when set, else of vLLM's fixed
    seed ``"vllm-none-hash"`` (vLLM draws a random seed for xxhash then: kvplug refuses, a
    random root could never match). A bare string is the scheme: ``block_hash = "vllm"``.
    """

    scheme: Literal["kvplug", "vllm"] = "kvplug"
    algorithm: Literal["sha256", "blake2b", "sha256_cbor", "xxhash", "xxhash_cbor"] | None = None
    none_hash_seed: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_scheme(cls, value: Any) -> Any:
        return {"scheme": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _algorithm_fits_scheme(self) -> BlockHashConfig:
        kvplug = ("sha256", "blake2b")
        if self.scheme == "kvplug" and self.algorithm not in (None, *kvplug):
            raise ValueError(f"algorithm {self.algorithm!r} is vLLM's: use scheme='vllm'")
        if self.scheme == "vllm" and self.algorithm == "blake2b":
            raise ValueError("vLLM has no 'blake2b' block hash")
        if self.scheme == "kvplug" and self.none_hash_seed is not None:
            raise ValueError("none_hash_seed is a setting of scheme='vllm'")
        return self


class TierNamespace(FrozenModel):
    """Everything that makes two engines' KV pages incompatible.

    ``id`` (a hex digest of all fields) prefixes every key a tier stores: a Redis key, a disk
    directory. Two engines share pages only when every field is equal.
    """

    model_id: str
    num_layers: PositiveInt
    kv_heads: PositiveInt
    head_dim: PositiveInt
    dtype: str
    page_size: PositiveInt
    hash_function: str

    @property
    def id(self) -> str:
        """24 hex digits of SHA-256 over the fields (stable across processes and machines)."""
        data = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(data).hexdigest()[:24]


class TierCostModel(FrozenModel):
    """When loading a page beats recomputing it (the hierarchy's load policy).

    Recomputing ``n`` tokens at depth ``d`` costs ``n / prefill_tokens_per_s`` seconds, times
    ``1 + quadratic * (d + n/2)`` for attention's growth with depth. Loading them from a tier
    costs the tier's ``latency_s`` plus ``n * kv_bytes_per_token / bandwidth_bytes_per_s``.
    ``kv_bytes_per_token`` defaults to the pool geometry's (``2 x layers x kv_heads x head_dim x
    dtype size``). A run of pages is loaded only when its load time is below its recompute time.
    The defaults describe an 8B-class model on one H100-class GPU: measure your own.
    """

    prefill_tokens_per_s: float = Field(default=20_000.0, gt=0)
    quadratic: float = Field(default=0.0, ge=0)
    kv_bytes_per_token: PositiveInt | None = None

    def recompute_s(self, num_tokens: int, depth: int) -> float:
        """Seconds to prefill ``num_tokens`` new tokens after ``depth`` cached ones."""
        scale = 1 + self.quadratic * (depth + num_tokens / 2)
        return num_tokens / self.prefill_tokens_per_s * scale


class StorageConfig(FrozenModel):
    """The storage hierarchy of an engine config: tiers from fastest to slowest, and policies.

    ``tiers``: each ``{name, options}`` validated by its plugin's options model (e.g.
    ``[{name = "host", options = {capacity_tokens = 1048576}}, "disk"]``). No tiers (the
    default): the caches behave exactly as without this feature and pay nothing.
    ``write_policy``: ``write_back`` demotes a page when the device evicts it; ``write_through``
    stores every page when it is inserted (as SGLang HiCache offers), so an eviction moves nothing.
    ``min_load_pages``: a tier run shorter than this is recomputed, not loaded.
    ``model_id``: part of the namespace (give the model's name: two models with the same geometry
    must not share KV). ``queue_pages``: the background demotion queue's bound; a demotion that
    finds it full is dropped and counted, never waited for. ``background=False`` demotes on the
    caller's thread (a simulator's bookkeeping tiers, deterministic tests). ``prefetch``: when
    a request is queued, the engine asks the cache to copy the pages of its prefix that only a
    slower tier holds (disk, Redis) into the fastest (host) in the background, so admitting it
    loads from host memory (SGLang HiCache's prefetch from its storage tier). ``handoff``: when
    the background worker gets a demotion: ``immediate``, or ``step``: when the engine has
    scheduled its step (it calls the hierarchy's ``end_step`` before the forward pass, as
    kvplug's scheduler does), so the worker runs while the device computes instead of
    contending with the scheduler for Python's GIL (SGLang and vLLM start their offload copies
    at the same point of a step).
    """

    tiers: tuple[ComponentSelection, ...] = ()
    write_policy: Literal["write_back", "write_through"] = "write_back"
    min_load_pages: PositiveInt = 1
    cost: TierCostModel = TierCostModel()
    model_id: str = "default"
    queue_pages: PositiveInt = 4096
    background: bool = True
    prefetch: bool = False
    handoff: Literal["immediate", "step"] = "immediate"

    @model_validator(mode="after")
    def _distinct_tiers(self) -> StorageConfig:
        names = [tier.name for tier in self.tiers]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"storage tier {repeated[0]!r} is listed twice")
        return self


class TierStats(FrozenModel):
    """A tier's counters (``stats()``); names follow vLLM's ``kv_offload`` and Dynamo's KVBM.

    ``pages``/``tokens``/``bytes`` are what the tier holds now; ``stored_*`` what was written,
    ``loaded_*`` what was read for a hit; ``evicted_pages`` what its own bound pushed out;
    ``failures`` calls that raised (connection refused, timeouts, a full disk); ``corrupt_pages``
    pages that failed their checks (discarded).
    """

    name: str
    medium: str
    pages: NonNegativeInt = 0
    tokens: NonNegativeInt = 0
    bytes: NonNegativeInt = 0
    capacity_tokens: NonNegativeInt | None = None
    stored_pages: NonNegativeInt = 0
    stored_bytes: NonNegativeInt = 0
    loaded_pages: NonNegativeInt = 0
    loaded_bytes: NonNegativeInt = 0
    evicted_pages: NonNegativeInt = 0
    failures: NonNegativeInt = 0
    corrupt_pages: NonNegativeInt = 0


class KVCacheConfig(FrozenModel):
    """The engine's KV-cache configuration: which plugins to use, the pool geometry, and the
    storage hierarchy below the pool (``storage``; none by default).

    Structure is validated here; each ``options`` dict is validated by the selected plugin's
    options model when the registry resolves the config (``kvplug.build`` or
    ``kvplug config validate``).
    """

    allocator: ComponentSelection = ComponentSelection(name="standard")
    prefix_cache: ComponentSelection = ComponentSelection(name="radix")
    eviction_policy: ComponentSelection = ComponentSelection(name="lru")
    pool: PoolGeometry = PoolGeometry()
    storage: StorageConfig = StorageConfig()
    block_hash: BlockHashConfig | None = None
    kv_events: KVEventsConfig = KVEventsConfig()
    metrics: MetricsConfig | None = None


class PrefixStored(FrozenModel):
    """A prefix (or its new tail) became cached: ``num_tokens`` newly cached tokens.

    ``block_hashes``: one chained, position-aware hash per new page (``radix`` and
    ``block_hash``; see ``kvplug.caches.block_hashing``), root side first.
    ``parent_block_hash``: the hash of the cached page the first new page follows (``None`` at
    the start of a prefix). ``token_ids``: the new pages' tokens (``num_tokens`` of them), so a
    consumer (a cache-aware router) can rebuild the chain, as with vLLM's and SGLang's
    ``BlockStored``. ``medium``: where the pages now live, in vLLM's spelling (``"GPU"`` for the
    device pool; a storage tier reports its own, e.g. ``"CPU"``, ``"Disk"``).
    """

    cache: str
    num_tokens: NonNegativeInt
    block_hashes: tuple[int, ...] = ()
    extra_key: str | None = None
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    medium: str = "GPU"


class PrefixRemoved(FrozenModel):
    """Cached tokens were removed, because of eviction or of a window-side (SWA) eviction.

    ``block_hashes``: the removed pages' hashes (the ones their ``PrefixStored`` carried).
    ``medium``: where they were removed from (``"GPU"``, or a storage tier's medium).
    """

    cache: str
    num_tokens: NonNegativeInt
    block_hashes: tuple[int, ...] = ()
    reason: Literal["evicted", "swa_evicted"] = "evicted"
    medium: str = "GPU"


class CacheCleared(FrozenModel):
    """The whole cache was reset; ``num_tokens`` cached tokens were dropped."""

    cache: str
    num_tokens: NonNegativeInt
