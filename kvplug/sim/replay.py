"""Replay one trace through one configuration: the real kvplug stack under the reference
scheduler, with a pool that keeps slot bookkeeping only (no K/V memory)."""

from __future__ import annotations

import gc
import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from kvplug_hookspecs import FrozenModel, KVCacheConfig, PrefixCacheContext

from ..config import load_config
from ..engine import Request, Scheduler, SchedulerOptions
from ..stack import KVCacheStack, build
from ..tiers import kv_bytes_per_token
from ..traces import (
    PRESETS,
    SyntheticSpec,
    TraceRequest,
    read_mooncake,
    read_token_jsonl,
    synthetic_trace,
)
from .belady import BeladyOracle, BeladyPolicy
from .capacity import SimulationError, parse_capacity
from .metrics import PrefillCost, RunResult
from .tiers import bookkeeping_storage, tiers_label

__all__ = [
    "BELADY",
    "RunSpec",
    "SimulationError",
    "TraceSource",
    "check_names",
    "parse_capacity",
    "run_one",
    "trace_summary",
]

BELADY = "belady"


class TraceSource(FrozenModel):
    """Where requests come from: a file (``mooncake`` or ``tokens`` JSONL) or the generator."""

    kind: Literal["synthetic", "mooncake", "tokens"] = "synthetic"
    path: str | None = None
    preset: str = "chat"
    synthetic: SyntheticSpec | None = None
    block_size: int = Field(512, ge=1)
    limit: int | None = Field(None, ge=1)
    skip_bad: bool = False

    @property
    def name(self) -> str:
        if self.kind == "synthetic":
            return f"synthetic:{self.preset}"
        return os.path.basename(self.path or "")

    def spec(self) -> SyntheticSpec:
        if self.synthetic is not None:
            return self.synthetic
        if self.preset not in PRESETS:
            raise SimulationError(
                f"unknown synthetic preset {self.preset!r}; valid: {', '.join(PRESETS)}"
            )
        spec = PRESETS[self.preset]
        return spec.model_copy(update={"num_requests": self.limit}) if self.limit else spec

    @property
    def trace_block_size(self) -> int:
        return self.spec().block_size if self.kind == "synthetic" else self.block_size

    def open(self, skipped: list[str] | None = None) -> Iterator[TraceRequest]:
        """Stream the requests (a new pass each call)."""
        if self.kind == "synthetic":
            return synthetic_trace(self.spec())
        if self.path is None:
            raise SimulationError(f"a {self.kind} trace needs a path")
        if self.kind == "mooncake":
            return read_mooncake(
                self.path,
                block_size=self.block_size,
                limit=self.limit,
                skip_bad=self.skip_bad,
                skipped=skipped,
            )
        return read_token_jsonl(
            self.path, limit=self.limit, skip_bad=self.skip_bad, skipped=skipped
        )


@dataclass
class TraceSummary:
    """One streaming pass: request and token counts, and the trace's unique prompt tokens."""

    requests: int = 0
    prompt_tokens: int = 0
    unique_tokens: int = 0
    skipped: list[str] = field(default_factory=list)


def trace_summary(source: TraceSource, oracle: BeladyOracle | None = None) -> TraceSummary:
    """Count the trace (and fill ``oracle`` with every block's uses) in one streaming pass.

    Unique tokens count each distinct block once at its longest length; token traces are
    hashed in 16-token chained blocks for it (a close count, not a trie)."""
    summary = TraceSummary()
    block_len: dict[Any, int] = {}
    for request in source.open(summary.skipped):
        summary.requests += 1
        prompt = request.prompt
        summary.prompt_tokens += len(prompt)
        block_ids = request.block_ids
        if block_ids is not None:
            size = source.trace_block_size
            last = len(prompt) - (len(block_ids) - 1) * size
            for j, block_id in enumerate(block_ids):
                n = size if j < len(block_ids) - 1 else last
                if block_len.get(block_id, 0) < n:
                    block_len[block_id] = n
            if oracle is not None:
                oracle.add_request(request.index, block_ids)
        else:
            digest = hashlib.blake2b((request.extra_key or "").encode(), digest_size=8).digest()
            tokens = list(prompt)
            for start in range(0, len(tokens), 16):
                chunk = tokens[start : start + 16]
                digest = hashlib.blake2b(digest + repr(chunk).encode(), digest_size=8).digest()
                if block_len.get(digest, 0) < len(chunk):
                    block_len[digest] = len(chunk)
    summary.unique_tokens = sum(block_len.values())
    return summary


class RunSpec(FrozenModel):
    """Everything one run needs (picklable, so runs can go to worker processes)."""

    source: TraceSource
    config: dict[str, Any] = Field(default_factory=dict)
    policy: str = "lru"
    capacity_tokens: int = Field(ge=1)
    page_size: int | None = Field(None, ge=1)
    timing: Literal["trace", "sequential"] = "sequential"
    eviction: Literal["shortfall", "full"] = "shortfall"
    cache_output: bool = True
    cost: PrefillCost = PrefillCost()
    tiers: str | None = None  # a --tiers hierarchy (kvplug.sim.tiers), after the config's own
    debug: bool = False  # check conservation after every scheduler step (slow; for tests)


def _stack_config(spec: RunSpec) -> KVCacheConfig:
    base = load_config(spec.config)
    pool = base.pool.model_dump()
    page = spec.page_size or base.pool.page_size
    pool.update(
        capacity_tokens=max(page, spec.capacity_tokens // page * page),
        page_size=page,
        store_kv=False,
        device="cpu",
    )
    data = base.model_dump()
    data["pool"] = pool
    storage = bookkeeping_storage(
        base.storage, spec.tiers, pool["capacity_tokens"], kv_bytes_per_token(base)
    )
    data["storage"] = storage if storage is not None else {}
    if page > 1 and base.allocator.name in ("standard", "token"):
        data["allocator"] = {"name": "paged", "options": base.allocator.options}
    if spec.policy != BELADY and _policy(spec.policy) != _policy(base.eviction_policy.name):
        # another policy than the config's: the config's options are for its own policy
        data["eviction_policy"] = {"name": spec.policy, "options": {}}
    return load_config(data)


def _policy(name: str) -> str:
    """The canonical name of an eviction policy (names are case-blind and may be aliases)."""
    from ..registry import get_registry

    return get_registry().get("eviction_policy", name).name


def check_names(spec: RunSpec, policies: list[str]) -> None:
    """Resolve the config and every policy name now, so a typo fails before any run starts."""
    from ..registry import get_registry

    registry = get_registry()
    own = load_config(spec.config).eviction_policy.name  # its options are checked here too
    registry.resolve_config(_stack_config(spec.model_copy(update={"policy": own})))
    for policy in policies:
        if policy != BELADY:
            registry.get("eviction_policy", policy)


def _belady_stack(stack: KVCacheStack, oracle: BeladyOracle) -> KVCacheStack:
    cache: Any = stack.prefix_cache
    if cache.name not in ("radix", "swa_radix"):
        raise SimulationError(
            f"belady needs a radix-family cache (its candidates carry their tokens), not "
            f"{cache.name!r}"
        )

    def new_policy() -> BeladyPolicy:
        return BeladyPolicy(oracle)

    context = PrefixCacheContext(
        allocator=stack.allocator, new_policy=new_policy, page_size=cache.page_size
    )
    belady_cache = type(cache).from_context(context, cache.options)
    return KVCacheStack(stack.config, stack.allocator, belady_cache, new_policy)


@contextmanager
def _no_collector_passes() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a replay (restored after, then one pass).

    A replay allocates millions of short-lived objects while the cache holds a large, stable
    tree: the collector kept rescanning that tree (about a tenth of a replay's time, for
    nothing: the tree's nodes are freed by reference counting when evicted). Results do not
    depend on it; the one pass afterwards frees any cycle a run left."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
            gc.collect()


def scheduled(request: TraceRequest) -> Request:
    """A trace's request as the reference scheduler takes it."""
    return Request(
        request.index,
        request.prompt,
        request.output_length,
        extra_key=request.extra_key,
        arrival_ms=request.timestamp_ms,
        output_tokens=request.output,
    )


def run_one(spec: RunSpec) -> RunResult:
    """Replay ``spec.source`` through one configuration and measure it."""
    with _no_collector_passes():
        return _run_one(spec)


def _run_one(spec: RunSpec) -> RunResult:
    config = _stack_config(spec)
    stack = build(config)
    on_admit = None
    if spec.policy == BELADY:
        if spec.source.kind == "tokens":
            raise SimulationError(
                "belady needs a block-structured trace (mooncake or synthetic): token traces "
                "carry no block ids to read the future from"
            )
        oracle = BeladyOracle(spec.source.trace_block_size)
        trace_summary(spec.source, oracle)
        stack = _belady_stack(stack, oracle)

        def on_admit(request: Request) -> None:
            oracle.now = request.request_id

    options = SchedulerOptions(
        timing=spec.timing, cache_output=spec.cache_output, eviction=spec.eviction, debug=spec.debug
    )
    scheduler = Scheduler(stack, None, options, on_admit=on_admit)
    cost = spec.cost
    seconds = config.storage.cost  # the cost model of prefill seconds (and of tier loads)
    saved = total = saved_s = total_s = 0.0
    requests = 0
    started = time.perf_counter()
    trace = spec.source.open()
    pending = next(trace, None)
    while True:
        waiting = scheduler.waiting
        while pending is not None and (
            len(waiting) < 2 or pending.timestamp_ms <= scheduler.now_ms
        ):
            scheduler.add_request(scheduled(pending))
            requests += 1
            pending = next(trace, None)
        if scheduler.idle:
            break
        scheduler.step()
        for request in scheduler.finished:  # fold finished requests into totals, drop them
            total += cost.prefix(request.prompt_len)
            saved += cost.prefix(request.cached_tokens)
            total_s += seconds.recompute_s(request.prompt_len, 0)
            saved_s += seconds.recompute_s(request.cached_tokens, 0)
        scheduler.finished.clear()
    wall = time.perf_counter() - started
    stats = scheduler.stats
    cache_stats: Any = getattr(stack.prefix_cache, "stats", None)
    requested = cache_stats.shortfall_requested_tokens if cache_stats else 0
    freed = cache_stats.shortfall_freed_tokens if cache_stats else 0
    storage = stack.storage
    tier_hits: dict[str, int] = {}
    transfer: dict[str, int] = {}
    dropped = 0
    if storage is not None:
        storage.flush()
        tier_hits = {t.name: stats.tier_hit_tokens.get(t.name, 0) for t in storage.tiers}
        transfer = dict(storage.stats.transfer_bytes)
        dropped = storage.stats.dropped_pages
        saved_s -= sum(storage.stats.load_seconds.values())
        stack.close()
    return RunResult(
        trace=spec.source.name,
        cache=config.prefix_cache.name,
        policy=spec.policy,
        capacity_tokens=config.pool.capacity_tokens,
        page_size=config.pool.page_size,
        timing=spec.timing,
        eviction=spec.eviction,
        requests=requests,
        completed=stats.finished,
        aborted=stats.aborted,
        preemptions=stats.preemptions,
        prompt_tokens=stats.prompt_tokens,
        hit_tokens=stats.hit_tokens,
        hit_rate=stats.hit_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        prefill_saved=saved / total if total else 0.0,
        evicted_tokens=cache_stats.evicted_tokens if cache_stats else 0,
        shortfall_requested_tokens=requested,
        shortfall_freed_tokens=freed,
        over_eviction=freed / requested - 1.0 if requested else 0.0,
        cache_us_per_request=stats.cache_seconds / max(1, stats.finished) * 1e6,
        wall_seconds=wall,
        tiers=tiers_label(spec.tiers) if storage is not None else "",
        device_hit_tokens=stats.hit_tokens - sum(tier_hits.values()),
        tier_hit_tokens=tier_hits,
        transfer_bytes=transfer,
        demotions_dropped=dropped,
        prefill_seconds=total_s,
        prefill_seconds_saved=saved_s,
    )
