"""The process-wide registry is loaded once, even when threads ask for it at the same time."""

from __future__ import annotations

import threading

from kvplug import get_registry


def test_threads_share_one_registry():
    start = threading.Barrier(4)
    seen = []

    def worker():
        start.wait()
        seen.append(get_registry())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 4 and all(registry is seen[0] for registry in seen)
