"""The reference scheduler: continuous batching over a ``KVCacheStack``, as vLLM and SGLang do it.

Each ``step()``:

1. **admit** waiting requests in arrival order while memory allows: ``match_prefix`` the prompt,
   ``inc_lock_ref`` the prefix, evict exactly the allocator's shortfall
   (``evict_from_tree_cache``), ``alloc_extend`` the rest of the prompt (whole pages on a paged
   allocator, both pools on SWA). A request that does not fit waits (head of line);
   one that could never fit is aborted;
2. **decode memory**: one new slot for every request past its prompt (``alloc_decode``); on a
   shortfall evict, and when eviction cannot free enough preempt the most recently admitted
   request (free its slots, unlock its prefix, requeue it in front) until the rest fit;
3. **forward**: prompt chunks (within ``max_prefill_tokens`` per step) and decode tokens go to the
   model in one batch; without a model the next tokens are the requests' given outputs;
4. **finish** requests that produced ``max_new_tokens``: insert prompt + output (or the prompt
   only) into the cache, unlock the prefix, free the caller's unaligned tail;
5. **end the step** on the stack (``stack.end_step()``), when it has observers: the KV-event
   publisher sends the step's events as one batch, as vLLM's scheduler does once per step.

``debug=True`` checks conservation after every step (per pool for SWA): free + evictable +
protected + held by running requests == capacity. Nothing here is specific to one cache or
allocator: it drives the same public calls an engine makes.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field

from kvplug_hookspecs import CacheKey, EvictParams, FrozenModel

from ..eviction import evict_from_tree_cache
from ..stack import KVCacheStack
from .model import ForwardItem, Model
from .request import Request, RequestStatus

__all__ = ["ConservationError", "Scheduler", "SchedulerOptions", "SchedulerStats"]


class ConservationError(AssertionError):
    """Slots were lost or double counted: free + cached + held != capacity."""


class SchedulerOptions(FrozenModel):
    """How the reference scheduler batches.

    ``timing``: ``trace`` admits a request once the simulated clock reaches its ``arrival_ms``;
    ``sequential`` serves one request at a time in arrival order (the mode trace papers report
    hit rates in). The clock advances by a simple cost model per step (``*_us`` fields).
    ``cache_output``: insert prompt + output at finish (SGLang's ``cache_finished_req``), or the
    prompt only. ``max_prefill_tokens`` bounds the prompt tokens computed per step (chunked
    prefill); ``None`` computes each admitted prompt in one step.
    """

    timing: Literal["trace", "sequential"] = "trace"
    max_running: int = Field(256, ge=1)
    max_prefill_tokens: int | None = Field(None, ge=1)
    cache_output: bool = True
    eviction: Literal["shortfall", "full"] = "shortfall"
    debug: bool = False
    step_overhead_us: float = Field(500.0, ge=0)
    prefill_us_per_token: float = Field(20.0, ge=0)
    decode_us_per_request: float = Field(100.0, ge=0)


@dataclass
class SchedulerStats:
    """What a run did, in the units engines report."""

    steps: int = 0
    admitted: int = 0
    finished: int = 0
    aborted: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)  # of hit_tokens, per tier
    output_tokens: int = 0
    cache_seconds: float = 0.0
    max_running: int = 0


class Scheduler:
    """Continuous batching over a stack; see the module docstring for the step.

    ``model`` is a :class:`~kvplug.engine.model.Model`, or ``None`` to simulate (no K/V).
    """

    def __init__(
        self,
        stack: KVCacheStack,
        model: Model | None = None,
        options: SchedulerOptions | None = None,
        *,
        on_admit: Callable[[Request], None] | None = None,
    ) -> None:
        self.stack = stack
        self.cache = stack.prefix_cache
        self.allocator: Any = stack.allocator
        self.model = model
        self.options = options or SchedulerOptions()
        self.on_admit = on_admit
        self.page_size = self.allocator.page_size
        self.cache_page = getattr(self.cache, "page_size", self.page_size)
        self.is_swa = hasattr(self.allocator, "swa_available_size")
        self.cache_any: Any = self.cache
        # caches that can match without counting a hit (the agreed ``record_hit`` keyword)
        self._can_probe = "record_hit" in inspect.signature(self.cache.match_prefix).parameters
        self.device = self.allocator.device
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.stats = SchedulerStats()
        self.now_ms = 0.0
        self._admissions = 0
        self.next_arrival_ms: float | None = None
        """When a driver that routes requests itself (the simulator's cluster) will add the
        next one: decode steps are not fast-forwarded past it, as if it were already queued."""
        # the stack's observers (KV-event publisher, metrics) hear where each step ends
        self._end_step = stack.end_step if getattr(stack, "observers", ()) else None
        # storage tiers with prefetch: a queued request's prefix starts moving up at once
        config = getattr(stack, "config", None)
        prefetching = config is not None and config.storage.prefetch
        self._prefetch = (
            getattr(self.cache, "prefetch", None)
            if prefetching and getattr(self.cache, "storage", None) is not None
            else None
        )
        # storage tiers with handoff "step": the step's demotions go to the worker before the
        # forward pass, so the worker runs while the device computes
        storage = getattr(self.cache, "storage", None)
        self._tiers_step = (
            storage.end_step if storage is not None and storage.config.handoff == "step" else None
        )

    # -- queue -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (requests must be added in arrival order)."""
        if self.waiting and request.arrival_ms < self.waiting[-1].arrival_ms:
            raise ValueError(
                f"request {request.request_id} arrives at {request.arrival_ms} ms, before the "
                f"previous one ({self.waiting[-1].arrival_ms} ms): add requests in arrival order"
            )
        self.waiting.append(request)
        if self._prefetch is not None:
            self._prefetch(CacheKey(request.prompt[:-1], request.extra_key))

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def run(self, requests: Iterable[Request] = ()) -> list[Request]:
        """Queue ``requests`` and step until every request finished or was aborted."""
        for request in requests:
            self.add_request(request)
        while not self.idle:
            self.step()
        return self.finished

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Admit, allocate decode slots, run one forward batch, finish; returns the finished."""
        if not self.running and self.waiting and self.options.timing == "trace":
            self.now_ms = max(self.now_ms, self.waiting[0].arrival_ms)  # idle: jump ahead
        self._admit()
        steps = self._fast_forward_steps()
        if steps > 1 and self._fast_forward(steps):
            if self._tiers_step is not None:
                self._tiers_step()
            return self._finish_done(steps, [])
        decoders = [r for r in self.running if not r.in_prefill]
        self._alloc_decode(decoders)
        items, order = self._batch()
        if self._tiers_step is not None:
            self._tiers_step()
        if items:
            self._forward(items, order)
        return self._finish_done(1, items)

    def _finish_done(self, steps: int, items: Sequence[ForwardItem]) -> list[Request]:
        done = [r for r in self.running if r.done]
        self.stats.max_running = max(self.stats.max_running, len(self.running))
        if items:
            self._advance_clock(items)
        else:
            self._advance_decode_clock(steps)
        for request in done:
            self._finish(request)
        self.stats.steps += steps
        if self._end_step is not None:
            self._end_step()
        if self.options.debug:
            self.check_conservation()
        return done

    def _advance_decode_clock(self, steps: int) -> None:
        o = self.options
        per_step = o.step_overhead_us + len(self.running) * o.decode_us_per_request
        self.now_ms += steps * per_step / 1000.0

    # -- simulation shortcut -----------------------------------------------------------------

    def _fast_forward_steps(self) -> int:
        """Decode steps that can run as one without a model: every running request is decoding
        and nothing can be admitted before the first of them finishes. The result is the same
        as stepping one token at a time (``debug`` checks every real step, so it never skips)."""
        if self.model is not None or self.is_swa or self.options.debug or not self.running:
            return 0
        if any(r.in_prefill or r.slots is None or len(r.slots) != r.computed for r in self.running):
            return 0
        steps = min(r.max_new_tokens - len(r.output) for r in self.running)
        if self.options.timing != "trace":
            return steps
        arrival = self.waiting[0].arrival_ms if self.waiting else self.next_arrival_ms
        if arrival is not None:
            if arrival <= self.now_ms:
                return 0  # it waits for memory: each step retries it
            o = self.options
            per_step = o.step_overhead_us + len(self.running) * o.decode_us_per_request
            steps = min(steps, int((arrival - self.now_ms) * 1000.0 // per_step) + 1)
        return steps

    def _fast_forward(self, steps: int) -> bool:
        """Allocate ``steps`` decode positions per running request at once and emit the given
        output tokens; ``False`` (nothing changed but evictions) when memory is short."""
        running, ps = self.running, self.page_size
        t0 = time.perf_counter()
        tokens = sum(
            (self._pages(r.computed + steps) - self._pages(r.computed)) * ps for r in running
        )
        self._evict(tokens)
        device = self.device
        computed = torch.tensor([r.computed for r in running], device=device)
        last_loc = torch.stack([r.slots[-1] for r in running])  # type: ignore[index]
        new = self.allocator.alloc_extend(
            computed, computed + steps, last_loc, steps * len(running)
        )
        self.stats.cache_seconds += time.perf_counter() - t0
        if new is None:
            return False
        for j, request in enumerate(running):
            assert request.slots is not None
            request.slots = torch.cat([request.slots, new[j * steps : (j + 1) * steps]])
            request.output.extend(request.next_output_tokens(steps))
            request.computed += steps
        return True

    def _advance_clock(self, items: Sequence[ForwardItem]) -> None:
        o = self.options
        prefill = sum(len(it.token_ids) for it in items if len(it.token_ids) > 1)
        decodes = sum(1 for it in items if len(it.token_ids) == 1)
        self.now_ms += (
            o.step_overhead_us
            + prefill * o.prefill_us_per_token
            + decodes * o.decode_us_per_request
        ) / 1000.0

    # -- admission ---------------------------------------------------------------------------

    def _admissible(self, request: Request) -> bool:
        o = self.options
        if len(self.running) >= o.max_running:
            return False
        if o.timing == "sequential":
            return not self.running
        return request.arrival_ms <= self.now_ms

    def _admit(self) -> None:
        while self.waiting and self._admissible(self.waiting[0]):
            request = self.waiting[0]
            reason = self._never_fits(request)
            if reason is not None:
                self._abort(self.waiting.popleft(), reason)
                continue
            if not self._try_admit(request):
                return
            self.waiting.popleft()

    def _never_fits(self, request: Request) -> str | None:
        """Why a request could not run even alone in an empty cache, or ``None``."""
        allocator, ps = self.allocator, self.page_size
        total = self._pages(request.prompt_len + request.max_new_tokens) * ps
        if total > allocator.size:
            return f"needs {total} slots, the pool holds {allocator.size}"
        if self.is_swa and self._pages(request.prompt_len) * ps > allocator.swa_size:
            return (
                f"a {request.prompt_len}-token prompt exceeds the window pool's "
                f"{allocator.swa_size} slots"
            )
        return None

    def _evict(self, num_tokens: int) -> None:
        """Make room for ``num_tokens`` slots: exactly the shortfall (or, as the ``full``
        baseline, all ``num_tokens`` whenever anything is short)."""
        if self.options.eviction == "shortfall":
            evict_from_tree_cache(self.cache, num_tokens)
            return
        shortfall = self.allocator.shortfall(num_tokens)
        if shortfall is not None and not self.cache.is_chunk_cache:
            stats = getattr(self.cache, "stats", None)
            result = self.cache.evict(EvictParams(num_tokens=num_tokens))
            if stats is not None:
                stats.shortfall_requested_tokens += shortfall.num_tokens
                stats.shortfall_freed_tokens += result.num_tokens

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _try_admit(self, request: Request) -> bool:
        cache, allocator, ps = self.cache, self.allocator, self.page_size
        # at most len - 1 tokens: the last prompt token is always computed, to sample from it.
        # Built before the cache's clock starts: making a trace's tokens is not cache work.
        key = CacheKey(request.prompt[:-1], request.extra_key)
        t0 = time.perf_counter()
        if self.running and self._can_probe and not self._room_for(request, key):
            self.stats.cache_seconds += time.perf_counter() - t0
            return False
        match = cache.match_prefix(key)
        prefix_len = match.prefix_len
        cache.inc_lock_ref(match.last_node)
        need = (self._pages(request.prompt_len) - self._pages(prefix_len)) * ps
        self._evict(need)
        device = self.device
        prefix_slots = match.device_indices
        last = int(prefix_slots[-1]) if prefix_len else -1
        new = allocator.alloc_extend(
            torch.tensor([prefix_len], device=device),
            torch.tensor([request.prompt_len], device=device),
            torch.tensor([last], device=device),
            request.prompt_len - prefix_len,
        )
        if new is None:
            cache.dec_lock_ref(match.last_node)
            self.stats.cache_seconds += time.perf_counter() - t0
            return False
        request.slots = torch.cat([prefix_slots, new]) if prefix_len else new
        self.stats.cache_seconds += time.perf_counter() - t0
        request.status = RequestStatus.RUNNING
        request.prefix_len = request.computed = request.cached_tokens = prefix_len
        request.tier_tokens = match.tier_tokens
        request.swa_freed = prefix_len
        request.node = match.last_node
        request.admitted_at = self._admissions
        self._admissions += 1
        self.running.append(request)
        self.stats.admitted += 1
        if self.on_admit is not None:
            self.on_admit(request)
        return True

    def _room_for(self, request: Request, key: CacheKey) -> bool:
        """Whether free + evictable slots cover the request once its prefix is locked, asked
        without side effects (a probe match counts no hit and nothing is evicted), as SGLang's
        admission checks before it evicts: a request that keeps waiting for memory must not
        count a hit, or evict, on every retry. With nothing running it always fits."""
        cache, allocator, ps = self.cache, self.allocator, self.page_size
        probe = self.cache_any.match_prefix(key, record_hit=False, gather=False)
        need = (self._pages(request.prompt_len) - self._pages(probe.prefix_len)) * ps
        cache.inc_lock_ref(probe.last_node)
        try:
            if self.is_swa:
                return bool(
                    allocator.full_available_size() + cache.evictable_size() >= need
                    and allocator.swa_available_size() + self.cache_any.swa_evictable_size() >= need
                )
            return bool(allocator.available_size() + cache.evictable_size() >= need)
        finally:
            cache.dec_lock_ref(probe.last_node)

    # -- decode memory -----------------------------------------------------------------------

    def _alloc_decode(self, decoders: list[Request]) -> None:
        """One slot for each decoding request's next position; preempt until they fit."""
        need = [r for r in decoders if r.slots is not None and len(r.slots) == r.computed]
        ps = self.page_size
        while need:
            t0 = time.perf_counter()
            tokens = sum(ps for r in need if r.computed % ps == 0)
            self._evict(tokens)
            assert all(r.slots is not None for r in need)
            seq_lens = torch.tensor([r.computed + 1 for r in need], device=self.device)
            last_loc = torch.stack([r.slots[-1] for r in need])  # type: ignore[index]
            new = self.allocator.alloc_decode(seq_lens, last_loc)
            self.stats.cache_seconds += time.perf_counter() - t0
            if new is not None:
                for j, request in enumerate(need):
                    request.slots = torch.cat([request.slots, new[j : j + 1]])  # type: ignore[list-item]
                return
            victim = self._preempt_last()
            if victim is None:
                return
            need = [r for r in need if r is not victim]

    def _preempt_last(self) -> Request | None:
        """Preempt the most recently admitted running request (vLLM's and SGLang's choice)."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda r: r.admitted_at)
        self.running.remove(victim)
        self._release(victim)
        victim.reset_for_retry()
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1
        return victim

    def _release(self, request: Request) -> None:
        """Free the slots a request owns and unlock its prefix (preemption, abort)."""
        t0 = time.perf_counter()
        if request.slots is not None and len(request.slots) > request.prefix_len:
            self.allocator.free(request.slots[request.prefix_len :])
        if request.node is not None or request.slots is not None:
            self.cache.dec_lock_ref(request.node)
        self.stats.cache_seconds += time.perf_counter() - t0

    def _abort(self, request: Request, reason: str) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        request.status = RequestStatus.ABORTED
        request.abort_reason = reason
        self.finished.append(request)
        self.stats.aborted += 1

    # -- forward -----------------------------------------------------------------------------

    def _batch(self) -> tuple[list[ForwardItem], list[Request]]:
        budget = self.options.max_prefill_tokens
        items: list[ForwardItem] = []
        order: list[Request] = []
        for request in self.running:
            assert request.slots is not None
            if request.in_prefill:
                end = request.prompt_len
                if budget is not None:
                    if budget <= 0:
                        continue
                    end = min(end, request.computed + budget)
                    budget -= end - request.computed
                tokens = request.prompt[request.computed : end]
                sample = end == request.prompt_len
            elif len(request.slots) > request.computed:
                end = request.computed + 1
                tokens = [request.output[-1]]
                sample = True
            else:  # no decode slot (its allocation failed this step)
                continue
            items.append(
                ForwardItem(
                    request.request_id, tokens, request.computed, request.slots[:end], sample
                )
            )
            order.append(request)
        return items, order

    def _forward(self, items: list[ForwardItem], order: list[Request]) -> None:
        if self.model is not None:
            tokens = self.model.forward(self.stack, items)
        else:
            tokens = [r.next_output_token() if it.sample else None for it, r in zip(items, order)]
        for item, request, token in zip(items, order, tokens):
            request.computed = item.start_pos + len(item.token_ids)
            if item.sample:
                if token is None:
                    raise RuntimeError(f"the model returned no token for request {item.request_id}")
                request.output.append(int(token))
        if self.is_swa:
            for request in order:
                self._free_out_of_window(request)

    def _free_out_of_window(self, request: Request) -> None:
        """Free the window slots of the request's own positions no future token attends to
        (SGLang frees them as decoding moves on); the full slots stay for the cache.

        As SGLang does for prefix-sharing caches, keep ``max(window, page)`` rounded up to whole
        pages live: the key inserted at finish ends at a page boundary, below ``computed``, and
        must still end with a full window of live tokens or no later request can match it."""
        assert request.slots is not None
        ps = self.page_size
        keep = -(-max(self.allocator.sliding_window_size, ps) // ps) * ps
        limit = (request.computed - keep) // ps * ps
        if limit > request.swa_freed:
            t0 = time.perf_counter()
            self.allocator.free_swa(request.slots[request.swa_freed : limit])
            request.swa_freed = limit
            self.stats.cache_seconds += time.perf_counter() - t0

    # -- finish ------------------------------------------------------------------------------

    def _finish(self, request: Request) -> None:
        cache, allocator = self.cache, self.allocator
        assert request.slots is not None
        t0 = time.perf_counter()
        n = request.computed
        keep = n if self.options.cache_output else request.prompt_len
        # a whole slice of a tuple (or of a trace's tuple-backed prompt) is that tuple: no
        # copy (``tuple(prompt)`` of a trace's prompt iterates every token)
        prompt = request.prompt
        tokens = prompt[:keep]
        if not isinstance(tokens, tuple):
            tokens = tuple(tokens)
        if keep > len(prompt):
            tokens += tuple(request.output[: keep - len(prompt)])
        slots = request.slots
        key = CacheKey(tokens, request.extra_key)
        if self.is_swa:
            cache.insert(  # type: ignore[call-arg]
                key, slots[:keep], priority=request.priority, swa_evicted_seqlen=request.swa_freed
            )
        else:
            cache.insert(key, slots[:keep], priority=request.priority)
        aligned = keep // self.cache_page * self.cache_page
        if len(slots) > aligned:
            allocator.free(slots[aligned:])
        cache.dec_lock_ref(request.node)
        self.stats.cache_seconds += time.perf_counter() - t0
        self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finished_ms = self.now_ms
        request.slots = None
        request.node = None
        self.finished.append(request)
        stats = self.stats
        stats.finished += 1
        stats.prompt_tokens += request.prompt_len
        stats.hit_tokens += request.cached_tokens
        for tier, loaded in request.tier_tokens:
            stats.tier_hit_tokens[tier] = stats.tier_hit_tokens.get(tier, 0) + loaded
        stats.output_tokens += len(request.output)

    # -- invariants --------------------------------------------------------------------------

    def held_tokens(self) -> int:
        """Slots running requests own (whole pages), outside the cache."""
        ps = self.page_size
        held = 0
        for r in self.running:
            if r.slots is not None:
                held += (self._pages(len(r.slots)) - r.prefix_len // ps) * ps
        return held

    def check_conservation(self) -> None:
        """free + evictable + protected + held == capacity, per pool; raises ConservationError."""
        cache: Any = self.cache
        allocator = self.allocator
        held = self.held_tokens()
        if self.is_swa:
            window_held = held - sum(r.swa_freed - r.prefix_len for r in self.running)
            sides = [
                ("full", allocator.full_available_size(), cache.evictable_size(),
                 cache.protected_size(), allocator.size, held),
                ("window", allocator.swa_available_size(), cache.swa_evictable_size(),
                 cache.swa_protected_size(), allocator.swa_size, window_held),
            ]  # fmt: skip
        else:
            sides = [
                ("full", allocator.available_size(), cache.evictable_size(),
                 cache.protected_size(), allocator.size, held),
            ]  # fmt: skip
        for name, free, evictable, protected, capacity, in_use in sides:
            if free + evictable + protected + in_use != capacity:
                raise ConservationError(
                    f"step {self.stats.steps}, {name} pool: free {free} + evictable {evictable} + "
                    f"protected {protected} + held {in_use} != capacity {capacity}"
                )
