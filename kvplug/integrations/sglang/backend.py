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
    MatchPrefixParams,
    MatchResult,
)

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

__all__ = ["KvplugPrefixCache", "SGLangAllocatorView", "check_supported"]

logger = logging.getLogger(__name__)


class SGLangAllocatorView:
    """SGLang's token allocator seen as a kvplug ``TokenAllocator``: the cache frees through it.

    Nothing is copied or re-owned: ``free`` is SGLang's ``free`` (whole pages on a paged
    allocator), sizes are SGLang's.
    """

    def __init__(self, allocator: Any) -> None:
        self.sglang = allocator
        self.size = int(allocator.size)
        self.page_size = int(allocator.page_size)
        self.device = torch.device(allocator.device)
        self.pool = allocator.get_kvcache()

    def available_size(self) -> int:
        return int(self.sglang.available_size())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        result: torch.Tensor | None = self.sglang.alloc(need_size)
        return result

    def free(self, indices: torch.Tensor) -> None:
        self.sglang.free(indices)

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
    if ctx.disable_radix_cache:
        refused.append("--disable-radix-cache (kvplug is a prefix cache; drop one of the flags)")
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
    if type(allocator) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
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
    """

    def __init__(self, params: Any, config: SGLangPluginConfig, selection: ComponentSelection):
        from ...registry import get_registry

        self.disable = False
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.config = config
        self.policy_selection = selection
        self.allocator_view = SGLangAllocatorView(self.token_to_kv_pool_allocator)
        self._new_policy = policy_factory(selection)
        registry = get_registry()
        cache_selection = ComponentSelection(name=config.prefix_cache, options=config.cache_options)
        self._cache_kind = registry.resolve("prefix_cache", cache_selection)
        self._events = registry.cache_events()
        # insert(prev=...) continues from the request's last node (radix only)
        self._resumable = config.prefix_cache == "radix"
        self._empty = torch.empty(0, dtype=torch.int64)
        self._kv_events: SGLangKVEvents | None = None
        if params.enable_kv_cache_events:  # --kv-events-config: SGLang's recorder, our events
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

    @property
    def policy(self) -> Any:
        """The kvplug eviction policy ranking the evictable nodes."""
        return self.cache.policy

    def supports_prefix_sharing(self) -> bool:
        return True

    # -- keys -----------------------------------------------------------------------------------

    def _cache_key(self, key: Any, length: int | None = None) -> CacheKey:
        """A kvplug key for an SGLang ``RadixKey``, page-aligned; the salt joins the namespace."""
        if getattr(key, "is_bigram", False):
            raise UnsupportedSGLangError("kvplug backend: bigram (EAGLE) keys are not supported")
        ids = key.raw_token_ids() if length is None else key.token_ids[:length]
        aligned = len(ids) - len(ids) % self.page_size
        namespace = key.extra_key
        if key.cache_salt:
            namespace = f"{namespace}{NAMESPACE_SEPARATOR}{key.cache_salt}"
        return CacheKey(tuple(ids[:aligned]), namespace)

    # -- match ----------------------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The cached prefix and its node; a probe: no hit, no statistic, no index tensor."""
        found = self.cache.match_prefix(self._cache_key(params.key), record_hit=False, gather=False)
        node = found.last_node
        return MatchResult(
            device_prefix_len=found.prefix_len,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )

    def touch_prefix(self, key: Any) -> None:
        self.cache.touch_prefix(self._cache_key(key))

    def path_device_indices(self, node: Any) -> torch.Tensor:
        indices: torch.Tensor = self.cache.path_indices(node)
        return indices

    # -- insert ---------------------------------------------------------------------------------

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Cache the request's row up to ``up_to``, repoint the row at the cached slots, move
        its lock to the new last node and advance ``cache_protected_len``.

        The kvplug cache frees the request's duplicates of what was already cached (slots in
        ``[cache_protected_len, prefix)`` that differ from the cached ones); the unaligned tail
        stays the request's, for ``release_kv_cache`` to free.
        """
        kv = req.kv
        token_ids = req.full_untruncated_fill_ids[:up_to]
        key = self._cache_key_of(req, token_ids)
        aligned = len(key.token_ids)
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

    def _cache_key_of(self, req: Any, token_ids: Any) -> CacheKey:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return self._cache_key(RadixKey(token_ids, req.extra_key, cache_salt=req.cache_salt))

    # -- eviction and locks ---------------------------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        """Free ``params.num_tokens`` cached tokens in the kvplug policy's order (whole pages)."""
        start = time.perf_counter()
        if params.swa_num_tokens or params.mamba_num:
            raise UnsupportedSGLangError("kvplug backend: SWA / Mamba eviction is not supported")
        result = self.cache.evict(KvplugEvictParams(num_tokens=params.num_tokens))
        self.update_eviction_metrics(result.num_tokens, start)
        return EvictResult(num_tokens_evicted=result.num_tokens)

    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        return IncLockRefResult(delta=self.cache.inc_lock_ref(node))

    def dec_lock_ref(self, node: Any, params: DecLockRefParams | None = None) -> DecLockRefResult:
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
