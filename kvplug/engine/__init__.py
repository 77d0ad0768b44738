"""The engine side of kvplug: the reference scheduler and the example models it drives.

:class:`Scheduler` batches requests over a ``KVCacheStack`` with the calls a vLLM- or SGLang-style
engine makes; a :class:`Model` plugs in a forward pass (``None`` simulates). ``serve_request`` is
the one-shot request lifecycle for callers without a scheduler.
"""

from __future__ import annotations

from .lifecycle import ServeResult, serve_request
from .model import ForwardItem, Model
from .request import Request, RequestStatus
from .scheduler import ConservationError, Scheduler, SchedulerOptions, SchedulerStats

__all__ = [
    "ConservationError",
    "ForwardItem",
    "Model",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOptions",
    "SchedulerStats",
    "ServeResult",
    "serve_request",
]
