"""``kvplug serve-example``: real generation through a config's pool, equal to a recompute."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvplug
from kvplug.cli import app
from kvplug.cli.serve_example import DEFAULT_CONFIG
from kvplug.engine.models import TinyModel, reference_generate
from kvplug.engine.models.prompts import shared_prefix_prompts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.fixture
def invoke(monkeypatch):
    for var in [v for v in os.environ if v.startswith("KVPLUG_")]:
        monkeypatch.delenv(var)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args))


def test_json_output_is_the_recomputed_generation(invoke) -> None:
    result = invoke("serve-example", "--prompts", "4", "--max-new-tokens", "3", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["config"] == {
        "allocator": "standard",
        "prefix_cache": "radix",
        "eviction_policy": "lru",
    }
    # two system prompts of 32 tokens: the third and fourth requests find theirs cached
    assert [r["cached_tokens"] for r in payload["requests"]] == [0, 0, 32, 32]
    assert payload["prefill_saved"] == pytest.approx(
        64 / sum(r["prompt_len"] for r in payload["requests"])
    )
    # 1024 slots + the padding slot, 2 layers, K and V, 2 kv heads x 16 dims, float32
    assert payload["pool_bytes"] == (1024 + 1) * 2 * 2 * 2 * 16 * 4
    model = TinyModel.for_stack(kvplug.build(DEFAULT_CONFIG))
    for request, prompt in zip(payload["requests"], shared_prefix_prompts(4)):
        assert request["prompt_len"] == len(prompt)
        assert request["output"] == reference_generate(model, prompt, 3)[0]


def test_table_output_on_a_bundled_config(invoke) -> None:
    result = invoke("serve-example", "-c", str(EXAMPLES / "paged_block_hash.toml"))
    assert result.exit_code == 0, result.output
    assert "paged / block_hash / slru" in result.output
    assert "prefill tokens served from the cache" in result.output


def test_a_bad_config_exits_2(invoke, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('prefix_cache = "nope"\n')
    result = invoke("serve-example", "-c", str(bad))
    assert result.exit_code == 2
    assert "unknown prefix cache 'nope'" in result.output


def test_the_bundled_tiers_config_generates_what_a_recompute_does(invoke, tmp_path: Path) -> None:
    """``examples/configs/tiers.toml`` (host + disk below a 64-token device, the step handoff):
    every output equals the dense recompute, the device alone cannot hold the working set, and
    what the worker stored came back from the tiers."""
    import tomllib

    config = tomllib.loads((EXAMPLES / "tiers.toml").read_text())
    assert config["storage"]["handoff"] == "step"
    config["storage"]["tiers"][1]["options"]["path"] = str(tmp_path / "disk")
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(config))
    result = invoke("serve-example", "-c", str(path), "--prompts", "12", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    model = TinyModel.for_stack(kvplug.build(config))
    for request, prompt in zip(payload["requests"], shared_prefix_prompts(12), strict=True):
        assert request["output"] == reference_generate(model, prompt, 8)[0]
    storage = payload["storage"]
    assert storage["demoted_pages"] > 0 and storage["corrupt_pages"] == 0
    assert storage["dropped_pages"] == 0
    assert sum(storage["hit_tokens"].values()) == sum(payload["tier_hit_tokens"].values()) > 0
