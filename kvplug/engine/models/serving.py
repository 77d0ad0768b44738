"""Serve prompts with a real model through the reference scheduler: what the CLI, benchmark and
tests call.

The scheduler (``kvplug.engine.scheduler``) owns memory: admission with prefix matching and
shortfall eviction, decode slots, preemption, finish; the model owns compute and reads every K/V
it attends over from the stack's pool. This module only builds the requests and collects what
came out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...stack import KVCacheStack
from ..model import Model
from ..request import Request, RequestStatus
from ..scheduler import Scheduler, SchedulerOptions, SchedulerStats

__all__ = ["ServeResult", "serve"]


@dataclass
class ServeResult:
    """Generated tokens per prompt and what the cache saved."""

    outputs: list[list[int]]
    cached: list[int]  # prompt tokens each request found cached (at its last admission)
    scheduler: SchedulerStats
    seconds: float = 0.0  # wall time of the run
    cpu_seconds: float = 0.0  # this process's CPU time (steadier than wall on a shared machine)
    cache_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return self.scheduler.prompt_tokens

    @property
    def cached_prompt_tokens(self) -> int:
        return sum(self.cached)

    @property
    def prefill_saved(self) -> float:
        """Fraction of prompt tokens served from the cache instead of computed."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def serve(
    stack: KVCacheStack,
    model: Model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    max_running: int = 8,
    chunk_size: int | None = None,
    debug: bool = False,
) -> ServeResult:
    """Greedily generate ``max_new_tokens`` for each prompt, up to ``max_running`` at once.

    ``chunk_size`` bounds the prompt tokens computed per step (chunked prefill); ``debug``
    checks slot conservation after every step. Raises ``RuntimeError`` if a request is aborted
    (it could never fit in the pool).
    """
    options = SchedulerOptions(max_running=max_running, max_prefill_tokens=chunk_size, debug=debug)
    scheduler = Scheduler(stack, model, options)
    requests = [Request(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
    began, cpu_began = time.perf_counter(), time.process_time()
    scheduler.run(requests)
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu_began
    for r in requests:
        if r.status is not RequestStatus.FINISHED:
            raise RuntimeError(f"request {r.request_id} was not served: {r.abort_reason}")
    stats = getattr(stack.prefix_cache, "stats", None)
    return ServeResult(
        outputs=[list(r.output) for r in requests],
        cached=[r.cached_tokens for r in requests],
        scheduler=scheduler.stats,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        cache_stats=stats.as_dict() if stats is not None else {},
    )
