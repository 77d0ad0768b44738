"""Mooncake JSONL traces: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``.

Each hash id is one ``block_size``-token block (512 in the published traces) standing for the
whole prefix up to it; the last block may be partial. Lines stream one at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from .base import BlockPrompt, TraceError, TraceRequest, read_records

__all__ = ["read_mooncake"]


def read_mooncake(
    path: str | os.PathLike[str],
    *,
    block_size: int = 512,
    limit: int | None = None,
    skip_bad: bool = False,
    skipped: list[str] | None = None,
) -> Iterator[TraceRequest]:
    """Yield the trace's requests. A malformed line raises :class:`TraceError` naming the file
    and line, or with ``skip_bad`` is skipped and described in ``skipped``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    def parse(record: dict[str, Any], index: int, previous: float) -> TraceRequest:
        return _parse(record, index, block_size, previous)

    return read_records(path, parse, limit=limit, skip_bad=skip_bad, skipped=skipped)


def _int(record: dict[str, Any], field: str, minimum: int) -> int:
    value = record.get(field)
    if value is None:
        raise TraceError(f"missing {field!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse(record: dict[str, Any], index: int, block_size: int, previous: float) -> TraceRequest:
    timestamp = record.get("timestamp")
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool) or timestamp < 0:
        raise TraceError(f"timestamp must be a number >= 0, got {timestamp!r}")
    if timestamp < previous:
        raise TraceError(f"timestamp {timestamp} is before the previous line's {previous}")
    input_length = _int(record, "input_length", 1)
    output_length = _int(record, "output_length", 0)
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
    ):
        raise TraceError("hash_ids must be a list of non-negative integers")
    blocks = -(-input_length // block_size)
    if len(hash_ids) != blocks:
        raise TraceError(
            f"{len(hash_ids)} hash_ids contradict input_length {input_length} "
            f"({blocks} blocks of {block_size} tokens)"
        )
    return TraceRequest(
        index=index,
        timestamp_ms=float(timestamp),
        prompt=BlockPrompt(hash_ids, input_length, block_size),
        output_length=max(1, output_length),  # a request generates at least one token
    )
