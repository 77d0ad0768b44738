# Types of the compiled kernels (kvplug/_speedups.c); kvplug/speedups.py documents each.
from typing import Any

import numpy as np

def bind_node_type(cls: type, /) -> None: ...
def walk(
    root: Any, node: Any, ids: Any, pos: int, end: int, page: int, extra_key: Any, /
) -> tuple[Any, int, list[Any], Any]: ...
def stamp_hits(path: list[Any], count: int, now: int, /) -> None: ...
def lock_path(node: Any, root: Any, delta: int, /) -> int: ...
def check_slots(
    idx: np.ndarray,
    state: np.ndarray | None,
    div: int,
    require: int,
    low: int,
    high: int,
    scratch: np.ndarray,
    set_to: int = -1,
    /,
) -> tuple[int, int, int, int]: ...
def release_slots(
    idx: np.ndarray,
    state: np.ndarray | None,
    div: int,
    low: int,
    high: int,
    scratch: np.ndarray,
    unit_scratch: np.ndarray,
    units_out: np.ndarray,
    ids: np.ndarray,
    top: int,
    /,
) -> tuple[int, int, int, int, int]: ...
def distinct_units(idx: np.ndarray, div: int, scratch: np.ndarray, out: np.ndarray, /) -> int: ...
def expand_units(units: np.ndarray, div: int, out: np.ndarray, /) -> None: ...
def check_token_ids(ids: tuple[int, ...], known: tuple[int, ...] | None = None, /) -> bool: ...
def common_prefix(a: Any, b: Any, n: int, /) -> int: ...
def sha256_chain(
    parent: bytes, data: bytes, start: int, count: int, size: int, /
) -> list[bytes]: ...
def free_list_append(
    blocks: list[Any],
    tail: Any,
    tracked: bytearray,
    last: list[int],
    num_children: list[int],
    clock: int,
    add: Any,
    /,
) -> None: ...
def free_list_popleft(
    head: Any,
    n: int,
    tracked: bytearray,
    blocks: list[Any],
    parent_of: list[int],
    parent_gen: list[int],
    gen: list[int],
    num_children: list[int],
    content: list[Any],
    pop: Any,
    pushpop: Any,
    add: Any,
    /,
) -> list[Any]: ...
def free_list_touch(
    blocks: Any,
    tracked: bytearray,
    num_children: list[int],
    hits: list[int],
    discard: Any,
    /,
) -> tuple[int, int]: ...

class BlockHeap:
    def __init__(
        self,
        num_blocks: int,
        last: list[int] | None = None,
        hits: list[int] | None = None,
        cap: int = 0,
        div: int = 1,
    ) -> None: ...
    def add(self, block_id: int, /) -> None: ...
    def push(self, block_id: int, key: int, /) -> None: ...
    def discard(self, block_id: int, /) -> None: ...
    def remove(self, block_id: int, /) -> bool: ...
    def pop(self) -> int: ...
    def peek(self) -> int: ...
    def pushpop(self, block_id: int, /) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, block_id: object, /) -> bool: ...
