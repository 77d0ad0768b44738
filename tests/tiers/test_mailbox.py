"""The demotion worker's mailbox: a post wakes the worker only when it sleeps, a busy worker
takes what was posted in one batch, ``join`` waits for every post and hurries a polling worker,
and nothing posted from several threads is lost or taken twice."""

from __future__ import annotations

import threading
import time

import pytest

from kvplug.tiers.mailbox import Mailbox


class Worker:
    """Takes batches from a mailbox until it takes ``None``; records each batch."""

    def __init__(self, box: Mailbox[int | None]) -> None:
        self.box = box
        self.batches: list[list[int]] = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while True:
            items = self.box.take()
            self.batches.append([i for i in items if i is not None])
            self.box.done(len(items))
            if None in items:
                return

    def stop(self) -> None:
        self.box.post(None)
        self.box.join()  # hurries a polling worker to the None
        self.thread.join(10)
        assert not self.thread.is_alive()

    @property
    def taken(self) -> list[int]:
        return [i for batch in self.batches for i in batch]


def wait_asleep(box: Mailbox[int | None]) -> None:
    deadline = time.monotonic() + 10
    while not box._asleep:  # the worker sleeps once idle for idle_s
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_post_wakes_a_sleeping_worker_and_a_busy_one_takes_a_batch() -> None:
    box: Mailbox[int | None] = Mailbox(poll_s=0.05, idle_s=0.5)
    worker = Worker(box)
    wait_asleep(box)
    box.post(0)  # asleep: this post wakes it
    assert box.wakes == 1
    for i in range(1, 101):  # well within idle_s: the worker polls, nobody wakes it
        box.post(i)
    box.join()
    assert box.wakes == 1
    assert worker.taken == list(range(101))
    assert len(worker.batches) <= 3  # the first post, then the 100 in one poll (or two)
    worker.stop()


def test_post_all_counts_every_item_and_wakes_once() -> None:
    box: Mailbox[int | None] = Mailbox(poll_s=0.05, idle_s=0.1)
    worker = Worker(box)
    wait_asleep(box)
    box.post_all([])  # nothing posted: no wake
    assert box.wakes == 0
    box.post_all(range(5))
    box.join()
    assert (box.wakes, worker.taken) == (1, [0, 1, 2, 3, 4])
    worker.stop()


def test_join_hurries_a_polling_worker() -> None:
    box: Mailbox[int | None] = Mailbox(poll_s=30.0, idle_s=60.0)
    worker = Worker(box)  # polls every 30 s and never sleeps in this test
    box.post(7)
    started = time.monotonic()
    box.join()
    assert time.monotonic() - started < 10  # not the 30 s poll
    assert worker.taken == [7] and box.wakes == 0
    box.join()  # nothing outstanding: returns at once
    worker.stop()


def test_nothing_posted_from_several_threads_is_lost_or_taken_twice() -> None:
    box: Mailbox[int | None] = Mailbox(poll_s=0.001, idle_s=0.002)  # sleeps and wakes often
    worker = Worker(box)

    def post(base: int) -> None:
        for i in range(2000):
            if i % 100 == 0:
                time.sleep(0.003)  # long enough for the worker to fall asleep
            if i % 7 == 0:
                box.post_all([base + i])
            else:
                box.post(base + i)

    threads = [threading.Thread(target=post, args=(t * 10_000,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    box.join()
    assert sorted(worker.taken) == sorted(t * 10_000 + i for t in range(4) for i in range(2000))
    worker.stop()


@pytest.mark.parametrize(("poll_s", "idle_s"), [(0.0, 1.0), (-1.0, 1.0), (0.5, 0.1)])
def test_bad_intervals_are_refused(poll_s: float, idle_s: float) -> None:
    with pytest.raises(ValueError, match="0 < poll_s <= idle_s"):
        Mailbox(poll_s=poll_s, idle_s=idle_s)
