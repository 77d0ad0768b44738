"""Request traces for the simulator: Mooncake JSONL, token JSONL, and a seeded synthetic workload.

Every reader streams :class:`TraceRequest` objects in arrival order and reports a malformed line
with its file and line number (or skips and counts it with ``skip_bad``).
"""

from __future__ import annotations

from .base import BlockPrompt, TraceError, TraceRequest, block_id_of, block_tokens
from .mooncake import read_mooncake
from .synthetic import PRESETS, SyntheticSpec, synthetic_trace
from .tokens import read_token_jsonl

__all__ = [
    "PRESETS",
    "BlockPrompt",
    "SyntheticSpec",
    "TraceError",
    "TraceRequest",
    "block_id_of",
    "block_tokens",
    "read_mooncake",
    "read_token_jsonl",
    "synthetic_trace",
]
