"""The example engine with and without prefix caching on a shared-prefix workload.

    python benchmarks/bench_engine.py [--device auto|cpu|cuda] [--quick] [--threads N]

Serves the same prompts (a few long system prompts, short unique suffixes) with the tiny
real-attention model through the reference scheduler, per cache: with prefix caching (``radix``,
``block_hash``) and without (``chunk``: every prompt token computed). Prints tokens/s (prompt +
generated tokens per second of wall time), generated tokens/s, ``tok/CPU-s`` (tokens per second
of this process's CPU time, steadier on a shared machine), the fraction of prefill tokens served
from the cache, and the KV pool's bytes, checked against
``(capacity + page_size) x layers x 2 x kv_heads x head_dim x dtype size`` (the extra page is
the padding page). Generated tokens must be identical with and without caching. Each row is
the fastest of ``--repeat`` runs from an empty cache (the CPU of a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy

import torch  # noqa: E402

import kvplug  # noqa: E402
from kvplug.engine.models import TinyModel  # noqa: E402
from kvplug.engine.models.prompts import shared_prefix_prompts  # noqa: E402
from kvplug.engine.models.serving import serve  # noqa: E402
from kvplug.pools import resolve_device  # noqa: E402

GEOMETRY = {"num_layers": 4, "kv_heads": 4, "head_dim": 32, "dtype": "float32"}


def config(cache: str, device: str, capacity: int, page_size: int) -> dict[str, Any]:
    allocator = "standard" if page_size == 1 else "paged"
    return {
        "allocator": allocator,
        "prefix_cache": cache,
        "eviction_policy": "lru",
        "pool": {
            **GEOMETRY,
            "capacity_tokens": capacity,
            "page_size": page_size,
            "device": device,
        },
    }


def expected_pool_bytes(capacity: int, page_size: int, dtype: torch.dtype) -> int:
    g = GEOMETRY
    per_token = int(g["num_layers"]) * 2 * int(g["kv_heads"]) * int(g["head_dim"])
    return (capacity + page_size) * per_token * torch.empty(0, dtype=dtype).element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda")
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per row (the fastest)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    num_prompts, prefix_len, new_tokens, batch = (16, 128, 8, 4) if args.quick else (64, 512, 16, 8)
    prompts = shared_prefix_prompts(
        num_prompts, num_prefixes=4, prefix_len=prefix_len, suffix_len=(16, 64), seed=0
    )
    capacity = 1 << 14
    print(
        f"device {device}, {num_prompts} prompts ({prefix_len}-token system prompts x 4 + "
        f"16..64 unique tokens), {new_tokens} new tokens each, at most {batch} running, "
        f"model {GEOMETRY['num_layers']} layers x {GEOMETRY['kv_heads']} kv heads x "
        f"{GEOMETRY['head_dim']}, float32"
    )
    header = (
        f"{'cache':<12}{'page':>5}{'tokens/s':>10}{'gen tok/s':>11}{'tok/CPU-s':>11}"
        f"{'prefill saved':>15}{'pool bytes':>14}  same tokens"
    )
    print(header)
    rows = [("chunk", 1), ("radix", 1), ("radix", 16), ("block_hash", 16)]
    baseline: list[list[int]] | None = None
    for cache, page in rows:
        stack = kvplug.build(config(cache, str(device), capacity, page))
        model = TinyModel.for_stack(stack)
        serve(stack, model, prompts[:batch], 2, max_running=batch)  # warm up
        runs = []
        for _ in range(1 if args.quick else args.repeat):  # each run starts from an empty cache
            stack = kvplug.build(config(cache, str(device), capacity, page))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            runs.append(serve(stack, model, prompts, new_tokens, max_running=batch))
        result = min(runs, key=lambda r: r.seconds)
        pool_bytes = stack.pool.mem_bytes()
        assert pool_bytes == expected_pool_bytes(capacity, page, stack.pool.dtype), pool_bytes
        if baseline is None:
            baseline = result.outputs
        total = result.prompt_tokens + num_prompts * new_tokens
        print(
            f"{cache:<12}{page:>5}{total / result.seconds:>10.0f}"
            f"{num_prompts * new_tokens / result.seconds:>11.1f}"
            f"{total / result.cpu_seconds:>11.0f}"
            f"{result.prefill_saved:>15.1%}{pool_bytes:>14}  {result.outputs == baseline}"
        )


if __name__ == "__main__":
    main()
