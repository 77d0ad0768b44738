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
