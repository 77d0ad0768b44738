"""Jobs from the engine's thread to one background worker, waking the worker only when it sleeps.

``queue.Queue`` notifies its consumer on every ``put``. A demotion worker is nearly always
waiting (storing a job takes less time than serving a request), so every eviction paid a futex
wake, and the woken worker then took the GIL from the engine in the middle of its request:
about 9 us of the engine's time per demotion, more than the demotion's own bookkeeping
(``benchmarks/bench_cache.py --tiers`` with a worker that stores nothing).

A :class:`Mailbox` lets the worker, once woken, keep polling every ``poll_s`` while jobs keep
coming and take everything posted since in one batch; only a post that finds it asleep (idle for
``idle_s``) wakes it. A busy engine pays one uncontended lock and an append per job, the worker
runs once per poll interval at most, and an idle one sleeps without polling. ``join`` (a flush)
hurries a polling worker instead of waiting out its interval.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Generic, TypeVar

__all__ = ["Mailbox"]

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Posted jobs, taken in batches by one worker; see the module docstring.

    ``post`` / ``post_all``: any thread, never blocks. ``take``: the worker only; blocks until
    something is posted, returns all of it. ``done(n)``: the worker finished ``n`` taken jobs.
    ``join``: wait until every posted job is done.
    """

    def __init__(self, poll_s: float = 0.002, idle_s: float = 0.02) -> None:
        if poll_s <= 0 or idle_s < poll_s:
            raise ValueError(f"need 0 < poll_s <= idle_s, got poll_s={poll_s}, idle_s={idle_s}")
        self.poll_s, self.idle_s = poll_s, idle_s
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._items: list[T] = []
        self._unfinished = 0  # posted and not yet done
        self._asleep = False  # the worker waits for a wake, not polling
        self.wakes = 0  # posts that had to wake the worker (for tests and benchmarks)

    def post(self, item: T) -> None:
        self.post_all((item,))

    def post_all(self, items: Iterable[T]) -> None:
        with self._lock:
            before = len(self._items)
            self._items.extend(items)
            added = len(self._items) - before
            self._unfinished += added
            wake = self._asleep and added > 0
            if wake:
                self._asleep = False
                self.wakes += 1
        if wake:
            self._wake.set()

    def take(self) -> list[T]:
        """Everything posted and not yet taken (never empty): polls while busy, then sleeps."""
        idle_since = time.monotonic()
        while True:
            with self._lock:
                if self._items:
                    items, self._items = self._items, []
                    self._asleep = False
                    return items
                sleep = time.monotonic() - idle_since >= self.idle_s
                if sleep:
                    self._asleep = True
                self._wake.clear()  # under the lock: a post's wake after this is seen below
            self._wake.wait(None if sleep else self.poll_s)

    def done(self, count: int) -> None:
        with self._lock:
            self._unfinished -= count
            if self._unfinished <= 0:
                self._finished.notify_all()

    def join(self) -> None:
        with self._lock:
            if self._unfinished <= 0:
                return
        self._wake.set()  # a polling worker takes what is posted now, not in poll_s
        with self._lock:
            while self._unfinished > 0:
                self._finished.wait(self.poll_s)
                if self._unfinished > 0 and self._items:
                    self._wake.set()
