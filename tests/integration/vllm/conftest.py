"""Helpers that drive vLLM's own KVCacheManager and Scheduler on CPU, without a model.

A scheduler is built over a folder holding only a tiny ``config.json`` (no weights, no
tokenizer: ``skip_tokenizer_init=True``, ``HF_HUB_OFFLINE=1``); the "model" is a function that
returns one sampled token per request whose prefill is complete. Test modules call
``pytest.importorskip("vllm")`` first, so the default test run (no vLLM) skips them quickly.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is not None:  # no model download; quiet vLLM
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(folder)


@pytest.fixture(autouse=True)
def _no_env_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with kvplug unselected through the environment."""
    monkeypatch.delenv("KVPLUG_VLLM", raising=False)


class Engine:
    """vLLM's Scheduler plus a fake model runner: schedule(), then update_from_output()."""

    def __init__(self, scheduler: Any, block_size: int) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        init_none_hash(sha256)
        self.scheduler = scheduler
        self.block_size = block_size
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.steps = 0
        self.cached_tokens: dict[str, int] = {}
        """Prompt tokens each request found in the prefix cache, as vLLM reports them."""

    @property
    def pool(self) -> Any:
        return self.scheduler.kv_cache_manager.block_pool

    def request(self, request_id: str, prompt: list[int], max_tokens: int = 2) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Request(request_id, prompt, params, None, block_hasher=self.hasher)

    def step(self) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self.scheduler.requests[req_id]
            done_prefill = req.num_computed_tokens >= req.num_tokens
            sampled.append([7] if done_prefill else [])
        kw: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
        if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
            kw["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}  # vLLM 0.33
        outputs = self.scheduler.update_from_output(out, ModelRunnerOutput(**kw))
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.prefill_stats is not None:
                    self.cached_tokens[output.request_id] = (
                        output.prefill_stats.num_local_cached_tokens
                    )
        self.steps += 1
        return out

    def serve(self, *requests: Any, max_steps: int = 1000) -> list[Any]:
        """Add the requests and step until every one has finished; returns them."""
        for req in requests:
            self.scheduler.add_request(req)
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return list(requests)
            self.step()
        raise AssertionError("requests did not finish")


def make_engine(
    model_dir: str,
    *,
    num_blocks: int = 32,
    block_size: int = 16,
    additional_config: dict[str, Any] | None = None,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 8,
    async_scheduling: bool = False,
) -> Engine:
    """A real vLLM Scheduler (full attention, prefix caching on) over ``num_blocks`` blocks;
    ``async_scheduling`` picks vLLM's AsyncScheduler (the engine's default) instead."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        device_config=DeviceConfig(device="cpu"),
        additional_config=additional_config or {},
    )
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    scheduler_cls = Scheduler
    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        scheduler_cls = AsyncScheduler
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )
    return Engine(scheduler, block_size)


def make_manager(
    num_blocks: int,
    block_size: int = 16,
    sliding_window_blocks: int | None = None,
    enable_kv_cache_events: bool = False,
) -> Any:
    """vLLM's KVCacheManager: one full-attention group, plus two sliding-window groups when
    ``sliding_window_blocks`` is given (a hybrid model)."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    kw: dict[str, Any] = {"num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=block_size, **kw))]
    if sliding_window_blocks is not None:
        window = SlidingWindowSpec(
            block_size=block_size, sliding_window=sliding_window_blocks * block_size, **kw
        )
        groups += [KVCacheGroupSpec(["swa1"], window), KVCacheGroupSpec(["swa2"], window)]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(
        config,
        max_model_len=8192,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=True,
        enable_kv_cache_events=enable_kv_cache_events,
    )


def make_request(request_id: str, prompt: list[int], block_size: int = 16) -> Any:
    """A vLLM Request with sha256 block hashes (as vLLM's own prefix-caching tests use)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=17)
    return Request(
        request_id, prompt, params, None, block_hasher=get_request_block_hasher(block_size, sha256)
    )


def admit(manager: Any, request: Any) -> Any:
    """Prefix-match and allocate a whole prompt as the scheduler does (None: it does not fit)."""
    computed, num_computed, *_ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(
        request, request.num_tokens - num_computed, num_computed, computed
    )
    if blocks is None:
        return None
    return computed.get_block_ids(), blocks.get_block_ids()


def free_ids(manager: Any) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def check_pool(manager: Any) -> None:
    """vLLM's counts and list are exact and the policy holds exactly the free cached leaves."""
    pool = manager.block_pool
    queue = pool.free_block_queue
    listed = free_ids(manager)
    assert len(listed) == len(set(listed)) == queue.num_free_blocks == pool.get_num_free_blocks()
    free = {b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null}
    assert set(listed) == free
    from kvplug.integrations.vllm.block_pool import PolicyFreeBlockQueue

    if isinstance(queue, PolicyFreeBlockQueue):
        rank = queue.rank
        in_policy = {block_id for block_id in range(len(pool.blocks)) if block_id in rank}
        assert in_policy <= free
        assert all(queue.is_leaf(b) for b in in_policy)
        assert len(rank) == len(in_policy)
