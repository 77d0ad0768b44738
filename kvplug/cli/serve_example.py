"""``kvplug serve-example``: generate with the tiny real-attention model on any config.

The reference scheduler serves the prompts; the model's attention reads and writes K/V only
through the config's pool, so this shows a config serving real forward passes: the tokens each
prompt generates, how much of each prompt came from the cache, and the cache's counters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.table import Table

from ..errors import ConfigError, UnknownComponentError
from .app import EXIT_BAD_CONFIG, DebugOption, app, fail, out

DEFAULT_CONFIG: dict[str, Any] = {
    "allocator": "standard",
    "prefix_cache": "radix",
    "eviction_policy": "lru",
    "pool": {
        "capacity_tokens": 1024,
        "num_layers": 2,
        "kv_heads": 2,
        "head_dim": 16,
        "dtype": "float32",
        "device": "cpu",
    },
}


@app.command("serve-example")
def serve_example(
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="A .toml or .json config (default: radix/lru, cpu)."),
    ] = None,
    num_prompts: Annotated[int, typer.Option("--prompts", min=1, help="Prompts to serve.")] = 4,
    prefix_len: Annotated[
        int, typer.Option(min=0, help="Length of the system prompts they share.")
    ] = 32,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate each.")] = 8,
    max_running: Annotated[
        int, typer.Option(min=1, help="Most requests the scheduler runs at once.")
    ] = 2,
    chunk_size: Annotated[
        int | None, typer.Option(min=1, help="Chunked prefill: prompt tokens per step.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the prompts and the model's weights.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    debug: DebugOption = False,
) -> None:
    """Generate for a few shared-prefix prompts; print the tokens and the cache statistics."""
    import kvplug
    from kvplug.engine.models import TinyModel
    from kvplug.engine.models.prompts import shared_prefix_prompts
    from kvplug.engine.models.serving import serve

    try:
        stack = kvplug.build(kvplug.load_config(config if config else DEFAULT_CONFIG))
        model = TinyModel.for_stack(stack, seed=seed)
    except (ConfigError, ValidationError, UnknownComponentError, ValueError) as exc:
        raise fail(exc, EXIT_BAD_CONFIG, debug) from None
    prompts = shared_prefix_prompts(
        num_prompts, prefix_len=prefix_len, vocab_size=model.config.vocab_size, seed=seed
    )
    result = serve(
        stack, model, prompts, max_new_tokens, max_running=max_running, chunk_size=chunk_size
    )
    names = {
        "allocator": stack.config.allocator.name,
        "prefix_cache": stack.config.prefix_cache.name,
        "eviction_policy": stack.config.eviction_policy.name,
    }
    if as_json:
        payload = {
            "config": names,
            "requests": [
                {"prompt_len": len(p), "cached_tokens": c, "output": o}
                for p, c, o in zip(prompts, result.cached, result.outputs)
            ],
            "prefill_saved": result.prefill_saved,
            "preemptions": result.scheduler.preemptions,
            "pool_bytes": stack.pool.mem_bytes(),
            "cache_stats": result.cache_stats,
            "tier_hit_tokens": result.scheduler.tier_hit_tokens,
            "storage": stack.storage.stats.as_dict() if stack.storage else None,
        }
        stack.close()
        out.print_json(json.dumps(payload))
        return
    out.print(
        f"{names['allocator']} / {names['prefix_cache']} / {names['eviction_policy']}: "
        f"pool {stack.pool.mem_bytes()} bytes on {stack.pool.device}",
        highlight=False,
    )
    table = Table("request", "prompt", "cached", "generated tokens")
    for i, (p, c, o) in enumerate(zip(prompts, result.cached, result.outputs)):
        table.add_row(str(i), str(len(p)), str(c), " ".join(map(str, o)))
    out.print(table)
    out.print(
        f"prefill tokens served from the cache: {result.cached_prompt_tokens} of "
        f"{result.prompt_tokens} ({result.prefill_saved:.1%})",
        highlight=False,
    )
    out.print(
        f"scheduler: {result.scheduler.steps} steps, {result.scheduler.preemptions} preemptions",
        highlight=False,
    )
    for name, value in result.cache_stats.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        out.print(f"  {name:28} {shown}", highlight=False)
    if stack.storage is not None:
        loaded = result.scheduler.tier_hit_tokens
        per_tier = ", ".join(f"{t.name} {loaded.get(t.name, 0)}" for t in stack.storage.tiers)
        storage = stack.storage.stats
        out.print(
            f"storage tiers: prompt tokens loaded per tier: {per_tier}; demoted pages "
            f"{storage.demoted_pages}, dropped {storage.dropped_pages}, "
            f"corrupt {storage.corrupt_pages}",
            highlight=False,
        )
    stack.close()
