"""Seeded shared-prefix prompts for the example engine (its CLI, benchmark and tests)."""

from __future__ import annotations

import random

__all__ = ["shared_prefix_prompts"]


def shared_prefix_prompts(
    num_prompts: int,
    *,
    num_prefixes: int = 2,
    prefix_len: int = 32,
    suffix_len: tuple[int, int] = (4, 16),
    vocab_size: int = 128,
    seed: int = 0,
) -> list[list[int]]:
    """Prompt ``i`` is system prompt ``i % num_prefixes`` followed by a unique suffix.

    Suffix lengths are drawn from ``suffix_len`` (inclusive); the same seed gives the same prompts.
    """
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    low, high = suffix_len
    return [
        prefixes[i % num_prefixes]
        + [rng.randrange(vocab_size) for _ in range(rng.randint(low, high))]
        for i in range(num_prompts)
    ]
