"""A request as the reference scheduler sees it: a prompt, how much to generate, and its state.

A request owns the slots it allocated (``slots[prefix_len:]``) until it finishes or is preempted;
the cached prefix's slots (``slots[:prefix_len]``) stay the cache's, locked through ``node``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Request", "RequestStatus", "synthetic_output_token"]

_OUTPUT_BASE = 1 << 40


def synthetic_output_token(request_id: int, index: int) -> int:
    """The simulator's ``index``-th output token of a request with no given output: unique per
    request and position, and outside every prompt's token range, so outputs never collide."""
    return _OUTPUT_BASE + (request_id << 20) + index


class RequestStatus(enum.Enum):
    """Where a request is: queued, holding memory, done, or refused."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """A prompt to serve. ``output_tokens`` (simulation) are the answer the model would give;
    with a real model they are sampled. ``arrival_ms`` is when it may first be admitted."""

    request_id: int
    prompt: Sequence[int]
    max_new_tokens: int
    extra_key: str | None = None
    arrival_ms: float = 0.0
    output_tokens: Sequence[int] | None = None
    priority: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output: list[int] = field(default_factory=list)
    slots: torch.Tensor | None = None
    prefix_len: int = 0
    node: Any = None
    computed: int = 0
    swa_freed: int = 0
    cached_tokens: int = 0
    tier_tokens: tuple[tuple[str, int], ...] = ()  # of cached_tokens, loaded from storage tiers
    num_preemptions: int = 0
    abort_reason: str | None = None
    admitted_at: int = -1
    finished_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if self.output_tokens is not None and len(self.output_tokens) < self.max_new_tokens:
            raise ValueError(
                f"request {self.request_id}: {len(self.output_tokens)} output tokens given "
                f"for max_new_tokens={self.max_new_tokens}"
            )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def done(self) -> bool:
        """All output tokens produced."""
        return len(self.output) >= self.max_new_tokens

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)

    def token_at(self, position: int) -> int:
        """The token at a sequence position (prompt, then output)."""
        n = len(self.prompt)
        return self.prompt[position] if position < n else self.output[position - n]

    def next_output_token(self) -> int:
        """The given (or synthetic) next output token, for a run without a model."""
        return self.next_output_token_at(len(self.output))

    def next_output_tokens(self, count: int) -> list[int]:
        """The next ``count`` given (or synthetic) output tokens."""
        k = len(self.output)
        if self.output_tokens is not None:
            return [int(t) for t in self.output_tokens[k : k + count]]
        first = synthetic_output_token(self.request_id, k)
        return list(range(first, first + count))

    def next_output_token_at(self, k: int) -> int:
        """The given (or synthetic) ``k``-th output token."""
        if self.output_tokens is not None:
            return int(self.output_tokens[k])
        return synthetic_output_token(self.request_id, k)

    def reset_for_retry(self) -> None:
        """Back to the queue after preemption: recompute everything on re-admission."""
        self.status = RequestStatus.WAITING
        self.output.clear()
        self.slots = None
        self.prefix_len = self.computed = self.cached_tokens = self.swa_freed = 0
        self.tier_tokens = ()
        self.node = None
        self.num_preemptions += 1
