"""Storage-tier copies against the raw figure of the same bytes, each a ratio in one run.

* **host demote**: ``TierHierarchy.demote`` (inline, no worker) of a batch of pages of a real
  pool: one gather out of the pool, the per-page host layout, a CRC-32C per page, the host
  tier's put. Raw: a plain torch gather (``index_select``) of as many slots of a tensor laid out
  as the pool's KV (``[2, layers, slots, kv heads, head dim]``).
* **host load**: ``TierHierarchy.load`` of those pages (get, check key, tokens, shape, dtype and
  checksum) and the write of their KV into the pool (``kvplug.caches.tiered.write_pages``),
  what a match that hits the host does. Raw: a plain ``index_copy_`` of the same bytes into that
  tensor.
* **redis put / get**: the ``redis`` tier's pipelined batch ``put`` (encode + checksum, one
  pipelined round trip of SETs) and ``get`` (one MGET, decode + checksum) on a real
  ``redis-server`` started for the run. Raw: the server's own ``redis-benchmark`` SET / GET
  of values of the same size, one client, the same pipeline depth.

Rates are medians over repetitions (GB/s for the host, pages per second for Redis); the ratio
is kvplug's over the raw figure (the issue's aim: at least 0.5). CPU only: a CUDA pool adds
the PCIe copy to both sides alike.

    python benchmarks/bench_tiers.py            # 8 layers x 8 kv heads x 128, fp16, page 16
    python benchmarks/bench_tiers.py --quick    # fewer pages and repetitions
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import kvplug
from kvplug.caches.tiered import write_pages
from kvplug.tiers.pages import encode_page

LAYERS, HEADS, DIM, PAGE = 8, 8, 128, 16


def config(pages: int, tiers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "allocator": {"name": "paged"},
        "prefix_cache": {"name": "radix"},
        "pool": {
            "capacity_tokens": pages * PAGE,
            "page_size": PAGE,
            "num_layers": LAYERS,
            "kv_heads": HEADS,
            "head_dim": DIM,
            "dtype": "float16",
            "device": "cpu",
        },
        "storage": {"tiers": tiers, "background": False},
    }


def page_batch(batch: int, seed: int) -> tuple[list[bytes], list[tuple[int, ...]], list[Any]]:
    """``batch`` chained pages' keys, tokens and parents (fresh keys per ``seed``)."""
    keys = [seed.to_bytes(8, "big") + i.to_bytes(8, "big") + bytes(16) for i in range(batch)]
    tokens = [tuple(range(i * PAGE, (i + 1) * PAGE)) for i in range(batch)]
    return keys, tokens, [None, *keys[:-1]]


def median_rate(fn: Callable[[], Any], amount: float, reps: int, setup: Callable[[], Any]) -> float:
    """Median of ``amount / seconds`` over ``reps`` timed calls of ``fn`` (``setup`` untimed)."""
    rates = []
    for _ in range(reps):
        setup()
        t0 = time.perf_counter()
        fn()
        rates.append(amount / (time.perf_counter() - t0))
    return statistics.median(rates)


def host(batch: int, reps: int) -> list[tuple[str, float, float, str]]:
    stack = kvplug.build(
        config(batch, [{"name": "host", "options": {"capacity_tokens": 4 * batch * PAGE}}])
    )
    storage, pool = stack.storage, stack.allocator.pool
    assert storage is not None
    slots = torch.arange(batch * PAGE, dtype=torch.int64)
    pool.write_slots(slots, torch.randn(2, LAYERS, batch * PAGE, HEADS, DIM).half())
    nbytes = 2 * LAYERS * batch * PAGE * HEADS * DIM * 2
    gb = nbytes / 1e9
    seeds = iter(range(1, 1 << 30))
    current: dict[str, Any] = {}

    def fresh() -> None:
        storage.clear()
        current["batch"] = page_batch(batch, next(seeds))

    def demote() -> None:
        keys, tokens, parents = current["batch"]
        storage.demote(keys, tokens, parents, slots)

    out = []
    plain = torch.randn(2, LAYERS, batch * PAGE, HEADS, DIM).half()  # the pool's KV layout
    raw = median_rate(lambda: plain.index_select(2, slots), gb, reps, lambda: None)
    ours = median_rate(demote, gb, reps, fresh)
    assert storage.stats.dropped_pages == 0
    out.append(("host demote", ours, raw, "GB/s"))

    def stored() -> None:
        fresh()
        demote()

    def load() -> None:
        keys, tokens, _ = current["batch"]
        pages, _ = storage.load(keys, tokens, [(0, batch)])
        assert len(pages) == batch
        write_pages(pool, slots, [p.kv for p in pages], PAGE)

    src = torch.randn(2, LAYERS, batch * PAGE, HEADS, DIM).half()
    raw = median_rate(lambda: plain.index_copy_(2, slots, src), gb, reps, lambda: None)
    ours = median_rate(load, gb, reps, stored)
    assert storage.stats.corrupt_pages == 0
    out.append(("host load", ours, raw, "GB/s"))
    stack.close()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def redis_benchmark(port: int, test: str, size: int, pipeline: int, requests: int) -> float:
    """Requests per second of ``redis-benchmark -t test`` (one client)."""
    out = subprocess.run(
        [
            "redis-benchmark", "-p", str(port), "-t", test, "-n", str(requests),
            "-d", str(size), "-P", str(pipeline), "-c", "1", "-r", str(pipeline), "--csv",
        ],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    rows = [r for r in csv.reader(io.StringIO(out.stdout)) if r and r[0] == test.upper()]
    return float(rows[0][1])


def redis(batch: int, reps: int) -> list[tuple[str, float, float, str]]:
    server = shutil.which("redis-server")
    if server is None or shutil.which("redis-benchmark") is None:
        print("redis: skipped (install redis-server: apt-get install redis-server)")
        return []
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvplug-bench-redis-")
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        stack = kvplug.build(
            config(batch, [{"name": "redis", "options": {"url": url, "timeout_s": 30.0}}])
        )
        storage, pool = stack.storage, stack.allocator.pool
        assert storage is not None
        tier = storage.tiers[0]
        slots = torch.arange(batch * PAGE, dtype=torch.int64)
        pool.write_slots(slots, torch.randn(2, LAYERS, batch * PAGE, HEADS, DIM).half())
        keys, tokens, parents = page_batch(batch, 1)
        # the pages as the hierarchy hands them to a tier: host copies with checksums
        storage.demote(keys, tokens, parents, slots)
        pages = tier.get(keys)
        assert all(p is not None for p in pages)
        size = len(encode_page(storage.namespace_id, pages[0]))  # the value the tier stores
        ours_put = median_rate(lambda: tier.put(pages), batch, reps, lambda: None)
        ours_get = median_rate(lambda: tier.get(keys), batch, reps, lambda: None)
        requests = batch * reps
        raw_set = redis_benchmark(port, "set", size, batch, requests)
        raw_get = redis_benchmark(port, "get", size, batch, requests)
        stack.close()
        return [
            ("redis put", ours_put, raw_set, "pages/s"),
            ("redis get", ours_get, raw_get, "pages/s"),
        ]
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer pages and repetitions")
    args = parser.parse_args()
    batch, reps = (32, 5) if args.quick else (64, 15)
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    page_kib = 2 * LAYERS * PAGE * HEADS * DIM * 2 / 1024
    print(
        f"torch {torch.__version__}, cpu, {torch.get_num_threads()} threads; page {PAGE} "
        f"tokens x {LAYERS} layers x {HEADS} kv heads x {DIM}, fp16 ({page_kib:.0f} KiB); "
        f"batches of {batch} pages, median of {reps}"
    )
    print(f"{'copy':<12} {'kvplug':>10} {'raw':>10} {'unit':<8} {'ratio':>6}")
    for name, ours, raw, unit in host(batch, reps) + redis(batch, reps):
        print(f"{name:<12} {ours:>10.2f} {raw:>10.2f} {unit:<8} {ours / raw:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
