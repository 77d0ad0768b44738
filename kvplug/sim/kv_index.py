"""Which instance holds which block, rebuilt from the ``KVEventBatch``es the instances publish.

This is the indexer a KV-aware router runs (Dynamo's KV router, llm-d's kv-cache indexer): it
never looks inside an instance, it only reads the event stream (``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``, :mod:`kvplug.cluster.wire`) and the prompt's tokens.
As llm-d's indexer does, it maps each engine block hash to a key of its own computed from the
block's tokens (chained to its parent's key), so the prompt of a new request, hashed the same
way, finds the blocks whatever hash scheme the engines use; a ``BlockStored`` whose parent it
never saw is ignored (a subscriber that joined late), as those indexers do.

Keys: ``key_0 = hash((None, tokens of block 0))``, ``key_i = hash((key_{i-1}, tokens of
block i))``, over whole blocks only; Python's hash of a tuple of ints is not salted, so keys are
the same in every process. Namespaces (a request's ``extra_key``) are not told apart: a
``BlockStored`` carries none (vLLM's carries a LoRA name at most).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["KVBlockIndex", "block_keys"]


def block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained keys of the whole blocks of ``tokens``."""
    keys: list[int] = []
    parent: Any = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


class KVBlockIndex:
    """Per instance: the blocks it holds (by key) and the medium each lives on."""

    def __init__(self, instances: int) -> None:
        self.held: list[dict[int, str | None]] = [{} for _ in range(instances)]
        self._keys: list[dict[Any, int]] = [{} for _ in range(instances)]  # engine hash -> key
        self.events = 0
        self.ignored = 0  # BlockStored events whose parent block the index never saw

    def apply(self, instance: int, batches: Iterable[Any]) -> None:
        """Fold an instance's batches (oldest first) into the index."""
        held, keys = self.held[instance], self._keys[instance]
        for batch in batches:
            for event in batch.events:
                self.events += 1
                kind = type(event).__name__
                if kind == "BlockStored":
                    parent_hash = event.parent_block_hash
                    parent: Any = None if parent_hash is None else keys.get(parent_hash)
                    if parent_hash is not None and parent is None:
                        self.ignored += 1
                        continue
                    size, tokens = event.block_size, event.token_ids
                    for j, engine_hash in enumerate(event.block_hashes):
                        parent = hash((parent, tuple(tokens[j * size : (j + 1) * size])))
                        keys[engine_hash] = parent
                        held[parent] = event.medium
                elif kind == "BlockRemoved":
                    for engine_hash in event.block_hashes:
                        key = keys.pop(engine_hash, None)
                        if key is not None:
                            held.pop(key, None)
                elif kind == "AllBlocksCleared":
                    held.clear()
                    keys.clear()

    def prefix(self, instance: int, keys: Sequence[int]) -> list[str | None]:
        """The media of the longest run of ``keys``, from the first, that ``instance`` holds."""
        held = self.held[instance]
        media: list[str | None] = []
        for key in keys:
            if key not in held:
                break
            media.append(held[key])
        return media
