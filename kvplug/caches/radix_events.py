"""KV events of the ``radix`` and ``swa_radix`` caches, with per-page chained block hashes.

A :class:`RadixBlockHashes` exists only while someone observes the cache's events (the cache
holds ``None`` otherwise and calls nothing here): with no observer, no page is ever hashed.

It keeps, for every node of the tree, the digests of the node's pages (its ``key`` cut into
``page_size`` tokens; a node always holds whole pages), chained from its parent's last page by
the cache's :class:`~kvplug.caches.block_hashing.BlockHasher` (kvplug's scheme, or vLLM's with
``block_hash = "vllm"``), the hashes ``block_hash`` computes for the same pages. The events
carry the hasher's ``event_hash`` of those digests:

* ``insert`` that creates a leaf: one ``PrefixStored`` with the leaf's page hashes, the hash
  of the page before it (``parent_block_hash``, ``None`` under the root) and its tokens;
* a split: nothing (no cached content changes); the digests are divided between head and tail;
* ``evict``: one ``PrefixRemoved`` with the hashes of every freed page, leaf by leaf in
  eviction order; a leaf cut by an exact eviction reports only its freed tail pages;
* ``reset``: ``CacheCleared`` (the cache emits it; a fresh instance starts with the new tree).

``swa_radix`` reports its full side the same way (a window tombstone keeps its full KV, so its
pages stay stored; freeing only the window emits no hashes, as SGLang's SWA tree emits nothing).

A page is never partial: the radix caches cache whole pages only (the unaligned tail of a key stays
the caller's), as SGLang's radix cache does, so every hash covers ``page_size`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvplug_hookspecs import CacheEvents, PrefixRemoved, PrefixStored

from .block_hashing import BlockHasher


class RadixNode(Protocol):
    """What the hashes read of a tree node (``RadixNode`` and ``SWARadixNode`` have it)."""

    parent: Any
    key: tuple[int, ...]
    num_tokens: int
    namespace: str | None


__all__ = ["RadixBlockHashes"]


class RadixBlockHashes:
    """The page digests of one radix tree's nodes, and the events that carry them.

    ``events=None``: the digests alone (a cache with storage tiers keys its pages by them and
    nobody observes its events).
    """

    __slots__ = ("_cache", "_digests", "_events", "_hasher", "_page", "_root")

    def __init__(
        self,
        events: CacheEvents | None,
        cache: str,
        root: RadixNode,
        page_size: int,
        hasher: BlockHasher | None = None,
    ) -> None:
        self._events = events
        self._cache = cache
        self._root = root
        self._page = page_size
        self._hasher = hasher or BlockHasher("sha256")
        self._digests: dict[RadixNode, list[bytes]] = {}

    def digests(
        self,
        node: RadixNode,
        parent: RadixNode | None = None,
        key: tuple[int, ...] | None = None,
    ) -> list[bytes]:
        """The digests of ``node``'s pages (computed, and those of uncached ancestors, once).

        ``parent``: the node ``node`` hung from, for a leaf an eviction just unlinked. ``key``:
        ``node``'s key before an exact eviction cut it (its pages' digests, when not known
        yet, are those of the uncut key: the children it had chain from its last page).
        """
        known = self._digests
        if node in known:
            return known[node]
        missing = [node]
        up: RadixNode | None = node.parent if node.parent is not None else parent
        while up is not None and up is not self._root and up not in known:
            missing.append(up)
            up = up.parent
        if up is None:
            raise ValueError(f"{node!r} is not in the tree these hashes describe")
        hasher = self._hasher
        chain = hasher.root(node.namespace) if up is self._root else known[up][-1]
        for n in reversed(missing):
            tokens = key if key is not None and n is node else n.key
            pages = len(tokens) // self._page
            known[n] = list(hasher.chain(chain, tokens, self._page, pages, n.namespace))
            chain = known[n][-1]
        return known[node]

    def known(self, node: RadixNode) -> list[bytes] | None:
        """The digests of ``node``'s pages when computed already (nothing is computed)."""
        return self._digests.get(node)

    def split(self, head: RadixNode, tail: RadixNode) -> None:
        """``tail`` lost its first ``head.num_tokens`` tokens to the new node ``head``."""
        digests = self._digests.pop(tail, None)
        if digests is not None:
            pages = head.num_tokens // self._page
            self._digests[head], self._digests[tail] = digests[:pages], digests[pages:]

    def stored(self, leaf: RadixNode) -> None:
        """Report the new leaf ``leaf`` (just linked under its parent)."""
        if self._events is None:
            return  # digests alone: computed when a match or a demotion first needs them
        parent = leaf.parent
        parent_hash = None
        if parent is not None and parent is not self._root:
            parent_hash = self._hasher.event_hash(self.digests(parent)[-1])
        self._events.prefix_stored(
            PrefixStored(
                cache=self._cache,
                num_tokens=leaf.num_tokens,
                block_hashes=tuple(map(self._hasher.event_hash, self.digests(leaf))),
                extra_key=leaf.namespace,
                parent_block_hash=parent_hash,
                token_ids=leaf.key,
            )
        )

    def removed(
        self, leaves: Sequence[RadixNode], cut: RadixNode | None, cut_pages: int, num_tokens: int
    ) -> None:
        """Report an eviction: ``leaves`` were unlinked (in that order), then ``cut`` (when not
        ``None``) lost its last ``cut_pages`` pages. Forgets what is no longer cached."""
        known = self._digests
        if self._events is None:  # digests alone: forget the removed ones, report nothing
            for leaf in leaves:
                known.pop(leaf, None)
            if cut is not None and cut in known:
                known[cut] = known[cut][: cut.num_tokens // self._page]
            return
        event_hash = self._hasher.event_hash
        hashes: list[int] = []
        for leaf in leaves:
            digests = known.pop(leaf, None)  # unknown: never matched or observed (no events)
            if digests is not None:
                hashes.extend(map(event_hash, digests))
        if cut is not None and cut in known:
            digests = known[cut]
            keep = cut.num_tokens // self._page  # the pages it kept
            hashes.extend(map(event_hash, digests[keep:]))
            known[cut] = digests[:keep]
        self._events.prefix_removed(
            PrefixRemoved(cache=self._cache, num_tokens=num_tokens, block_hashes=tuple(hashes))
        )
