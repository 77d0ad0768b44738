"""Request routers for a simulated cluster, each modelled on one that people deploy.

A router picks the instance a request goes to from what a real router of its kind knows: a
counter, the instances' load, the session, what it sent where, or the KV events the instances
publish. It never reads an instance's cache directly.

=================  ==========================================================================
``round_robin``    each instance in turn
``least_loaded``   fewest requests in flight (then fewest KV blocks, then fewest tokens served)
``session``        consistent hashing of the session (conversation) id onto a ring
``prefix_aware``   SGLang router's cache-aware policy: an approximate prefix tree per worker
``kv_aware``       NVIDIA Dynamo's KV router: overlap from the instances' KV events, cost
                   ``overlap_weight x prefill_blocks + decode_blocks`` over the router's own
                   record of the requests it sent each worker
``llmd``           llm-d's precise prefix-cache scorer (from KV events, device block 1.0, host
                   block 0.8) combined with its queue and KV-utilisation scorers
=================  ==========================================================================

**Load** (:class:`InstanceLoad`) means what a router can observe of an instance at the moment
it routes. Under ``trace`` timing that is the instance's queue: the requests waiting or running
on it and their KV blocks. Under ``sequential`` timing every instance is idle whenever a request
arrives (requests are served one at a time), so in-flight load is always zero; there the load
fields hold each instance's *backlog*: how far its served work (requests, blocks) is ahead of
the least-served instance, the queue it would have if all instances worked at the same pace.
Routers read the same fields under both timings. ``kv_aware`` reads none of them: as Dynamo's
router does, it counts load from what it routed and what streamed back.

Under ``trace`` timing a router hears of what an instance did (its KV events, a request's first
token, its end) once the instance's step that did it has ended by the request's arrival; a step
still running at the arrival is heard of at a later one.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from kvplug_hookspecs import FrozenModel

from ..traces import TraceRequest
from .kv_index import KVBlockIndex, block_keys
from .replay import SimulationError

__all__ = [
    "ROUTERS",
    "InstanceLoad",
    "KVAwareOptions",
    "KVAwareRouter",
    "LeastLoadedRouter",
    "LlmdOptions",
    "LlmdRouter",
    "PrefixAwareOptions",
    "PrefixAwareRouter",
    "RoundRobinRouter",
    "Router",
    "RouterInfo",
    "SessionOptions",
    "SessionRouter",
    "make_router",
    "session_key",
]


@dataclass
class InstanceLoad:
    """What a router observes of one instance (see the module docstring for the timings)."""

    queue: int = 0  # requests waiting or running (sequential timing: backlog in requests)
    active_blocks: int = 0  # their KV blocks, prompt and output so far (sequential: backlog)
    prefill_blocks: int = 0  # prompt blocks still to compute (sequential: 0)
    kv_usage: float = 0.0  # fraction of the pool not free (cached or held)
    served_tokens: int = 0  # prompt tokens routed to it so far
    served_requests: int = 0


class NoOptions(FrozenModel):
    """This router has no options."""


class Router:
    """Base: ``route`` returns the instance index; ``observe`` takes an instance's KV-event
    batches when the router ``needs_events``; ``first_token`` and ``finished`` tell a router
    that ``tracks_requests`` (one in the response path, as Dynamo's is) when a request it routed
    streamed its first token back and when its stream ended (finished or aborted)."""

    needs_events = False
    tracks_requests = False

    def __init__(self, instances: int, block_size: int, seed: int) -> None:
        self.instances = instances
        self.block_size = block_size
        self.rng = random.Random(seed)

    def route(self, request: TraceRequest, tokens: Sequence[int], loads: list[InstanceLoad]) -> int:
        raise NotImplementedError

    def observe(self, instance: int, batches: list[Any]) -> None:
        """The KV-event batches ``instance`` published since the last call (oldest first)."""

    def first_token(self, instance: int, request_id: int) -> None:
        """Request ``request_id`` (its trace index) returned its first token from ``instance``."""

    def finished(self, instance: int, request_id: int) -> None:
        """Request ``request_id``'s stream from ``instance`` ended."""

    def _pick_min(self, costs: Sequence[Any]) -> int:
        """The index of the smallest cost; ties broken at random (seeded), as Dynamo and llm-d
        break them."""
        best = min(costs)
        tied = [i for i, c in enumerate(costs) if c == best]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    def _cacheable_keys(self, tokens: Sequence[int]) -> list[int]:
        """Chained keys of the whole blocks a cache can match (all but the last token)."""
        return block_keys(tokens[: len(tokens) - 1], self.block_size)


class RoundRobinRouter(Router):
    """Each instance in turn: the baseline every load balancer offers."""

    def __init__(self, instances: int, block_size: int, seed: int, options: NoOptions) -> None:
        super().__init__(instances, block_size, seed)
        self._next = 0

    def route(self, request: TraceRequest, tokens: Sequence[int], loads: list[InstanceLoad]) -> int:
        chosen = self._next
        self._next = (self._next + 1) % self.instances
        return chosen


class LeastLoadedRouter(Router):
    """Fewest requests in flight, then fewest KV blocks in use, then fewest prompt tokens served
    (the "least request" balancers of Envoy and vLLM's production-stack router), lowest index
    last. Blind to caches."""

    def __init__(self, instances: int, block_size: int, seed: int, options: NoOptions) -> None:
        super().__init__(instances, block_size, seed)

    def route(self, request: TraceRequest, tokens: Sequence[int], loads: list[InstanceLoad]) -> int:
        costs = [(x.queue, x.active_blocks, x.served_tokens, i) for i, x in enumerate(loads)]
        return min(costs)[3]


def session_key(request: TraceRequest, block_size: int, key_blocks: int) -> str:
    """A request's session: its ``session_id`` when the trace names one; else its first
    ``key_blocks`` block ids (Mooncake's conversation trace names no session, but a
    conversation's turns share their first blocks: block 0 is a common system prompt, the
    second is the conversation's own); else its first ``key_blocks`` blocks of tokens."""
    if request.session_id is not None:
        return request.session_id
    if request.block_ids is not None:
        return f"{request.extra_key}/{request.block_ids[:key_blocks]}"
    head = tuple(request.prompt[: key_blocks * block_size])
    return f"{request.extra_key}/{hash(head)}"


class SessionOptions(FrozenModel):
    """Session affinity by consistent hashing (Karger et al.; Envoy's ``RING_HASH`` and SGLang
    router's ``consistent_hash`` policy route a session id this way).

    ``virtual_nodes``: points per instance on the ring (ketama's 160, the common default).
    ``key_blocks``: blocks of a prompt that name its session when the trace names none.
    """

    virtual_nodes: int = Field(160, ge=1)
    key_blocks: int = Field(2, ge=1)


def _ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class SessionRouter(Router):
    """Every request of a session to the instance its id hashes to on a consistent-hash ring
    (stable hashes: the same in every process and run). Blind to load."""

    def __init__(self, instances: int, block_size: int, seed: int, options: SessionOptions) -> None:
        super().__init__(instances, block_size, seed)
        self.options = options
        points = sorted(
            (_ring_hash(f"instance-{i}#{v}"), i)
            for i in range(instances)
            for v in range(options.virtual_nodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [i for _, i in points]

    def route(self, request: TraceRequest, tokens: Sequence[int], loads: list[InstanceLoad]) -> int:
        h = _ring_hash(session_key(request, self.block_size, self.options.key_blocks))
        at = bisect.bisect_left(self._points, h) % len(self._points)
        return self._owners[at]


class PrefixAwareOptions(FrozenModel):
    """SGLang router's cache-aware policy (``sgl-router --policy cache_aware``), its defaults.

    ``cache_threshold``: the prefix match rate (matched / prompt tokens) above which the best
    matching worker is chosen; below it, the worker with the smallest tree. The system counts
    as imbalanced when ``max_load - min_load > balance_abs_threshold`` and ``max_load >
    min_load * balance_rel_threshold`` (load: requests in flight); then the least loaded worker
    is chosen whatever the match. ``max_tree_tokens``: each worker's approximate tree is cut
    back, least recently used first, past this size (sgl-router's ``max_tree_size``, counted in
    characters there, in tokens here).
    """

    cache_threshold: float = Field(0.5, ge=0, le=1)
    balance_abs_threshold: int = Field(32, ge=0)
    balance_rel_threshold: float = Field(1.5, ge=1)
    max_tree_tokens: int = Field(2**24, ge=1)


class PrefixAwareRouter(Router):
    """SGLang-router-style cache-aware routing: the router remembers, per worker, the prompts it
    sent there (an approximate prefix tree, here block-granular), never what the worker's cache
    really holds; see :class:`PrefixAwareOptions` for the decision."""

    def __init__(
        self, instances: int, block_size: int, seed: int, options: PrefixAwareOptions
    ) -> None:
        super().__init__(instances, block_size, seed)
        self.options = options
        self._trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(instances)]

    def route(self, request: TraceRequest, tokens: Sequence[int], loads: list[InstanceLoad]) -> int:
        o = self.options
        keys = block_keys(tokens, self.block_size)
        queue = [x.queue for x in loads]
        hi, lo = max(queue), min(queue)
        if hi - lo > o.balance_abs_threshold and hi > lo * o.balance_rel_threshold:
            chosen = queue.index(lo)
        else:
            matched = [self._matched(i, keys) for i in range(self.instances)]
            best = max(matched)
            rate = best * self.block_size / len(tokens)
            if rate > o.cache_threshold:
                chosen = matched.index(best)
            else:
                sizes = [len(tree) for tree in self._trees]
                chosen = sizes.index(min(sizes))
        self._insert(chosen, keys)
        return chosen

    def _matched(self, instance: int, keys: list[int]) -> int:
        tree, n = self._trees[instance], 0
        for key in keys:
            if key not in tree:
                break
            n += 1
        return n

    def _insert(self, instance: int, keys: list[int]) -> None:
        tree = self._trees[instance]
        for key in keys:
            tree[key] = None
            tree.move_to_end(key)
        limit = max(1, self.options.max_tree_tokens // self.block_size)
        while len(tree) > limit:
            tree.popitem(last=False)


class _EventRouter(Router):
    """A router that reads the instances' ``KVEventBatch``es into a :class:`KVBlockIndex`."""

    needs_events = True

    def __init__(self, instances: int, block_size: int, seed: int, options: Any) -> None:
        super().__init__(instances, block_size, seed)
        self.options = options
        self.index = KVBlockIndex(instances)

    def observe(self, instance: int, batches: list[Any]) -> None:
        self.index.apply(instance, batches)


class KVAwareOptions(FrozenModel):
    """NVIDIA Dynamo's KV router (``--router-mode kv``), its defaults and its cost, term by term
    as ``lib/llm/src/kv_router`` computes them.

    Each worker's logit is ``overlap_weight x prefill_blocks + decode_blocks``, lower better
    (``DefaultWorkerSelector::select_worker``, ``scheduler.rs``):

    * ``prefill_blocks`` = potential prefill tokens / block size, a fraction of a block: the
      request's ``isl - overlap x block_size`` (``ActiveSequences::new_tokens``, ``sequence.rs``;
      ``overlap``: the worker's run of the prompt's whole blocks held, from the router's KV-event
      indexer) plus the prefill tokens of the requests the router sent the worker that have not
      yet returned their first token (``active_tokens``; a request stops counting when its first
      token streams back, ``mark_prefill_completed`` in ``KvPushRouter``).
    * ``decode_blocks`` = the distinct blocks of the worker's active sequences (those routed and
      not yet freed: a block shared by several counts once, ``ActiveSequences::active_blocks``
      over ``unique_blocks``) plus the request's whole prompt blocks not among them
      (``new_blocks``): its cached blocks are counted too unless an active sequence holds them.
      Output blocks are not counted (``router_track_output_blocks`` defaults to false).

    This bookkeeping is the router's own (``ActiveSequencesMultiWorker``), updated when it
    routes, when a request's first token comes back and when its stream ends; it reads no load
    from the engines. ``overlap_weight``: ``kv_overlap_score_weight`` (1.0). ``temperature``:
    ``router_temperature`` (0.0: the lowest logit); above 0 a worker is drawn from the softmax
    of ``-logit / (max - min) / temperature`` (``softmax_sample``). Workers tied on the lowest
    logit go to the one whose indexer tree holds the fewest blocks (``tree_sizes``), then at
    random. Not modelled, all off by default in Dynamo: the router queue
    (``router_queue_threshold`` None, ``config.rs``), the busy threshold (``busy_threshold``
    None disables it, ``push_router.rs``), output blocks and their decay, replica sync.
    """

    overlap_weight: float = Field(1.0, ge=0)
    temperature: float = Field(0.0, ge=0)


class ActiveSequences:
    """One worker's active requests as Dynamo's router tracks them (``ActiveSequences``,
    ``sequence.rs``): their whole-block sequence keys, shared blocks counted once, and the
    prefill tokens of those still prefilling."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[int, int] = {}  # key -> active sequences holding it
        self.sequences: dict[int, list[int]] = {}
        self.prefilling: dict[int, int] = {}  # request -> its prefill tokens
        self.active_tokens = 0

    def new_tokens(self, isl: int, overlap: int) -> int:
        return max(0, isl - overlap * self.block_size)

    def new_blocks(self, keys: Sequence[int]) -> int:
        blocks = self.blocks
        return sum(1 for key in keys if key not in blocks)

    @property
    def active_blocks(self) -> int:
        return len(self.blocks)

    def add(self, request_id: int, keys: Sequence[int], isl: int, overlap: int) -> None:
        tokens = self.new_tokens(isl, overlap)
        self.prefilling[request_id] = tokens
        self.active_tokens += tokens
        blocks = self.blocks
        for key in keys:
            blocks[key] = blocks.get(key, 0) + 1
        self.sequences[request_id] = list(keys)

    def prefill_done(self, request_id: int) -> None:
        self.active_tokens -= self.prefilling.pop(request_id, 0)

    def free(self, request_id: int) -> None:
        self.prefill_done(request_id)
        blocks = self.blocks
        for key in self.sequences.pop(request_id, ()):
            left = blocks[key] - 1
            if left:
                blocks[key] = left
            else:
                del blocks[key]


class KVAwareRouter(_EventRouter):
    """Dynamo-style KV-aware routing: overlap from the instances' published ``KVEventBatch``es,
    load from the router's own record of what it sent (see :class:`KVAwareOptions`)."""

    options: KVAwareOptions
    tracks_requests = True

    def __init__(self, instances: int, block_size: int, seed: int, options: Any) -> None:
        super().__init__(instances, block_size, seed, options)
        self.active = [ActiveSequences(block_size) for _ in range(instances)]

    def logits(self, tokens: Sequence[int]) -> tuple[list[float], list[int], list[int]]:
        """Each worker's logit, overlap (blocks) and the prompt's whole-block keys."""
        keys = block_keys(tokens, self.block_size)
        isl, size, weight = len(tokens), self.block_size, self.options.overlap_weight
        logits, overlaps = [], []
        for i, active in enumerate(self.active):
            overlap = len(self.index.prefix(i, keys))
            prefill = (active.new_tokens(isl, overlap) + active.active_tokens) / size
            decode = active.new_blocks(keys) + active.active_blocks
            logits.append(weight * prefill + decode)
            overlaps.append(overlap)
        return logits, overlaps, keys

    def route(self, request: TraceRequest, tokens: Sequence[int], loads: list[InstanceLoad]) -> int:
        logits, overlaps, keys = self.logits(tokens)
        chosen = self._select(logits)
        self.active[chosen].add(request.index, keys, len(tokens), overlaps[chosen])
        return chosen

    def _select(self, logits: list[float]) -> int:
        temperature = self.options.temperature
        if temperature > 0:
            return self._softmax_sample(logits, temperature)
        # the lowest logit; among those the smallest indexer tree, then at random
        held = self.index.held
        return self._pick_min([(x, len(held[i])) for i, x in enumerate(logits)])

    def _softmax_sample(self, logits: list[float], temperature: float) -> int:
        """A draw from the softmax of ``-logit / (max - min) / temperature``."""
        lo, hi = min(logits), max(logits)
        if lo == hi:
            return self.rng.randrange(len(logits))
        weights = [math.exp((lo - x) / (hi - lo) / temperature) for x in logits]
        return self.rng.choices(range(len(logits)), weights)[0]

    def first_token(self, instance: int, request_id: int) -> None:
        self.active[instance].prefill_done(request_id)

    def finished(self, instance: int, request_id: int) -> None:
        self.active[instance].free(request_id)


class LlmdOptions(FrozenModel):
    """llm-d's inference scheduler with its precise prefix-cache scorer.

    ``prefix_weight``, ``queue_weight``, ``kv_usage_weight``: the weights of the
    ``precise-prefix-cache-scorer``, ``queue-scorer`` and ``kv-cache-utilization-scorer`` in
    the scheduling profile (llm-d's example profiles weight the prefix scorer above the load
    scorers, 3 : 2 : 2). The prefix score is the longest consecutive run of the prompt's blocks
    an instance holds (from its KV events), each block weighing ``device_weight`` on the GPU
    and ``host_weight`` on the CPU or storage (its ``medium``), divided by the prompt's blocks;
    the queue score is ``(max - q) / (max - min)`` over the instances (1 when equal); the KV
    score ``1 - usage``. The highest weighted sum wins; ties at random.
    """

    prefix_weight: float = Field(3.0, ge=0)
    queue_weight: float = Field(2.0, ge=0)
    kv_usage_weight: float = Field(2.0, ge=0)
    device_weight: float = Field(1.0, ge=0)
    host_weight: float = Field(0.8, ge=0)


class LlmdRouter(_EventRouter):
    """llm-d-style precise prefix-cache scoring from the instances' ``KVEventBatch``es."""

    options: LlmdOptions

    def route(self, request: TraceRequest, tokens: Sequence[int], loads: list[InstanceLoad]) -> int:
        o = self.options
        keys = self._cacheable_keys(tokens)
        queue = [x.queue for x in loads]
        hi, lo = max(queue), min(queue)
        scores = []
        for i, load in enumerate(loads):
            media = self.index.prefix(i, keys)
            cached = sum(o.device_weight if m in (None, "GPU") else o.host_weight for m in media)
            prefix = cached / len(keys) if keys else 0.0
            queue_score = 1.0 if hi == lo else (hi - load.queue) / (hi - lo)
            scores.append(
                -(
                    o.prefix_weight * prefix
                    + o.queue_weight * queue_score
                    + o.kv_usage_weight * (1.0 - load.kv_usage)
                )
            )
        return self._pick_min(scores)


@dataclass(frozen=True)
class RouterInfo:
    """A router by name: how to make it, its options, one line on what it models."""

    name: str
    factory: Callable[..., Router]
    options: type[FrozenModel]
    description: str


ROUTERS: dict[str, RouterInfo] = {
    info.name: info
    for info in (
        RouterInfo("round_robin", RoundRobinRouter, NoOptions, "each instance in turn"),
        RouterInfo("least_loaded", LeastLoadedRouter, NoOptions, "fewest requests in flight"),
        RouterInfo("session", SessionRouter, SessionOptions, "consistent hash of the session"),
        RouterInfo(
            "prefix_aware", PrefixAwareRouter, PrefixAwareOptions, "SGLang router cache_aware"
        ),
        RouterInfo("kv_aware", KVAwareRouter, KVAwareOptions, "Dynamo KV router (KV events)"),
        RouterInfo("llmd", LlmdRouter, LlmdOptions, "llm-d precise prefix scorer (KV events)"),
    )
}


def make_router(
    name: str, instances: int, block_size: int, seed: int, options: dict[str, Any] | None = None
) -> Router:
    """A router by name; unknown names list the valid ones, bad options name the field."""
    info = ROUTERS.get(name)
    if info is None:
        raise SimulationError(f"unknown router {name!r}; valid: {', '.join(ROUTERS)}")
    return info.factory(instances, block_size, seed, info.options(**(options or {})))
