"""SGLang's token arrays as the tuples kvplug's cache keys are, without converting every token.

SGLang keeps a request's tokens in one growing ``array('q')`` (``req.full_untruncated_fill_ids``)
and passes it to every match (each waiting request, every round) and checkpoint. kvplug's keys
are tuples of ints; ``tuple(array)`` makes one int object per token, which costs more than the
whole tree walk, and a walk compares those fresh ints one by one against the tree's.

:class:`TokenTuples` converts each array once and, for a new array, only what no recent array
shares: requests that start alike (a system prompt, an earlier turn) get the shared part from
the tuple of the last request that started with the same first page, as a slice of it, so
their keys hold the very int objects the cached edges hold and the walk's compare succeeds on
identity. Every reuse is checked first against a copy of the tokens it was made from (C-level
compares): an array changed in place gets fresh tokens, never stale ones. No SGLang import.
"""

from __future__ import annotations

import weakref
from array import array
from typing import Any

from ... import speedups

__all__ = ["TokenTuples"]

_START = 16  # tokens that index the shared-prefix table (one page at SGLang's usual sizes)


class TokenTuples:
    """``tuple(ids[:length])`` for SGLang's token arrays, memoised per array and shared between
    arrays that start alike (see the module docstring). At most ``capacity`` arrays are
    remembered; an entry dies with its array (a weak reference)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        # id(array) -> (weak ref to it, the tokens the tuple was made from, the tuple)
        self._memo: dict[int, tuple[Any, array[int], tuple[int, ...]]] = {}
        # the first _START tokens (bytes) -> (tokens, tuple) of the last array starting so
        self._by_start: dict[bytes, tuple[array[int], tuple[int, ...]]] = {}

    def get(self, ids: Any, length: int) -> tuple[int, ...]:
        if type(ids) is not array:  # lists and other sequences (tests, tools): no memo
            return tuple(ids[:length])
        memo = self._memo
        key = id(ids)
        entry = memo.get(key)
        if entry is not None and entry[0]() is ids:
            ref, seen, tokens = entry
            have = len(seen)
            if length <= have:
                if ids[:length] == seen[:length]:
                    return tokens if length == have else tokens[:length]
            elif ids[:have] == seen:
                tokens = tokens + tuple(ids[have:length])
                memo[key] = (ref, ids[:length], tokens)
                self._share(ids[:length], tokens)
                return tokens
        seen = ids[:length]
        tokens = self._shared(seen, length)
        if len(memo) >= self.capacity:
            memo.pop(next(iter(memo)))

        def forget(_: Any, key: int = key) -> None:
            memo.pop(key, None)

        memo[key] = (weakref.ref(ids, forget), seen, tokens)
        self._share(seen, tokens)
        return tokens

    def _shared(self, seen: array[int], length: int) -> tuple[int, ...]:
        """The tuple of ``seen``: the common start of the last array with the same first page,
        then only the rest converted."""
        if length < _START:
            return tuple(seen)
        other = self._by_start.get(seen[:_START].tobytes())
        if other is None:
            return tuple(seen)
        their, tokens = other
        same = speedups.common_prefix(seen, their, min(length, len(their)))
        if same == length and len(tokens) == length:
            return tokens
        return tokens[:same] + tuple(seen[same:])

    def _share(self, seen: array[int], tokens: tuple[int, ...]) -> None:
        if len(seen) >= _START:
            start = self._by_start
            if len(start) >= self.capacity:
                start.pop(next(iter(start)))
            start[seen[:_START].tobytes()] = (seen, tokens)

    def clear(self) -> None:
        self._memo.clear()
        self._by_start.clear()
