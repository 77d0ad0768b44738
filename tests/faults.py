"""Deliberately broken plugins and a full-state snapshot, shared by the adversarial tests.

``FaultyPolicy`` is the LRU policy with a trap: ``arm(method, after=n)`` makes the ``n``-th
following call of ``method`` (``key``, ``add``, ``touch``, ``pop``, ``discard``) fail in the
way ``mode`` says: ``raise`` (a ``RuntimeError``), ``incomparable`` (``key`` returns objects
that cannot be ordered) or ``foreign`` (``pop`` returns a candidate from no cache).
``MixedKeyPolicy`` is LRU whose ``key`` returns values of different types (a string for one
candidate, a tuple for another) while ``misbehave(calls)`` lasts, which may be longer than the
call that first fails. ``failing_free(allocator)`` makes ``allocator.free`` raise.
``state(cache, allocator)`` is everything a caller can observe, written so that a node split
(invisible to callers) does not change it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from kvplug.policies.builtin import LRUPolicy
from kvplug_hookspecs import CandidateStats


class Boom(RuntimeError):
    """The error a broken plugin raises."""


class _Unordered:
    """A sort key that cannot be compared with another one."""

    def __lt__(self, other: object) -> bool:
        raise TypeError("this key cannot be ordered")

    __gt__ = __le__ = __ge__ = __lt__


# Every (method, mode) a FaultyPolicy can be armed with.
TRAPS = [
    ("key", "raise"),
    ("key", "incomparable"),
    ("add", "raise"),
    ("touch", "raise"),
    ("discard", "raise"),
    ("pop", "raise"),
    ("pop", "foreign"),
]


class FaultyPolicy(LRUPolicy):
    """LRU until armed; then one call fails (see the module docstring)."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.trap: tuple[str, int, str] | None = None
        self.tripped = False

    def arm(self, method: str, after: int = 1, mode: str = "raise") -> None:
        self.trap, self.tripped = (method, after, mode), False

    def disarm(self) -> None:
        self.trap = None

    def _spring(self, method: str) -> str | None:
        if self.trap is None or self.trap[0] != method:
            return None
        name, after, mode = self.trap
        if after > 1:
            self.trap = (name, after - 1, mode)
            return None
        self.trap, self.tripped = None, True
        if mode == "raise":
            raise Boom(f"{method} failed on purpose")
        return mode

    def key(self, candidate: Any) -> Any:
        if self._spring("key") == "incomparable":
            return _Unordered()
        return super().key(candidate)

    def add(self, candidate: Any) -> None:
        self._spring("add")
        super().add(candidate)

    def touch(self, candidate: Any) -> None:
        self._spring("touch")
        super().touch(candidate)

    def discard(self, candidate: Any) -> None:
        self._spring("discard")
        super().discard(candidate)

    def pop(self) -> Any:
        if self._spring("pop") == "foreign":
            stranger = CandidateStats(0)
            stranger.num_tokens = 1
            return stranger
        return super().pop()


class MixedKeyPolicy(LRUPolicy):
    """LRU, except that while misbehaving ``key`` returns a ``str`` and a ``tuple`` in turn, one
    candidate after the other (they do not compare with each other, nor with the ``int`` keys
    it gives when it behaves)."""

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self.bad_calls = 0

    def misbehave(self, calls: int) -> None:
        """The next ``calls`` calls of ``key`` give mixed keys."""
        self.bad_calls = calls

    def behave(self) -> None:
        self.bad_calls = 0

    def key(self, candidate: Any) -> Any:
        if self.bad_calls > 0:
            self.bad_calls -= 1
            time = candidate.last_access_time
            return f"t{time}" if self.bad_calls % 2 else (time,)
        return super().key(candidate)


@contextlib.contextmanager
def failing_free(allocator: Any, *, after: int = 1) -> Iterator[list[int]]:
    """``allocator.free`` raises on its ``after``-th call inside the block (yields [calls])."""
    real = allocator.free
    calls = [0]

    def free(indices: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == after:
            raise Boom("free failed on purpose")
        real(indices)

    allocator.free = free
    try:
        yield calls
    finally:
        del allocator.free


def _tree_records(cache: Any) -> list[tuple[Any, ...]]:
    """Per cached token: (namespace and path up to it, slot, lock counts, tombstone, stats)."""
    records = []
    # a root child's edge is (extra_key, first token or page): the path starts with the namespace
    stack = [(child, (("ns", child.edge[0]),)) for child in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        path = (*prefix, *node.key)
        start = len(path) - node.num_tokens
        locks = (
            (node.lock_ref,)
            if hasattr(node, "lock_ref")
            else (node.full_lock_ref, node.swa_lock_ref, getattr(node, "swa_tombstone", False))
        )
        stats = (node.last_access_time, node.hit_count, node.priority, node.creation_time)
        for i, slot in enumerate(node.value.tolist()):
            records.append((path[: start + i + 1], slot, locks, stats))
        stack.extend((child, path) for child in node.children.values())
    return sorted(records, key=repr)


def _block_records(cache: Any) -> list[tuple[Any, ...]]:
    return sorted(
        (
            block.digest,
            tuple(block.indices.tolist()),
            block.ref_count,
            block.num_children,
            block.own_locks,
            (block.last_access_time, block.hit_count, block.priority),
        )
        for block in cache._blocks.values()
    )


def owner_states(allocator: Any) -> tuple[int, ...] | None:
    """Every usable slot's owner state, or None when ownership is not tracked."""
    if not getattr(allocator, "tracks_ownership", False):
        return None
    slots = torch.arange(allocator.page_size, allocator.size + allocator.page_size)
    return tuple(allocator.owner_state(slots.to(allocator.device)).tolist())


def state(cache: Any, allocator: Any) -> dict[str, Any]:
    """What a caller can observe of a cache and its allocator (split-invariant)."""
    out: dict[str, Any] = {
        "available": allocator.available_size(),
        "owners": owner_states(allocator),
        "sizes": (cache.evictable_size(), cache.protected_size(), cache.total_size()),
        "stats": cache.stats.as_dict(),
        "clock": getattr(cache, "_clock", None),
    }
    if hasattr(allocator, "swa_available_size"):
        out["swa_available"] = allocator.swa_available_size()
        out["swa_map"] = tuple(allocator.full_to_swa_index_mapping.tolist())
    if hasattr(cache, "swa_evictable_size"):
        out["swa_sizes"] = (cache.swa_evictable_size(), cache.swa_protected_size())
    if hasattr(cache, "_blocks"):
        out["content"] = _block_records(cache)
    elif hasattr(cache, "root"):
        out["content"] = _tree_records(cache)
        root = cache.root
        out["root_locks"] = (
            getattr(root, "own_locks", None),
            getattr(root, "swa_lock_spans", None),
        )
    return out
