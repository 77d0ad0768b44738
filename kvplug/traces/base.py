"""What every trace reader yields: one :class:`TraceRequest` per request, in arrival order.

Block-structured traces (Mooncake, the synthetic generator) describe a prompt as block ids: an
id stands for the whole prefix up to and including its block, so equal ids mean a reusable
prefix. :func:`block_tokens` maps an id to ``block_size`` deterministic tokens that no other id
shares, so equal ids give equal tokens and different ids never collide, and the id can be read
back from any token (the simulator's offline optimum uses that). Prompts materialise lazily
(:class:`BlockPrompt`): a 1 GB trace streams, and only the requests in flight hold tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from ..errors import KvplugError

__all__ = [
    "BlockPrompt",
    "TraceError",
    "TraceRequest",
    "block_id_of",
    "block_tokens",
    "read_records",
]


class TraceError(KvplugError, ValueError):
    """A malformed trace line; the message names the file and line."""


def block_tokens(block_id: int, block_size: int, length: int | None = None) -> list[int]:
    """The tokens of block ``block_id`` (its first ``length`` when the block is partial)."""
    first = block_id * block_size + 1  # token 0 is never used: engines pad with it
    return list(range(first, first + (block_size if length is None else length)))


def block_id_of(token: int, block_size: int) -> int:
    """The block id a token of :func:`block_tokens` came from."""
    return (token - 1) // block_size


class BlockPrompt(Sequence[int]):
    """A prompt given as block ids. Its tokens are made on first access, once, as a tuple, and
    kept while the prompt lives (a request in flight), so a streamed trace holds tokens only for
    those. A slice is a tuple slice (no list is built); a cache takes the tuple as it is."""

    __slots__ = ("_tokens", "block_ids", "block_size", "length")

    def __init__(self, block_ids: Sequence[int], length: int, block_size: int) -> None:
        self.block_ids = tuple(block_ids)
        self.length = length
        self.block_size = block_size
        self._tokens: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return self.length

    def tokens(self) -> tuple[int, ...]:
        """All tokens, as a tuple (made once).

        Consecutive block ids hold consecutive tokens (block ``b`` ends where ``b + 1``
        begins, see :func:`block_tokens`), so each run of consecutive ids is one ``range``:
        a conversation's prompt is a few runs, not one slice per block."""
        if self._tokens is None:
            out: list[int] = []
            for run in self._runs():
                out.extend(run)
            self._tokens = tuple(out)
        return self._tokens

    def _runs(self) -> Iterator[range]:
        """One range per run of consecutive block ids (the last block may be partial)."""
        size, ids, end = self.block_size, self.block_ids, self.length
        j = 0
        while j < len(ids):
            k = j + 1
            while k < len(ids) and ids[k] == ids[k - 1] + 1:
                k += 1
            first = ids[j] * size + 1
            yield range(first, first + min(k * size, end) - j * size)
            j = k

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            return self.tokens()[index]
        if index < 0:
            index += self.length
        if not 0 <= index < self.length:
            raise IndexError(index)
        block, offset = divmod(index, self.block_size)
        return self.block_ids[block] * self.block_size + 1 + offset

    def __iter__(self) -> Iterator[int]:
        return iter(self.tokens())


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. ``prompt`` is a token sequence (a :class:`BlockPrompt` for
    block-structured traces); ``output`` the answer's tokens when the trace knows them (the
    synthetic generator does, so a next turn can reuse them), else ``None``. ``session_id``
    names the conversation a request belongs to when the trace knows it (the synthetic
    generator does; routers with session affinity use it)."""

    index: int
    timestamp_ms: float
    prompt: Sequence[int]
    output_length: int
    extra_key: str | None = None
    output: Sequence[int] | None = None
    session_id: str | None = None

    @property
    def block_ids(self) -> tuple[int, ...] | None:
        """The prompt's block ids, for block-structured traces."""
        prompt = self.prompt
        return prompt.block_ids if isinstance(prompt, BlockPrompt) else None


Parse = Callable[[dict[str, Any], int, float], TraceRequest]


def read_records(
    path: str | os.PathLike[str],
    parse: Parse,
    *,
    limit: int | None,
    skip_bad: bool,
    skipped: list[str] | None,
) -> Iterator[TraceRequest]:
    """Stream a JSONL trace: each non-blank line is a JSON object that ``parse(record, index,
    previous_timestamp)`` turns into a request. A bad line raises :class:`TraceError` naming the
    file and line, or with ``skip_bad`` is skipped and described in ``skipped``."""
    previous = 0.0
    index = 0
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and index >= limit:
                return
            if not line.strip():
                continue
            try:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise TraceError("a line must be a JSON object")
                request = parse(record, index, previous)
            except TraceError as exc:
                message = f"{os.fspath(path)}:{number}: {exc}"
                if not skip_bad:
                    raise TraceError(message) from None
                if skipped is not None:
                    skipped.append(message)
                continue
            previous = request.timestamp_ms
            index += 1
            yield request
