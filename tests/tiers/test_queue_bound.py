"""The demotion queue is bounded in pages: a full one drops and counts, and never waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from kvplug.tiers import TierHierarchy
from kvplug_hookspecs import PageData, StorageConfig, TierNamespace, TierStats

NAMESPACE = TierNamespace(
    model_id="t", num_layers=1, kv_heads=1, head_dim=8, dtype="float32", page_size=1,
    hash_function="kvplug-sha256",
)  # fmt: skip


class BlockingTier:
    """A tier whose ``put`` waits until the test releases it."""

    name, medium, latency_s, bandwidth_bytes_per_s = "slow", "CPU", 0.0, 1e9

    def __init__(self) -> None:
        self.release = threading.Event()
        self.stored: list[bytes] = []

    def contains(self, keys: Sequence[bytes]) -> int:
        return 0

    def get(self, keys: Sequence[bytes]) -> list[PageData | None]:
        return [None] * len(keys)

    def put(self, pages: Sequence[PageData]) -> list[PageData]:
        self.release.wait(10)
        self.stored.extend(p.key for p in pages)
        return []

    def remove(self, keys: Sequence[bytes]) -> int:
        return 0

    def clear(self) -> None: ...

    def stats(self) -> TierStats:
        return TierStats(name=self.name, medium=self.medium)

    def close(self) -> None:
        self.release.set()


def test_a_full_queue_drops_pages_without_waiting() -> None:
    tier = BlockingTier()
    hierarchy = TierHierarchy(
        [tier], StorageConfig(queue_pages=3), NAMESPACE, pool=None, page_size=1,
        kv_bytes_per_token=64,
    )  # fmt: skip
    slots = torch.arange(2)
    started = time.perf_counter()
    for i in range(5):  # 2 pages each: the first fits the 3-page bound, every later one drops
        keys = [bytes([i, 0]) * 16, bytes([i, 1]) * 16]
        hierarchy.demote(keys, [(i,), (i,)], [None, keys[0]], slots)
    assert time.perf_counter() - started < 1.0  # never blocked on the stuck tier
    assert hierarchy.stats.dropped_pages == 8
    tier.release.set()
    hierarchy.flush()
    assert len(tier.stored) == 2
    hierarchy.close()
