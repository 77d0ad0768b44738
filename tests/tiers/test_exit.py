"""A program that exits without closing its stack: the demotion worker is closed at exit.

Without that, the interpreter tore torch down under a worker still copying a page (a C++ abort,
"terminate called without an active exception", about one exit in four with the example's
tiers) and what was still queued was lost. Now exiting stores exactly what ``close()`` stores.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import random, sys
    import torch
    import kvplug
    from kvplug_hookspecs import CacheKey

    stack = kvplug.build({
        "allocator": "paged", "prefix_cache": "radix",
        "pool": {"capacity_tokens": 64, "page_size": 4, "num_layers": 2, "kv_heads": 2,
                 "head_dim": 8, "dtype": "float32", "device": "cpu"},
        "storage": {"model_id": "exit-test", "background": True,
                    "tiers": [{"name": "disk", "options": {"path": sys.argv[1]}}]},
    })
    rng = random.Random(0)
    cache, allocator = stack.prefix_cache, stack.allocator
    for _ in range(60):  # every request evicts: its pages are queued for the disk
        tokens = [rng.randrange(1000) for _ in range(32)]
        kvplug.evict_from_tree_cache(cache, 32)
        slots = allocator.alloc(32)
        stack.pool.write_slots(slots, torch.randn(2, 2, 32, 2, 8))
        cache.insert(CacheKey(tokens), slots)
    if sys.argv[2] == "close":
        stack.close()
    """
)


def run_child(path: Path, how: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), how],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return {p.name for p in path.rglob("*.kvpg")}


def test_exiting_without_close_stores_what_close_stores(tmp_path: Path) -> None:
    closed = run_child(tmp_path / "closed", "close")
    # 60 requests of 32 tokens into 64 slots: the last 58 evict 8 pages of 4 tokens each
    assert len(closed) == 58 * 8
    for i in range(3):  # the abort came at about one exit in four
        assert run_child(tmp_path / f"exit-{i}", "exit") == closed
