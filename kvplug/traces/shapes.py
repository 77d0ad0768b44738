"""Synthetic workloads of other shapes than chat sessions, for eviction-policy studies.

Each generator reads the fields of :class:`~kvplug.traces.synthetic.SyntheticSpec` it needs, in
its own sense (documented per shape), and yields requests in arrival order, exactly
``num_requests`` of them; the same spec gives the same trace. Lengths are in blocks of
``block_size`` tokens, as in the session generator.

* ``tool-loop`` — agents in tool loops over a few long shared contexts (a repository, a tool
  suite): each step appends the model's call and the tool's output; some steps fork a sub-agent
  that shares everything so far, runs a few steps of its own and is never continued.
* ``shared-system`` — many small sessions (one to three short turns) and one-off requests, all
  behind one long system prompt.
* ``doc-bursts`` — bursts of questions over one document from a large corpus (header, document,
  question), whose popularity drifts: the hot set moves every few hundred bursts.
* ``tree-search`` — reasoning tree search: per problem a tree of partial solutions grown a step at
  a time from the most promising open node, with backtracking to older nodes (a held-out shape:
  kvplug's policy defaults were not tuned on it).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .base import BlockPrompt, TraceRequest

if TYPE_CHECKING:
    from .synthetic import SyntheticSpec

__all__ = ["SHAPES", "block_request", "shaped_trace"]

# One session of a shape: (arrival ms, prompt blocks, answer blocks) per request, any order.
Session = list[tuple[float, list[int], list[int]]]


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, count: int) -> list[int]:
        ids = list(range(self.next, self.next + count))
        self.next += count
        return ids


def block_request(
    index: int,
    arrival: float,
    prompt: list[int],
    answer: list[int],
    size: int,
    session: str | None = None,
) -> TraceRequest:
    """A request of whole ``size``-token blocks: ``prompt``, answered by ``answer``, in
    ``session`` (for session-affinity routers)."""
    return TraceRequest(
        index=index,
        timestamp_ms=arrival,
        prompt=BlockPrompt(prompt, len(prompt) * size, size),
        output_length=len(answer) * size,
        output=BlockPrompt(answer, len(answer) * size, size),
        session_id=session,
    )


def _zipf_pick(rng: random.Random, n: int, a: float) -> int:
    weights = [1.0 / (rank**a) for rank in range(1, n + 1)]
    return rng.choices(range(n), weights)[0]


def _tool_loop(spec: SyntheticSpec, rng: random.Random, ids: _Ids) -> Iterator[Session]:
    """``system_prompts`` shared contexts of ``system_blocks`` (Zipf ``zipf_a``); a session is
    a task (``user_blocks``) then 3 to ``max_turns`` steps, each a call (``answer_blocks``) and a
    tool output (``one_off_blocks``) after a tool latency (``think_time_s``, exponential); a
    step forks a sub-agent with probability ``1 - session_fraction``."""
    contexts = [ids.take(spec.system_blocks) for _ in range(spec.system_prompts)]
    clock = 0.0

    def latency() -> float:
        return rng.expovariate(1.0 / spec.think_time_s) * 1000.0 if spec.think_time_s else 0.0

    def loop(t: float, history: list[int], steps: int, session: Session) -> None:
        for _ in range(steps):
            call = ids.take(rng.randint(*spec.answer_blocks))
            session.append((t, list(history), call))
            history = [*history, *call, *ids.take(rng.randint(*spec.one_off_blocks))]
            t += latency()
            if rng.random() > spec.session_fraction:  # a sub-agent over everything so far
                task = [*history, *ids.take(rng.randint(*spec.user_blocks))]
                loop(t, task, rng.randint(2, 4), session)
                t += latency()

    while True:
        clock += rng.expovariate(spec.conversations_per_s) * 1000.0
        context = contexts[_zipf_pick(rng, spec.system_prompts, spec.zipf_a)]
        session: Session = []
        task = [*context, *ids.take(rng.randint(*spec.user_blocks))]
        loop(clock, task, rng.randint(3, max(3, spec.max_turns)), session)
        yield session


def _shared_system(spec: SyntheticSpec, rng: random.Random, ids: _Ids) -> Iterator[Session]:
    """One system prompt of ``system_blocks``; a fraction ``session_fraction`` of arrivals are
    sessions of 1 to ``max_turns`` turns (``user_blocks`` in, ``answer_blocks`` out, think time
    ``think_time_s``), the rest one-off requests (``one_off_blocks``)."""
    system = ids.take(spec.system_blocks)
    clock = 0.0
    while True:
        clock += rng.expovariate(spec.conversations_per_s) * 1000.0
        session: Session = []
        if rng.random() < spec.session_fraction:
            t, history = clock, list(system)
            for _ in range(rng.randint(1, spec.max_turns)):
                prompt = [*history, *ids.take(rng.randint(*spec.user_blocks))]
                answer = ids.take(rng.randint(*spec.answer_blocks))
                session.append((t, prompt, answer))
                history = [*prompt, *answer]
                t += rng.expovariate(1.0 / spec.think_time_s) * 1000.0 if spec.think_time_s else 0
        else:
            prompt = [*system, *ids.take(rng.randint(*spec.one_off_blocks))]
            session.append((clock, prompt, ids.take(rng.randint(*spec.answer_blocks))))
        yield session


def _doc_bursts(spec: SyntheticSpec, rng: random.Random, ids: _Ids) -> Iterator[Session]:
    """A corpus of ``system_prompts`` documents of ``one_off_blocks`` behind a 2-block
    instruction header; a burst (arrivals at ``conversations_per_s``) asks 1 to ``2 * max_turns``
    questions (``user_blocks``) of one document, ``think_time_s`` apart; the document is Zipf
    (``zipf_a``) over a popularity order that moves by a tenth of the corpus every 200 bursts."""
    header = ids.take(2)
    docs = [ids.take(rng.randint(*spec.one_off_blocks)) for _ in range(spec.system_prompts)]
    order = list(range(spec.system_prompts))
    rng.shuffle(order)
    clock, bursts = 0.0, 0
    while True:
        clock += rng.expovariate(spec.conversations_per_s) * 1000.0
        bursts += 1
        if bursts % 200 == 0:  # the hot set drifts
            shift = max(1, spec.system_prompts // 10)
            order = order[shift:] + order[:shift]
        doc = docs[order[_zipf_pick(rng, spec.system_prompts, spec.zipf_a)]]
        session: Session = []
        t = clock
        for _ in range(rng.randint(1, 2 * spec.max_turns)):
            prompt = [*header, *doc, *ids.take(rng.randint(*spec.user_blocks))]
            session.append((t, prompt, ids.take(rng.randint(*spec.answer_blocks))))
            t += rng.expovariate(1.0 / spec.think_time_s) * 1000.0 if spec.think_time_s else 0.0
        yield session


def _tree_search(spec: SyntheticSpec, rng: random.Random, ids: _Ids) -> Iterator[Session]:
    """Per problem (``system_prompts`` shared instructions of ``system_blocks``, then a problem
    of ``one_off_blocks``): 4 to ``4 * max_turns`` expansions, each of the best open node by a
    random score (an older node with probability ``1 - session_fraction``), adding 2 or 3
    children of ``answer_blocks`` steps, ``think_time_s`` apart."""
    instructions = [ids.take(spec.system_blocks) for _ in range(spec.system_prompts)]
    clock = 0.0
    while True:
        clock += rng.expovariate(spec.conversations_per_s) * 1000.0
        root = [
            *instructions[_zipf_pick(rng, spec.system_prompts, spec.zipf_a)],
            *ids.take(rng.randint(*spec.one_off_blocks)),
        ]
        open_nodes: list[tuple[float, int, list[int]]] = [(0.0, 0, root)]
        session: Session = []
        t, serial = clock, 0
        for _ in range(rng.randint(4, 4 * spec.max_turns)):
            if not open_nodes:
                break
            if rng.random() > spec.session_fraction and len(open_nodes) > 1:
                _, _, node = open_nodes.pop(rng.randrange(len(open_nodes)))  # backtrack
                heapq.heapify(open_nodes)
            else:
                _, _, node = heapq.heappop(open_nodes)
            for _ in range(rng.randint(2, 3)):
                step = ids.take(rng.randint(*spec.answer_blocks))
                session.append((t, list(node), step))
                serial += 1
                heapq.heappush(open_nodes, (-rng.random(), serial, [*node, *step]))
                t += rng.expovariate(1.0 / spec.think_time_s) * 1000.0 if spec.think_time_s else 0
        yield session


SHAPES: dict[str, Callable[[SyntheticSpec, random.Random, _Ids], Iterator[Session]]] = {
    "tool-loop": _tool_loop,
    "shared-system": _shared_system,
    "doc-bursts": _doc_bursts,
    "tree-search": _tree_search,
}


def shaped_trace(spec: SyntheticSpec) -> Iterator[TraceRequest]:
    """Yield ``spec.num_requests`` requests of shape ``spec.shape`` in arrival order.

    Sessions start in time order; a request is emitted once no session still to start can
    precede it (a heap of the pending requests), so the order is exact and memory stays
    bounded by the sessions in flight."""
    rng = random.Random(spec.seed)
    ids = _Ids()
    size = spec.block_size
    pending: list[tuple[float, int, list[int], list[int]]] = []
    serial = emitted = 0

    for session in SHAPES[spec.shape](spec, rng, ids):
        start = min(arrival for arrival, _, _ in session)
        while pending and pending[0][0] <= start:
            arrival, _, prompt, answer = heapq.heappop(pending)
            yield block_request(emitted, arrival, prompt, answer, size)
            emitted += 1
            if emitted >= spec.num_requests:
                return
        for arrival, prompt, answer in session:
            serial += 1
            heapq.heappush(pending, (arrival, serial, prompt, answer))
