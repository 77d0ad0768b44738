"""What the two radix trees (``radix`` and ``swa_radix``) share: how a child is keyed, how
far an edge matches a key, and the walk over every node.

A child of a node is keyed by its first token (``page_size == 1``) or its first page (a tuple of
``page_size`` tokens); children of the root also carry the namespace (``extra_key``), so two
namespaces never share a node.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

from .. import speedups

__all__ = ["child_key", "common_len", "descendants"]


class _Node(Protocol):
    @property
    def children(self) -> dict[Any, Any]: ...


N = TypeVar("N", bound=_Node)


def descendants(root: N) -> list[N]:
    """Every node below ``root`` (not ``root`` itself), depth first: for whole-tree operations
    (reset, checks, a policy resync), never on a per-request path."""
    nodes: list[N] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def child_key(
    ids: tuple[int, ...], pos: int, page_size: int, at_root: bool, extra_key: str | None
) -> Any:
    """Key, in its parent's ``children``, of the child that starts at ``ids[pos]``."""
    first = ids[pos] if page_size == 1 else ids[pos : pos + page_size]
    return (extra_key, first) if at_root else first


def common_len(
    node_key: tuple[int, ...], ids: tuple[int, ...], pos: int, end: int, page_size: int
) -> int:
    """How many tokens of ``node_key`` equal ``ids[pos:end]``, in whole pages.

    The first page is known to match (it is the child key). One ``speedups.common_items``: no
    slice is built, and compiled it compares pointers (a request's tokens that came from this
    cache's keys are the same int objects).
    """
    n = min(len(node_key), end - pos)
    same = speedups.common_items(ids, pos, node_key, 0, n)
    return n if same == n else same - same % page_size
