"""Observer fan-out: forward cache events to every plugin's observer hookimpl.

The registry resolves the hookimpls once (at ``kvplug.build``); a cache then holds a
:class:`HookEvents` sink, or ``None`` when nobody observes and events cost nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pydantic import BaseModel

from kvplug_hookspecs import CacheCleared, CacheEvents, PrefixRemoved, PrefixStored

__all__ = ["HookEvents"]

log = logging.getLogger(__name__)

Observer = Callable[..., object]


class HookEvents:
    """Forwards cache events to each observer hookimpl in turn.

    Each observer is called on its own: one that raises is logged and skipped, so a broken
    metrics plugin neither breaks the cache nor hides the event from the other observers.
    """

    __slots__ = ("_cleared", "_removed", "_stored")

    def __init__(
        self, stored: list[Observer], removed: list[Observer], cleared: list[Observer]
    ) -> None:
        self._stored, self._removed, self._cleared = stored, removed, cleared

    @staticmethod
    def _call(functions: list[Observer], event: BaseModel) -> None:
        for function in functions:
            try:
                function(event=event)
            except Exception:
                log.exception(
                    "kvplug observer hook %s failed", getattr(function, "__qualname__", function)
                )

    @classmethod
    def joined(cls, events: HookEvents | None, sinks: list[CacheEvents]) -> HookEvents | None:
        """``events`` (or no observer hooks) plus ``sinks`` (objects with the ``CacheEvents``
        methods, a stack's own observers), each called the same guarded way, hooks first."""
        if not sinks:
            return events
        stored, removed, cleared = (
            ([], [], []) if events is None else (events._stored, events._removed, events._cleared)
        )
        return cls(
            [*stored, *(s.prefix_stored for s in sinks)],
            [*removed, *(s.prefix_removed for s in sinks)],
            [*cleared, *(s.cache_cleared for s in sinks)],
        )

    def prefix_stored(self, event: PrefixStored) -> None:
        self._call(self._stored, event)

    def prefix_removed(self, event: PrefixRemoved) -> None:
        self._call(self._removed, event)

    def cache_cleared(self, event: CacheCleared) -> None:
        self._call(self._cleared, event)
