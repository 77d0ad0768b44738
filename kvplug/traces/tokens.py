"""Token JSONL traces, for users with their own tokenised logs:
``{"token_ids": [...], "output_length": n, "timestamp"?: ms, "extra_key"?: str}``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from .base import TraceError, TraceRequest, read_records

__all__ = ["read_token_jsonl"]


def read_token_jsonl(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    skip_bad: bool = False,
    skipped: list[str] | None = None,
) -> Iterator[TraceRequest]:
    """Yield the trace's requests; errors name the file and line (see ``read_mooncake``)."""
    return read_records(path, _parse, limit=limit, skip_bad=skip_bad, skipped=skipped)


def _parse(record: dict[str, Any], index: int, previous: float) -> TraceRequest:
    tokens = record.get("token_ids")
    if not isinstance(tokens, list) or not tokens:
        raise TraceError("token_ids must be a non-empty list of integers")
    for position, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < 2**63:
            raise TraceError(f"token_ids[{position}] = {token!r} is not a token id")
    output_length = record.get("output_length")
    if not isinstance(output_length, int) or isinstance(output_length, bool) or output_length < 1:
        raise TraceError(f"output_length must be an integer >= 1, got {output_length!r}")
    timestamp = record.get("timestamp", previous)
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool) or timestamp < 0:
        raise TraceError(f"timestamp must be a number >= 0, got {timestamp!r}")
    if timestamp < previous:
        raise TraceError(f"timestamp {timestamp} is before the previous line's {previous}")
    extra_key = record.get("extra_key")
    if extra_key is not None and not isinstance(extra_key, str):
        raise TraceError(f"extra_key must be a string, got {extra_key!r}")
    return TraceRequest(index, float(timestamp), tuple(tokens), output_length, extra_key)
