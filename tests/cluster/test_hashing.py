"""block_hash = "vllm": the hasher's rules written out (vLLM's own functions are compared in
tests/integration/vllm), and every cache hashing with the config's hasher."""

from __future__ import annotations

import hashlib
import pickle

import pytest
from pydantic import ValidationError

import kvplug
from kvplug.caches.block_hashing import (
    BlockHasher,
    VLLMBlockHasher,
    make_hasher,
    vllm_extra_key,
)
from kvplug_hookspecs import BlockHashConfig, CacheKey, KVCacheConfig
from tests.cache_helpers import RecordingEvents


def vllm_sha256(obj) -> bytes:
    """vLLM's ``sha256``: SHA-256 of the object pickled at the highest protocol."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def test_vllm_chain_rule():
    hasher = VLLMBlockHasher("sha256")
    none = vllm_sha256("vllm-none-hash")
    assert hasher.none_hash == none == hasher.root(None) == hasher.root("any namespace")
    a = vllm_sha256((none, (1, 2), None))
    b = vllm_sha256((a, (3, 4), None))
    assert list(hasher.chain(none, [1, 2, 3, 4, 5], 2, 2)) == [a, b]
    assert hasher.event_hash(b) == int.from_bytes(b, "big") & (2**64 - 1)  # the low 64 bits
    assert hasher.name == f"vllm-sha256-{none[:8].hex()}"


def test_namespaces_become_vllms_extra_keys():
    hasher = VLLMBlockHasher("sha256")
    none = hasher.none_hash
    lora = vllm_extra_key(lora_name="a", lora_path="/p", cache_salt="s")
    k = (("lora", "a", "/p"),)
    p0 = vllm_sha256((none, (1,), (*k, ("cache_salt", "s"))))  # the salt only on page 0
    p1 = vllm_sha256((p0, (2,), k))  # LoRA on every page
    assert list(hasher.chain(none, [1, 2], 1, 2, lora)) == [p0, p1]
    plain = vllm_sha256((none, (1,), (("cache_salt", "tenant"),)))
    assert list(hasher.chain(none, [1], 1, 1, "tenant")) == [plain]
    assert vllm_extra_key() is None


def test_seed_from_pythonhashseed_and_option(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert VLLMBlockHasher("sha256").none_hash == vllm_sha256("42")
    assert VLLMBlockHasher("sha256", none_hash_seed="7").none_hash == vllm_sha256("7")


def test_xxhash_without_a_seed_is_refused():
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        VLLMBlockHasher("xxhash")


def test_config_model():
    assert KVCacheConfig(block_hash="vllm").block_hash == BlockHashConfig(scheme="vllm")
    for bad, message in (
        ({"scheme": "kvplug", "algorithm": "sha256_cbor"}, "use scheme='vllm'"),
        ({"scheme": "vllm", "algorithm": "blake2b"}, "no 'blake2b'"),
        ({"none_hash_seed": "1"}, "none_hash_seed"),
        ({"scheme": "md5"}, "scheme"),
    ):
        with pytest.raises(ValidationError, match=message):
            BlockHashConfig(**bad)
    assert make_hasher(None).name == "kvplug-sha256"
    assert make_hasher(BlockHashConfig(algorithm="blake2b")).name == "kvplug-blake2b"
    assert isinstance(make_hasher(BlockHashConfig(scheme="vllm")), VLLMBlockHasher)


@pytest.mark.parametrize("cache", ["radix", "block_hash", "swa_radix"])
def test_every_cache_hashes_with_the_configs_hasher(cache):
    """The same prompt published by each cache: vLLM's chain of its pages, and lookups too."""
    events = RecordingEvents()
    registry = kvplug.PluginRegistry().load_plugins()
    registry.register(_Forward(events), name="recorder")
    config = {
        "pool": {"capacity_tokens": 64, "page_size": 4, "device": "cpu"},
        "allocator": "paged",
        "prefix_cache": cache,
        "block_hash": {"scheme": "vllm", "algorithm": "sha256"},
    }
    if cache == "swa_radix":
        config["allocator"] = {
            "name": "swa",
            "options": {"swa_capacity_tokens": 32, "sliding_window_size": 4},
        }
    stack = kvplug.build(config, registry=registry)
    hasher = stack.prefix_cache.block_hasher
    assert isinstance(hasher, VLLMBlockHasher)
    key = list(range(10, 22))
    ns = vllm_extra_key(cache_salt="s")
    stack.prefix_cache.insert(CacheKey(key, ns), stack.allocator.alloc(12))
    want = [hasher.event_hash(d) for d in hasher.chain(hasher.none_hash, key, 4, 3, ns)]
    assert list(events.stored[0].block_hashes) == want
    assert stack.prefix_cache.match_prefix(CacheKey(key, ns)).prefix_len == 12
    assert stack.prefix_cache.match_prefix(CacheKey(key, None)).prefix_len == 0


def test_default_stays_kvplugs():
    stack = kvplug.build({"pool": {"capacity_tokens": 16, "device": "cpu"}})
    assert type(stack.prefix_cache.block_hasher) is BlockHasher
    assert stack.prefix_cache.block_hasher.name == "kvplug-sha256"


class _Forward:
    def __init__(self, events):
        self.events = events

    @kvplug.hookimpl
    def kvplug_prefix_stored(self, event):
        self.events.prefix_stored(event)
