"""Replay one trace through N independent kvplug instances behind a router.

Each instance is a whole stack of its own (cache, allocator, eviction policy) under its own
reference scheduler, built from the same config as a single-instance run. A router
(:mod:`.routers`) sends each request to one instance when it arrives; routers that read KV
events get the ``KVEventBatch``es each instance publishes (``kvplug.cluster.wire``'s
``EventBatcher`` as the cache's event sink, one batch per scheduler step), consumed in-process
before every routing decision, as a subscriber would.

Time: under ``sequential`` timing requests are served one at a time across the cluster (route,
serve to completion, next), so every instance is idle when a request is routed. Under ``trace``
timing each instance keeps its own clock; the driver always steps the instance that is furthest
behind and routes a request once every busy instance's clock has reached its arrival, telling
each instance when the next request arrives so that no decode fast-forward runs past it. With
one instance both loops make exactly the calls ``run_one`` makes (a test holds them to it).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import Field

from kvplug_hookspecs import FrozenModel, PrefixCacheContext

from ..engine import Request, Scheduler, SchedulerOptions
from ..stack import KVCacheStack, build
from .metrics import RunResult
from .replay import (
    BELADY,
    RunSpec,
    SimulationError,
    _no_collector_passes,
    _stack_config,
    scheduled,
)
from .routers import ROUTERS, InstanceLoad, Router, make_router

__all__ = ["CLUSTER_FIELDS", "ClusterResult", "ClusterSpec", "as_single", "run_cluster"]


class ClusterSpec(FrozenModel):
    """One cluster run: ``run`` (trace, config, policy, capacity *per instance*, timing) on
    ``instances`` instances behind ``router`` (with ``router_options``), ties broken with
    ``seed``."""

    run: RunSpec
    instances: int = Field(ge=1)
    router: str = "round_robin"
    router_options: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0


@dataclass
class ClusterResult:
    """One router x instances run. Rates are fractions (0..1); times are seconds."""

    trace: str
    router: str
    instances: int
    policy: str
    capacity_tokens: int  # per instance
    page_size: int
    timing: str
    requests: int
    completed: int
    aborted: int
    preemptions: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    prefill_saved: float
    evicted_tokens: int
    load_imbalance: float  # max / mean prompt tokens served per instance
    request_imbalance: float  # max / mean requests per instance
    max_queue: int  # most requests waiting or running on one instance when a request arrived
    mean_queue: float  # mean over arrivals of the chosen instance's queue
    served_tokens: list[int] = field(default_factory=list)
    instance_hit_rates: list[float] = field(default_factory=list)
    kv_events: int = 0  # events the router read
    router_us_per_request: float = 0.0
    cache_us_per_request: float = 0.0
    wall_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


CLUSTER_FIELDS: tuple[str, ...] = tuple(ClusterResult.__dataclass_fields__)


class _Instance:
    """One stack and its scheduler, and what the router has sent it."""

    def __init__(self, spec: RunSpec, events: bool) -> None:
        stack = build(_stack_config(spec))
        self.batcher: Any = None
        if events:
            stack = self._publishing(stack)
        options = SchedulerOptions(
            timing=spec.timing,
            cache_output=spec.cache_output,
            eviction=spec.eviction,
            debug=spec.debug,
        )
        self.stack = stack
        self.scheduler = Scheduler(stack, None, options)
        self.page = self.scheduler.page_size
        self.served_tokens = self.served_requests = self.served_blocks = 0
        self.awaiting: list[Request] = []  # routed here, no first token yet
        # what each step told the router, heard once the step has ended: (end ms, KV-event
        # batches, requests that streamed their first token, requests that ended)
        self.outbox: deque[tuple[float, list[Any], list[int], list[int]]] = deque()

    def post(self, lifecycle: bool) -> None:
        """After a step: queue what it published for the router (before ``fold``)."""
        s = self.scheduler
        batches = self.batcher.take_batches() if self.batcher is not None else []
        started: list[int] = []
        ended: list[int] = []
        if lifecycle:
            ended = [r.request_id for r in s.finished]
            if self.awaiting:
                started = [r.request_id for r in self.awaiting if r.output]
                if started or ended:
                    gone = set(ended)
                    self.awaiting = [
                        r for r in self.awaiting if not r.output and r.request_id not in gone
                    ]
        if batches or started or ended:
            self.outbox.append((s.now_ms, batches, started, ended))

    def deliver(self, router: Router, instance: int, until_ms: float) -> None:
        """Hand the router what steps ending by ``until_ms`` published, oldest first."""
        outbox = self.outbox
        while outbox and outbox[0][0] <= until_ms:
            _, batches, started, ended = outbox.popleft()
            if batches:
                router.observe(instance, batches)
            for request_id in started:
                router.first_token(instance, request_id)
            for request_id in ended:
                router.finished(instance, request_id)

    def _publishing(self, stack: KVCacheStack) -> KVCacheStack:
        """The stack with an in-process ``EventBatcher`` as its cache's event sink."""
        from ..cluster.wire import EventBatcher  # the cluster extra (msgspec), only when asked

        cache: Any = stack.prefix_cache
        self.batcher = EventBatcher(cache.page_size, clock=lambda: 0.0)
        context = PrefixCacheContext(
            allocator=stack.allocator,
            new_policy=stack.new_policy,
            page_size=cache.page_size,
            events=self.batcher,
        )
        publishing = type(cache).from_context(context, cache.options)
        return KVCacheStack(stack.config, stack.allocator, publishing, stack.new_policy, (self,))

    # the stack's observer protocol: the scheduler ends each step, the batcher cuts a batch
    sink = None

    def attach(self, stack: Any) -> None:
        pass

    def end_step(self) -> None:
        self.batcher.end_step()

    def close(self) -> None:
        pass

    def clock(self) -> float:
        """Where the instance's clock stands before its next step (an instance with nothing
        running jumps to its first waiting request's arrival, as the scheduler does)."""
        s = self.scheduler
        if not s.running and s.waiting:
            return max(s.now_ms, s.waiting[0].arrival_ms)
        return s.now_ms

    def load(self) -> InstanceLoad:
        s, page = self.scheduler, self.page
        active = prefill = 0
        for r in s.running:
            active += -(-(r.prompt_len + len(r.output)) // page)
            prefill += -(-(r.prompt_len - r.computed) // page) if r.in_prefill else 0
        for r in s.waiting:
            blocks = -(-r.prompt_len // page)
            active += blocks
            prefill += blocks
        allocator: Any = self.stack.allocator
        return InstanceLoad(
            queue=len(s.waiting) + len(s.running),
            active_blocks=active,
            prefill_blocks=prefill,
            kv_usage=1.0 - allocator.available_size() / allocator.size,
            served_tokens=self.served_tokens,
            served_requests=self.served_requests,
        )


def _loads(instances: list[_Instance], sequential: bool) -> list[InstanceLoad]:
    loads = [inst.load() for inst in instances]
    if sequential:  # idle everywhere: the backlog stands for the queue (routers module doc)
        least_requests = min(inst.served_requests for inst in instances)
        least_blocks = min(inst.served_blocks for inst in instances)
        for load, inst in zip(loads, instances):
            load.queue = inst.served_requests - least_requests
            load.active_blocks = inst.served_blocks - least_blocks
    return loads


def run_cluster(spec: ClusterSpec) -> ClusterResult:
    """Replay ``spec.run.source`` through ``spec.instances`` instances behind ``spec.router``."""
    if spec.run.policy == BELADY:
        raise SimulationError("belady runs on one instance only (its future is per cache)")
    if spec.router not in ROUTERS:
        raise SimulationError(f"unknown router {spec.router!r}; valid: {', '.join(ROUTERS)}")
    with _no_collector_passes():
        return _run_cluster(spec)


def _run_cluster(spec: ClusterSpec) -> ClusterResult:
    run = spec.run
    config = _stack_config(run)
    page = config.pool.page_size
    router: Router = make_router(spec.router, spec.instances, page, spec.seed, spec.router_options)
    instances = [_Instance(run, router.needs_events) for _ in range(spec.instances)]
    sequential = run.timing == "sequential"
    listening = router.needs_events or router.tracks_requests
    cost = run.cost
    saved = total = 0.0
    requests = 0
    routing = 0.0
    queues: list[int] = []
    max_queue = 0
    started = time.perf_counter()
    trace = run.source.open()
    pending = next(trace, None)

    def fold(inst: _Instance) -> None:
        nonlocal saved, total
        finished = inst.scheduler.finished
        for request in finished:
            total += cost.prefix(request.prompt_len)
            saved += cost.prefix(request.cached_tokens)
        finished.clear()

    while True:
        busy = [inst for inst in instances if not inst.scheduler.idle]
        clock = min((inst.clock() for inst in busy), default=float("inf"))
        if pending is not None and (not busy if sequential else pending.timestamp_ms <= clock):
            t0 = time.perf_counter()
            if listening:
                heard = float("inf") if sequential else pending.timestamp_ms
                for k, inst in enumerate(instances):
                    inst.deliver(router, k, heard)
            tokens = tuple(pending.prompt)
            loads = _loads(instances, sequential)
            chosen = router.route(pending, tokens, loads)
            routing += time.perf_counter() - t0
            if not 0 <= chosen < spec.instances:
                raise SimulationError(f"router {spec.router!r} chose instance {chosen}")
            queue = max(load.queue for load in loads) if not sequential else 0
            max_queue = max(max_queue, queue)
            queues.append(loads[chosen].queue if not sequential else 0)
            inst = instances[chosen]
            inst.served_tokens += len(tokens)
            inst.served_requests += 1
            inst.served_blocks += -(-(len(tokens) + pending.output_length) // page)
            request = scheduled(pending)
            inst.scheduler.add_request(request)
            if router.tracks_requests:
                inst.awaiting.append(request)
            requests += 1
            pending = next(trace, None)
            continue
        if not busy:
            break
        inst = next(i for i in busy if i.clock() == clock)  # the first such: lowest index
        inst.scheduler.next_arrival_ms = None if pending is None else pending.timestamp_ms
        inst.scheduler.step()
        if listening:
            inst.post(router.tracks_requests)
        fold(inst)
    if listening:  # what the last steps published (the event count covers every event)
        for k, inst in enumerate(instances):
            inst.deliver(router, k, float("inf"))
    wall = time.perf_counter() - started
    return _result(
        spec, config, instances, requests, saved, total, routing, max_queue, queues, router, wall
    )


def _result(
    spec: ClusterSpec,
    config: Any,
    instances: list[_Instance],
    requests: int,
    saved: float,
    total: float,
    routing: float,
    max_queue: int,
    queues: list[int],
    router: Router,
    wall: float,
) -> ClusterResult:
    stats = [inst.scheduler.stats for inst in instances]
    prompt = sum(s.prompt_tokens for s in stats)
    hits = sum(s.hit_tokens for s in stats)
    finished = sum(s.finished for s in stats)
    served = [inst.served_tokens for inst in instances]
    served_requests = [inst.served_requests for inst in instances]
    evicted = 0
    for inst in instances:
        cache_stats: Any = getattr(inst.stack.prefix_cache, "stats", None)
        evicted += cache_stats.evicted_tokens if cache_stats else 0
    index = getattr(router, "index", None)
    return ClusterResult(
        trace=spec.run.source.name,
        router=spec.router,
        instances=spec.instances,
        policy=spec.run.policy,
        capacity_tokens=config.pool.capacity_tokens,
        page_size=config.pool.page_size,
        timing=spec.run.timing,
        requests=requests,
        completed=finished,
        aborted=sum(s.aborted for s in stats),
        preemptions=sum(s.preemptions for s in stats),
        prompt_tokens=prompt,
        hit_tokens=hits,
        hit_rate=hits / prompt if prompt else 0.0,
        prefill_saved=saved / total if total else 0.0,
        evicted_tokens=evicted,
        load_imbalance=_imbalance(served),
        request_imbalance=_imbalance(served_requests),
        max_queue=max_queue,
        mean_queue=sum(queues) / len(queues) if queues else 0.0,
        served_tokens=served,
        instance_hit_rates=[s.hit_tokens / max(1, s.prompt_tokens) for s in stats],
        kv_events=index.events if index is not None else 0,
        router_us_per_request=routing / max(1, requests) * 1e6,
        cache_us_per_request=sum(s.cache_seconds for s in stats) / max(1, finished) * 1e6,
        wall_seconds=wall,
    )


def _imbalance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def as_single(result: RunResult) -> ClusterResult:
    """A one-instance run as the cluster table's reference row (router ``single``)."""
    return ClusterResult(
        trace=result.trace,
        router="single",
        instances=1,
        policy=result.policy,
        capacity_tokens=result.capacity_tokens,
        page_size=result.page_size,
        timing=result.timing,
        requests=result.requests,
        completed=result.completed,
        aborted=result.aborted,
        preemptions=result.preemptions,
        prompt_tokens=result.prompt_tokens,
        hit_tokens=result.hit_tokens,
        hit_rate=result.hit_rate,
        prefill_saved=result.prefill_saved,
        evicted_tokens=result.evicted_tokens,
        load_imbalance=1.0,
        request_imbalance=1.0,
        max_queue=0,
        mean_queue=0.0,
        served_tokens=[result.prompt_tokens],
        instance_hit_rates=[result.hit_rate],
        cache_us_per_request=result.cache_us_per_request,
        wall_seconds=result.wall_seconds,
    )
