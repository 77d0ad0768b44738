"""``CandidateStats``: the statistics and features an eviction policy reads of a candidate.

kvplug's caches subclass it for their nodes and blocks; an engine adapter that keeps its own
blocks (vLLM's are slotted) keeps one per block in a side table. It is the concrete form of the
:class:`~kvplug_hookspecs.EvictionCandidate` protocol.
"""

from __future__ import annotations

import itertools

__all__ = ["CandidateStats"]

_node_ids = itertools.count(1)


class CandidateStats:
    """What a policy may read to rank a candidate; caches fill what they know.

    Statistics (the cache updates them):

    * ``node_id`` — unique per process; breaks ranking ties deterministically.
    * ``last_access_time``, ``creation_time`` — the owning cache's logical clock, so replays
      are reproducible.
    * ``hit_count`` — requests that reused this candidate; ``priority`` — the request priority
      given at insert; ``num_tokens`` — tokens the candidate holds (what evicting it frees).

    Features (set when the candidate is created; defaults mean "unknown"):

    * ``depth`` — tokens from the root to the candidate's first token (what recomputing it
      would attend over);
    * ``namespace`` — the key's ``extra_key``;
    * ``content_id`` — a stable identity of the content up to the candidate's end (the block
      hash, or a hash of the namespace and the path's tokens); ``0`` when unknown. Policies key
      ghost entries by it: an insert of the same content after an eviction carries the same id;
    * ``partial_page`` — the candidate ends with a page that is not full;
    * ``new_tokens`` — how many tokens the request that created it added;
    * ``turn`` — the conversation turn index when the engine knows it, else ``-1``.
    """

    __slots__ = (
        "__weakref__",
        "content_id",
        "creation_time",
        "depth",
        "hit_count",
        "last_access_time",
        "namespace",
        "new_tokens",
        "node_id",
        "num_tokens",
        "partial_page",
        "priority",
        "turn",
    )

    def __init__(self, now: int = 0, priority: int = 0, num_tokens: int = 0) -> None:
        self.node_id = next(_node_ids)
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = priority
        self.num_tokens = num_tokens
        self.depth = 0
        self.namespace: str | None = None
        self.content_id = 0
        self.partial_page = False
        self.new_tokens = 0
        self.turn = -1

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(id={self.node_id}, tokens={self.num_tokens}, "
            f"last_access={self.last_access_time}, hits={self.hit_count})"
        )
