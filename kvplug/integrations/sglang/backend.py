"""The kvplug radix-cache backend: a ``BasePrefixCache`` whose tree is a kvplug cache.

Imported only when SGLang builds its tree cache with ``--radix-cache-backend kvplug``, so it
imports SGLang at module level. The kvplug cache (``radix`` or ``block_hash``) runs over
SGLang's own token allocator (seen through :class:`SGLangAllocatorView`) and the slots SGLang's
``ReqToTokenPool`` rows hold; SGLang keeps scheduling, allocating and freeing request-owned
slots, the kvplug cache owns and evicts the cached ones, and its policy ranks them.

Statistics mean what SGLang means: the scheduler's matches (every waiting request, every round)
are probes that record nothing; a request counts one hit per node when it is inserted
(``checkpoint``), and re-inserting a growing prefix does not count it again.
"""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any

import torch
from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.common import coalesce_ranges

from kvplug_hookspecs import CacheCleared, CacheKey, ComponentSelection, PrefixCacheContext
from kvplug_hookspecs import EvictParams as KvplugEvictParams
from kvplug_hookspecs import MatchResult as KvplugMatchResult

from .config import (
    BACKEND_NAME,
    ENV_VAR,
    SGLangPluginConfig,
    UnsupportedSGLangError,
    plugin_config,
    policy_factory,
    policy_selection,
)
from .events import NAMESPACE_SEPARATOR, SGLangKVEvents
from .tokens import TokenTuples

__all__ = [
    "KvplugPrefixCache",
    "NoAllocator",
    "SGLangAllocatorView",
    "check_supported",
    "sglang_cache_options",
]

logger = logging.getLogger(__name__)


class SGLangAllocatorView:
    """SGLang's token allocator seen as a kvplug ``TokenAllocator``: the cache frees through it.

    Nothing is copied or re-owned: ``free`` is SGLang's ``free_segment(..., start_pos=0)``, the
    call SGLang's own tree makes for cached pages (whole pages on a paged allocator); sizes are
    SGLang's. A test double (``unittest.mock``), which SGLang's own cache tests pass, is read
    as SGLang's tree reads it: its ``device`` when it is one, else the CPU.
    """

    def __init__(self, allocator: Any, page_size: int) -> None:
        self.sglang = allocator
        self.page_size = page_size
        self.device = _device_of(allocator)
        size = getattr(allocator, "size", 0)
        self.size = size if isinstance(size, int) else 0
        self.pool = allocator.get_kvcache()

    def available_size(self) -> int:
        return int(self.sglang.available_size())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        result: torch.Tensor | None = self.sglang.alloc(need_size)
        return result

    def free(self, indices: torch.Tensor) -> None:
        self.sglang.free_segment(indices, start_pos=0)

    def shortfall(self, num_tokens: int) -> KvplugEvictParams | None:
        deficit = num_tokens - self.available_size()
        if deficit <= 0:
            return None
        return KvplugEvictParams(num_tokens=-(-deficit // self.page_size) * self.page_size)

    def clear(self) -> None:
        self.sglang.clear()

    def free_group_begin(self) -> None:
        self.sglang.free_group_begin()

    def free_group_end(self) -> None:
        self.sglang.free_group_end()


class NoAllocator:
    """The allocator of a cache built with ``token_to_kv_pool_allocator=None`` (SGLang's
    simulated tree, ``RadixCache.create_simulated()``): the cache keeps the values it is given
    and frees nothing, as SGLang's tree does; it has no slots to hand out."""

    sglang = None
    size = 0
    pool = None

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.device = torch.device("cpu")

    def available_size(self) -> int:
        return 0

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return None

    def free(self, indices: torch.Tensor) -> None:
        """Nothing to give back: the values were never slots of an allocator."""

    def shortfall(self, num_tokens: int) -> KvplugEvictParams | None:
        return None

    def clear(self) -> None:
        pass

    def free_group_begin(self) -> None:
        pass

    def free_group_end(self) -> None:
        pass


def _namespace(extra_key: Any, cache_salt: Any) -> Any:
    """The kvplug namespace of an SGLang key: its ``extra_key``, joined by its salt."""
    if cache_salt:
        return f"{extra_key}{NAMESPACE_SEPARATOR}{cache_salt}"
    return extra_key


def _device_of(allocator: Any) -> torch.device:
    device = getattr(allocator, "device", None)
    return torch.device(device) if isinstance(device, (str, torch.device)) else torch.device("cpu")


def _is_test_double(allocator: Any) -> bool:
    """A ``unittest.mock`` object: SGLang's cache tests pass one as the allocator."""
    from unittest import mock

    return isinstance(allocator, mock.NonCallableMock)


def sglang_cache_options(config: SGLangPluginConfig) -> dict[str, Any]:
    """The kvplug cache's options under SGLang: the ``radix`` cache evicts whole leaves
    (``granularity="leaf"``), as SGLang's own tree does, unless ``KVPLUG_SGLANG`` says
    otherwise (``"exact"``: the last victim is cut to the shortfall, at most a page more).

    Whole leaves are SGLang's eviction: the same victims, the same freed slots, and as many
    eviction calls as SGLang's tree makes (an exact eviction leaves the allocator no headroom,
    so the next decode step evicts again).
    """
    options = dict(config.cache_options)
    if config.prefix_cache == "radix":
        options.setdefault("granularity", "leaf")
    return options


def check_supported(ctx: Any) -> None:
    """Refuse, one message each, what the backend does not run; never fall back silently."""
    params = ctx.params
    refused = []
    if ctx.is_hybrid_swa:
        refused.append("hybrid sliding-window models (SWA)")
    if ctx.is_hybrid_ssm:
        refused.append("hybrid SSM / Mamba models")
    if getattr(ctx, "is_dsa", False):
        refused.append("DeepSeek sparse-attention (DSA) models")
    if ctx.enable_hierarchical_cache:
        refused.append("--enable-hierarchical-cache (HiCache)")
    if params.is_eagle:
        refused.append("EAGLE speculative decoding (bigram keys)")
    if params.enable_kv_cache_events and getattr(params, "dynamo_kv_event_format", False):
        refused.append(
            'the "dynamo" KV-event format (its block hashes are SGLang\'s namespaced hash '
            "scheme; kvplug publishes its own chained page hashes: use the default format)"
        )
    if params.enable_session_radix_cache:
        refused.append("--enable-session-radix-cache")
    if params.pp_size > 1 or params.attn_cp_size > 1:
        refused.append("pipeline or context parallelism")
    allocator = params.token_to_kv_pool_allocator
    if allocator is None or _is_test_double(allocator):
        pass  # SGLang's simulated and mocked-allocator trees (its cache tests build them)
    elif type(allocator) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
        refused.append(f"the {type(allocator).__name__} allocator")
    elif params.page_size != allocator.page_size:
        refused.append(
            f"a cache page of {params.page_size} over allocator pages of {allocator.page_size}"
        )
    if refused:
        raise UnsupportedSGLangError(
            f"--radix-cache-backend {BACKEND_NAME} does not support: {'; '.join(refused)}. "
            "Remove the flag to use SGLang's own cache for this setup."
        )


class KvplugPrefixCache(BasePrefixCache):  # type: ignore[misc]  # SGLang is untyped here
    """SGLang's prefix-cache interface over a kvplug ``radix`` or ``block_hash`` cache.

    Node handles (``req.last_node``) are the kvplug cache's nodes or blocks; ``root_node`` is
    its root. ``cache`` is the kvplug cache, ``policy`` its eviction policy.

    The constructions SGLang's own ``RadixCache`` accepts are accepted alike: ``disable=True``
    (``--disable-radix-cache``) caches nothing (every match is empty, ``insert`` and
    ``checkpoint`` store nothing, ``evict`` frees nothing, locks move nothing); without an
    allocator (``token_to_kv_pool_allocator=None``) the cache keeps the values it is given and
    frees nothing on eviction; a ``unittest.mock`` allocator is called as SGLang's tree calls it.
    """

    def __init__(self, params: Any, config: SGLangPluginConfig, selection: ComponentSelection):
        from ...registry import get_registry

        self.disable = bool(params.disable)
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.config = config
        self.policy_selection = selection
        allocator = self.token_to_kv_pool_allocator
        self.allocator_view: SGLangAllocatorView | NoAllocator
        if allocator is None:
            self.allocator_view = NoAllocator(self.page_size)
        else:
            self.allocator_view = SGLangAllocatorView(allocator, self.page_size)
        self.device = self.allocator_view.device
        self._tuples = TokenTuples()
        self._new_policy = policy_factory(selection)
        registry = get_registry()
        cache_selection = ComponentSelection(
            name=config.prefix_cache, options=sglang_cache_options(config)
        )
        self._cache_kind = registry.resolve("prefix_cache", cache_selection)
        self._events = registry.cache_events()
        # radix only: probes walk SGLang's token arrays in place (probe_prefix), and
        # insert(prev=...) continues from the request's last node
        self._radix = config.prefix_cache == "radix"
        self._resumable = self._radix
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        self._kv_events: SGLangKVEvents | None = None
        # --kv-events-config: SGLang's recorder, our events (a disabled tree reports none)
        if params.enable_kv_cache_events and not self.disable:
            from sglang.srt.mem_cache.events import KVCacheEventRecorder

            self.kv_events = KVCacheEventRecorder(enabled=True, page_size=self.page_size)
            self._kv_events = SGLangKVEvents(
                self.kv_events,
                self.page_size,
                forward=self._events,
                lora_names=getattr(params, "kv_event_lora_names", None),
            )
        if params.enable_metrics:
            self.init_metrics_collector()
        self.cache: Any = None
        self.reset()

    @classmethod
    def from_build_context(cls, ctx: Any) -> KvplugPrefixCache:
        """Build from SGLang's ``TreeCacheBuildContext``, validating everything first."""
        check_supported(ctx)
        params = ctx.params
        if params.disable or ctx.disable_radix_cache:
            # SGLang's disabled tree neither builds nor validates its eviction policy
            params.disable = True
            selection = ComponentSelection(name="lru")
        else:
            selection = policy_selection(params.eviction_policy, params.eviction_policy_config)
        config = plugin_config()
        if config.prefix_cache == "block_hash":
            schedule_policy = getattr(ctx.server_args, "schedule_policy", None)
            if schedule_policy == "dfs-weight":
                raise UnsupportedSGLangError(
                    "--schedule-policy dfs-weight walks a radix tree; "
                    f"{ENV_VAR}=block_hash has none. Use the radix cache or another policy."
                )
        cache = cls(params, config, selection)
        logger.info(
            "kvplug backend: %s cache, policy %s %s, page size %d",
            config.prefix_cache,
            selection.name,
            selection.options,
            cache.page_size,
        )
        return cache

    # -- whole-cache ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Start an empty kvplug cache. SGLang clears its allocator right after (flush), so the
        cached slots are dropped, not freed, as SGLang's own tree does. With KV events on,
        queues ``AllBlocksCleared`` (at construction too, as SGLang's tree does); kvplug
        observers get ``CacheCleared`` on a flush."""
        sink, old = self._kv_events, self.cache
        cleared = None
        if old is not None:
            cleared = CacheCleared(cache=old.name, num_tokens=old.total_size())
        if sink is not None:
            sink.cache_cleared(cleared)
        elif self._events is not None and cleared is not None:
            self._events.cache_cleared(cleared)
        context = PrefixCacheContext(
            allocator=self.allocator_view,
            new_policy=self._new_policy,
            page_size=self.page_size,
            events=self._events if sink is None else sink,
        )
        self.cache = self._cache_kind.registration.factory(context, self._cache_kind.options)
        self.root_node = self.cache.root
        self._tuples.clear()

    @property
    def policy(self) -> Any:
        """The kvplug eviction policy ranking the evictable nodes."""
        return self.cache.policy

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    # -- keys -----------------------------------------------------------------------------------

    def _cache_key(self, key: Any) -> CacheKey:
        """A kvplug key for an SGLang ``RadixKey`` (its ``limit`` honoured), page-aligned; the
        salt joins the namespace. The tokens come from :class:`TokenTuples` (no per-call copy
        of a request's array)."""
        if key.is_bigram:
            raise UnsupportedSGLangError("kvplug backend: bigram (EAGLE) keys are not supported")
        ids = key.token_ids
        length = len(ids)
        if key.limit is not None and key.limit < length:
            length = key.limit
        return self._key(ids, length - length % self.page_size, key.extra_key, key.cache_salt)

    def _key(self, ids: Any, aligned: int, extra_key: Any, cache_salt: Any) -> CacheKey:
        return CacheKey(self._tuples.get(ids, aligned), _namespace(extra_key, cache_salt))

    # -- match ----------------------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The cached prefix and its node; a probe: no hit, no statistic, no index tensor."""
        if self.disable:
            root = self.root_node
            return MatchResult(0, root, root, root)
        key = params.key
        ids = key.token_ids
        if self._radix and type(ids) is array and not key.is_bigram:
            # SGLang's token array, walked in place: no tuple of the prompt for a probe
            length = len(ids)
            if key.limit is not None and key.limit < length:
                length = key.limit
            namespace = _namespace(key.extra_key, key.cache_salt)
            node, prefix_len = self.cache.probe_prefix(ids, length, namespace)
        else:
            found = self.cache.match_prefix(self._cache_key(key), record_hit=False, gather=False)
            node, prefix_len = found.last_node, found.prefix_len
        # device_prefix_len, last_device_node, last_host_node, best_match_node
        return MatchResult(prefix_len, node, node, node)

    def touch_prefix(self, key: Any) -> None:
        if not self.disable:
            self.cache.touch_prefix(self._cache_key(key))

    def path_device_indices(self, node: Any) -> torch.Tensor:
        indices: torch.Tensor = self.cache.path_indices(node)
        return indices

    def prefix_device_indices(self, req: Any) -> torch.Tensor:
        """The slots of the request's matched prefix: a copy of its node's path, sliced only
        when the prefix ends before the node (a match ends at its node: SGLang's base method
        always slices)."""
        indices: torch.Tensor = self.cache.path_indices(req.last_node)
        length = req.prefix_len
        if indices.shape[0] == length:
            return indices
        if indices.shape[0] < length:
            raise RuntimeError(
                f"kvplug backend: request {req.rid} matched {length} tokens, "
                f"its node holds {indices.shape[0]}"
            )
        return indices[:length]

    # -- insert ---------------------------------------------------------------------------------

    def insert(self, params: InsertParams) -> InsertResult:
        """SGLang's ``insert``: cache ``params.key`` (page-aligned) with ``params.value``.

        As SGLang's tree: ``value=None`` caches the token ids themselves as values (SGLang's
        debug and test fallback); ``prefix_len`` is the length that was already cached; the
        caller keeps (and frees) its own slots for that part, so nothing is freed here;
        ``inserted_len`` is how much this request inserted before (its nodes are not counted a
        hit again). The scheduler itself inserts through ``checkpoint``.
        """
        if self.disable:
            return InsertResult(prefix_len=0)
        key = self._cache_key(params.key)
        aligned = len(key.token_ids)
        if params.value is None:
            value = torch.tensor(key.token_ids, dtype=torch.int64, device=self.device)
        else:
            value = params.value[:aligned]
        found = self.cache.match_prefix(key, record_hit=False)
        prefix = found.prefix_len
        if prefix:  # the cached slots for the cached part: the caller's stay the caller's
            value = torch.cat((found.device_indices, value[prefix:].to(torch.int64)))
        hits_after = params.inserted_len or 0
        self.cache.insert(key, value, priority=params.priority or 0, hits_after=hits_after)
        node = self.cache.match_prefix(key, record_hit=False, gather=False).last_node
        return InsertResult(prefix_len=prefix, last_device_node=node)

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Cache the request's row up to ``up_to``, repoint the row at the cached slots, move
        its lock to the new last node and advance ``cache_protected_len``.

        The kvplug cache frees the request's duplicates of what was already cached (slots in
        ``[cache_protected_len, prefix)`` that differ from the cached ones); the unaligned tail
        stays the request's, for ``release_kv_cache`` to free.
        """
        if self.disable:
            return
        kv = req.kv
        aligned = min(up_to, len(req.full_untruncated_fill_ids))
        aligned -= aligned % self.page_size
        key = self._key(req.full_untruncated_fill_ids, aligned, req.extra_key, req.cache_salt)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        values = row[:aligned].to(dtype=torch.int64, copy=True)
        priority, hits_after = req.priority or 0, kv.cache_inserted_len
        if self._resumable and req.last_node is not None:
            # SGLang's previous match or checkpoint of this request (its lock keeps the node
            # cached): the radix insert continues from it after an O(1) check, or walks from
            # the root when it no longer describes this key; the result is the same
            prev = KvplugMatchResult(self._empty, req.last_node, kv.cache_protected_len)
            self.cache.insert(key, values, priority=priority, hits_after=hits_after, prev=prev)
        else:
            self.cache.insert(key, values, priority=priority, hits_after=hits_after)
        kv.cache_inserted_len = max(kv.cache_inserted_len, aligned)
        node = self.cache.match_prefix(key, record_hit=False, gather=False).last_node
        cached = self.cache.path_indices(node)
        if len(cached) != aligned:
            raise RuntimeError(
                f"kvplug backend: request {req.rid} cached {len(cached)} of {aligned} tokens"
            )
        start = kv.cache_protected_len
        self.req_to_token_pool.write((kv.req_pool_idx, slice(start, aligned)), cached[start:])
        kv.cache_protected_len = aligned
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        """SGLang's ``free_kv_row`` without its sliding-window split (the backend refuses SWA
        models, so every range goes back to the full pool): the row's ranges, adjacent ones
        merged (a page is freed once), in one ``free_segments`` call."""
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        segments = [(row[start:end], start) for start, end in coalesce_ranges(ranges)]
        if segments:
            self.token_to_kv_pool_allocator.free_segments(segments)

    # -- eviction and locks ---------------------------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        """Free ``params.num_tokens`` cached tokens in the kvplug policy's order (whole pages)."""
        if self.disable:
            return EvictResult()
        start = time.perf_counter()
        if params.swa_num_tokens or params.mamba_num:
            raise UnsupportedSGLangError("kvplug backend: SWA / Mamba eviction is not supported")
        result = self.cache.evict(KvplugEvictParams(num_tokens=params.num_tokens))
        self.update_eviction_metrics(result.num_tokens, start)
        return EvictResult(num_tokens_evicted=result.num_tokens)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        return IncLockRefResult(delta=self.cache.inc_lock_ref(node))

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        return DecLockRefResult(delta=self.cache.dec_lock_ref(node))

    # -- sizes and inspection -------------------------------------------------------------------

    def evictable_size(self) -> int:
        return int(self.cache.evictable_size())

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def protected_size(self) -> int:
        return int(self.cache.protected_size())

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        return int(self.cache.total_size())

    def all_values_flatten(self) -> torch.Tensor:
        values: torch.Tensor = self.cache.all_values_flatten()
        return values

    def kvplug_stats(self) -> dict[str, Any]:
        """kvplug's counters (evictions, evicted and inserted tokens) plus the policy name."""
        return {**self.cache.stats.as_dict(), "policy": self.policy_selection.name}

    def pretty_print(self) -> None:
        print(repr(self.cache))
        print(f"#tokens: {self.total_size()}")
