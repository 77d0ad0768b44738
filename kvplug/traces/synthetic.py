"""A seeded synthetic workload with the shapes prefix caches live on.

Conversations start as a Poisson process. Each opens with one of ``system_prompts`` shared system
prompts, chosen with Zipf popularity. A conversation is a multi-turn session (probability
``session_fraction``): every next turn's prompt is the previous prompt, the previous answer and
new user tokens, arriving after a think time; otherwise it is a one-off request. Every length is
a whole number of ``block_size`` blocks, so block ids line up with token positions.

Presets shape it for policy studies: ``chat`` (the default), ``system-prompts`` (many one-off
requests over Zipf-popular prompts), ``agentic`` (long sessions whose turns add tool output), and
``scan`` (chat traffic with a stream of one-off long documents passing through).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator

from pydantic import Field

from kvplug_hookspecs import FrozenModel

from .base import BlockPrompt, TraceRequest

__all__ = ["PRESETS", "SyntheticSpec", "synthetic_trace"]


class SyntheticSpec(FrozenModel):
    """Parameters of the generator (lengths in blocks of ``block_size`` tokens)."""

    num_requests: int = Field(400, ge=1)
    seed: int = 0
    block_size: int = Field(16, ge=1)
    system_prompts: int = Field(8, ge=1)
    system_blocks: int = Field(32, ge=1)
    zipf_a: float = Field(1.2, gt=0)
    session_fraction: float = Field(0.6, ge=0, le=1)
    max_turns: int = Field(6, ge=1)
    user_blocks: tuple[int, int] = (2, 12)
    answer_blocks: tuple[int, int] = (2, 16)
    one_off_blocks: tuple[int, int] = (4, 32)
    conversations_per_s: float = Field(2.0, gt=0)
    think_time_s: float = Field(20.0, ge=0)


PRESETS: dict[str, SyntheticSpec] = {
    "chat": SyntheticSpec(),
    "system-prompts": SyntheticSpec(
        system_prompts=32, zipf_a=1.0, session_fraction=0.0, one_off_blocks=(2, 8)
    ),
    "agentic": SyntheticSpec(
        system_prompts=4,
        system_blocks=64,
        session_fraction=0.9,
        max_turns=12,
        user_blocks=(4, 24),
        answer_blocks=(1, 4),
        think_time_s=2.0,
    ),
    "scan": SyntheticSpec(session_fraction=0.5, one_off_blocks=(48, 96)),
}


def _zipf_weights(n: int, a: float) -> list[float]:
    return [1.0 / (rank**a) for rank in range(1, n + 1)]


def synthetic_trace(spec: SyntheticSpec | None = None) -> Iterator[TraceRequest]:
    """Yield ``spec.num_requests`` requests in arrival order; the same spec gives the same trace."""
    spec = spec or SyntheticSpec()
    rng = random.Random(spec.seed)
    next_id = 0

    def new_blocks(count: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    def think() -> float:
        mean = spec.think_time_s
        return rng.expovariate(1.0 / mean) * 1000.0 if mean else 0.0

    system = [new_blocks(spec.system_blocks) for _ in range(spec.system_prompts)]
    weights = _zipf_weights(spec.system_prompts, spec.zipf_a)
    # (arrival ms, tie-break, history blocks, turns left, session); a heap yields turns in
    # time order
    pending: list[tuple[float, int, list[int], int, str]] = []
    clock_ms, serial, emitted = 0.0, 0, 0
    while emitted < spec.num_requests:
        clock_ms += rng.expovariate(spec.conversations_per_s) * 1000.0
        while pending and pending[0][0] <= clock_ms and emitted < spec.num_requests:
            arrival, _, history, turns_left, session = heapq.heappop(pending)
            request, history = _turn(spec, rng, new_blocks, emitted, arrival, history, session)
            emitted += 1
            yield request
            if turns_left > 1:
                serial += 1
                heapq.heappush(
                    pending, (arrival + think(), serial, history, turns_left - 1, session)
                )
        if emitted >= spec.num_requests:
            break
        prompt = system[rng.choices(range(spec.system_prompts), weights)[0]]
        if rng.random() < spec.session_fraction:
            turns = rng.randint(2, max(2, spec.max_turns))
            session = f"s{emitted}"  # named after its first request
            request, history = _turn(
                spec, rng, new_blocks, emitted, clock_ms, list(prompt), session
            )
            emitted += 1
            yield request
            serial += 1
            heapq.heappush(pending, (clock_ms + think(), serial, history, turns - 1, session))
        else:
            blocks = [*prompt, *new_blocks(rng.randint(*spec.one_off_blocks))]
            answer = new_blocks(rng.randint(*spec.answer_blocks))
            yield _request(spec, emitted, clock_ms, blocks, answer, f"s{emitted}")
            emitted += 1


def _request(
    spec: SyntheticSpec,
    index: int,
    arrival: float,
    blocks: list[int],
    answer: list[int],
    session: str,
) -> TraceRequest:
    size = spec.block_size
    return TraceRequest(
        index=index,
        timestamp_ms=arrival,
        prompt=BlockPrompt(blocks, len(blocks) * size, size),
        output_length=len(answer) * size,
        output=BlockPrompt(answer, len(answer) * size, size),
        session_id=session,
    )


def _turn(
    spec: SyntheticSpec,
    rng: random.Random,
    new_blocks: Callable[[int], list[int]],
    index: int,
    arrival: float,
    history: list[int],
    session: str,
) -> tuple[TraceRequest, list[int]]:
    """One session turn: history + user blocks, answered by new blocks; returns the request
    and the next turn's history (prompt + answer)."""
    blocks = [*history, *new_blocks(rng.randint(*spec.user_blocks))]
    answer = new_blocks(rng.randint(*spec.answer_blocks))
    return _request(spec, index, arrival, blocks, answer, session), [*blocks, *answer]
