"""Drive SGLang's own cache, allocator, Req and ScheduleBatch objects on CPU, without a model.

:class:`Engine` repeats the cache-facing steps of SGLang's scheduler loop with SGLang's own code:
``Req.init_next_round_input`` (the prefix match), ``PrefillAdder`` (admission, locks, chunking),
``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode`` (allocation and eviction),
``checkpoint_kv_cache`` / ``release_kv_cache`` (insert, free, unlock), ``retract_decode`` and
the scheduler's flush order. The "model" samples a deterministic token per request.

SGLang imports a few GPU-only modules at load time (``sgl_kernel``, ``tvm_ffi``, ...): they are
stubbed here, only when SGLang is installed. Test modules call ``pytest.importorskip`` first, so
the default test run (no SGLang) skips them quickly.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from array import array
from typing import Any

import pytest

_GPU_ONLY = ("sgl_kernel", "tvm_ffi", "torchvision", "sentencepiece", "compressed_tensors", "gguf")


class _Stub(types.ModuleType):
    """A GPU-only module SGLang imports but never calls on the CPU paths under test."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")


class _Anything:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator
            return args[0]
        return _Anything(self._name + "()")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in _GPU_ONLY:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Stub(spec.name)
        module.__path__ = []
        module.__version__ = "0.0"  # transformers reads it, then treats the stub as absent
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _install_stubs() -> None:
    missing = [m for m in _GPU_ONLY if importlib.util.find_spec(m) is None]
    if missing:
        finder = _StubFinder()
        finder.find_spec = (  # type: ignore[method-assign]
            lambda fullname, path, target=None, _m=tuple(missing): (
                importlib.machinery.ModuleSpec(fullname, finder, is_package=True)
                if fullname.split(".")[0] in _m
                else None
            )
        )
        sys.meta_path.insert(0, finder)


HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
if HAVE_SGLANG:
    _install_stubs()


def parse_server_args(*flags: str) -> Any:
    """SGLang's own argument parser, after SGLang's plugin loader ran (as launch_server does)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "unused", "--device", "cpu", *flags])
    server_args = ServerArgs.from_cli_args(args)
    get_context().set_server_args(server_args)
    return server_args


def build_context(server_args: Any, capacity: int, **overrides: Any) -> Any:
    """SGLang's TreeCacheBuildContext over SGLang's own KV pool, allocator and request pool."""
    import torch
    from sglang.srt.mem_cache.allocator import (
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    page = server_args.page_size or 1
    kv = MHATokenToKVPool(capacity, page, torch.float16, 1, 4, 1, "cpu", False)
    if page == 1:
        allocator: Any = TokenToKVPoolAllocator(capacity, torch.float16, "cpu", kv, False)
    else:
        allocator = PagedTokenToKVPoolAllocator(capacity, page, torch.float16, "cpu", kv, False)
    req_pool = ReqToTokenPool(16, 1024, "cpu", False)
    fields = {
        "disable": False,
        "req_to_token_pool": req_pool,
        "token_to_kv_pool_allocator": allocator,
        "page_size": page,
        "eviction_policy": server_args.radix_eviction_policy,
        "eviction_policy_config": server_args.radix_eviction_policy_config,
    }
    fields.update({k: v for k, v in overrides.items() if k in CacheInitParams.__dataclass_fields__})
    params = CacheInitParams(**fields)
    flags = {k: v for k, v in overrides.items() if k not in CacheInitParams.__dataclass_fields__}
    context = {
        "server_args": server_args,
        "params": params,
        "is_hybrid_swa": False,
        "is_hybrid_ssm": False,
        "enable_hierarchical_cache": False,
        "disable_radix_cache": False,
        "tp_worker": None,
        "model_config": None,
        "tp_size": 1,
        "tp_rank": 0,
        "tp_group": None,
    }
    context.update(flags)
    return TreeCacheBuildContext(**context)


class Engine:
    """SGLang's scheduler steps over SGLang's objects, with kvplug (or SGLang's tree) as cache."""

    def __init__(
        self,
        *,
        page_size: int = 1,
        capacity: int = 256,
        policy: str = "kvplug_lru",
        policy_config: str | None = None,
        backend: str | None = "kvplug",
        chunk: int | None = None,
        new_token_ratio: float = 0.5,
        kv_events: bool = False,
        disable: bool = False,
    ) -> None:
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.mem_cache.registry import create_tree_cache
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        flags = ["--page-size", str(page_size), "--radix-eviction-policy", policy]
        if backend:
            flags += ["--radix-cache-backend", backend]
        if policy_config:
            flags += ["--radix-eviction-policy-config", policy_config]
        if disable:
            flags += ["--disable-radix-cache"]
        self.server_args = parse_server_args(*flags)
        ctx = build_context(
            self.server_args,
            capacity,
            enable_kv_cache_events=kv_events,
            disable=disable,  # what SGLang's kv_cache_builder passes for --disable-radix-cache
            disable_radix_cache=disable,
        )
        self.page_size = page_size
        self.capacity = capacity
        self.chunk = chunk
        self.new_token_ratio = new_token_ratio  # SGLang's admission estimate of future decode
        self.allocator = ctx.params.token_to_kv_pool_allocator
        self.req_pool = ctx.params.req_to_token_pool
        self.tree = create_tree_cache(ctx)
        self.model_config = types.SimpleNamespace(
            vocab_size=1000, is_encoder_decoder=False, context_len=1024, is_multimodal=False
        )
        self.spec = SpeculativeAlgorithm.NONE
        self.running = ScheduleBatch.init_new(
            [], self.req_pool, self.allocator, self.tree, self.model_config, False, self.spec
        )
        self.waiting: list[Any] = []
        self.chunked_req: Any = None
        self.finished: list[Any] = []
        self.retracted: list[Any] = []

    # -- requests -------------------------------------------------------------------------------

    def add(self, rid: str, prompt: list[int], max_new_tokens: int = 2, **kw: Any) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
        params.normalize(None)
        req = Req(rid, "", array("q", prompt), params, vocab_size=1000, **kw)
        self.waiting.append(req)
        return req

    @staticmethod
    def sample(req: Any) -> int:
        return (len(req.origin_input_ids) * 7 + len(req.output_ids) * 13 + 5) % 997 + 1

    # -- scheduling steps -----------------------------------------------------------------------

    def prefill(self) -> list[Any]:
        """One prefill round: match, admit, allocate, 'forward', insert or finish."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        if self.chunked_req is not None:
            checkpoint_kv_cache(self.chunked_req, self.tree)  # SGLang's stash_chunked_request
        adder = PrefillAdder(
            self.page_size,
            self.tree,
            self.allocator,
            self.running,
            self.new_token_ratio,
            4096,
            self.chunk,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in list(self.waiting):
            if len(adder.can_run_list) >= self.req_pool.available_size():
                break  # the scheduler admits no more requests than it has request rows
            req.init_next_round_input(self.tree)
            result = adder.add_one_req(
                req, has_chunked_req=self.chunked_req is not None, truncation_align_size=None
            )
            if result != AddReqResult.CONTINUE:
                break
        can_run = list(adder.can_run_list)
        if not can_run:
            return []
        self.waiting = [r for r in self.waiting if r not in can_run]
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = ScheduleBatch.init_new(
            can_run,
            self.req_pool,
            self.allocator,
            self.tree,
            self.model_config,
            False,
            self.spec,
            chunked_req=self.chunked_req,
        )
        batch.prepare_for_extend()
        self._after_prefill(batch)
        return can_run

    def _after_prefill(self, batch: Any) -> None:
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:  # a middle chunk: the next round continues it
                req.inflight_middle_chunks -= 1
                continue
            req.output_ids.append(self.sample(req))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.tree, checkpoint=True)
                self.finished.append(req)
            else:
                checkpoint_kv_cache(req, self.tree)
        chunked = self.chunked_req
        if (
            chunked is not None
            and chunked.inflight_middle_chunks == 0
            and chunked.extend_end >= len(chunked.origin_input_ids)
        ):
            self.chunked_req = None
        batch.filter_batch(reqs_to_exclude=self.chunked_req)
        if not batch.is_empty():
            if self.running.is_empty():
                self.running = batch
            else:
                self.running.merge_batch(batch)

    def decode(self) -> None:
        """One decode step of the running batch (retracting when memory runs short)."""
        from sglang.srt.mem_cache.common import release_kv_cache

        running = self.running
        running.filter_batch()
        if running.is_empty():
            return
        if not running.check_decode_mem():
            self.retract()
            if running.is_empty():
                return
        running.prepare_for_decode()
        for req in running.reqs:
            req.output_ids.append(self.sample(req))
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.tree, checkpoint=True)
                self.finished.append(req)
        running.filter_batch()

    def retract(self) -> list[Any]:
        """SGLang's ``retract_decode``: free the retracted rows and requeue the requests."""
        retracted, _, aborted = self.running.retract_decode()
        assert not aborted
        for req in retracted:
            self.retracted.append(req)
            self.waiting.insert(0, req)
        return list(retracted)

    def run(self, max_steps: int = 200, check: bool = True) -> None:
        """Prefill and decode until every request finished, checking the invariant each step."""
        for _ in range(max_steps):
            if not (self.waiting or self.chunked_req or not self.running.is_empty()):
                return
            self.prefill()
            if check:
                self.check_invariant()
            self.decode()
            if check:
                self.check_invariant()
        raise AssertionError("requests did not finish")

    def abort(self, req: Any) -> None:
        """Abort a running request as SGLang does: free its row without caching it."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT
        from sglang.srt.mem_cache.common import release_kv_cache

        req.to_finish = FINISH_ABORT("aborted by the test")
        req.update_finish_state(0)
        release_kv_cache(req, self.tree, checkpoint=False)
        self.running.filter_batch()

    def flush(self) -> None:
        """SGLang's ``flush_cache`` order: tree reset, then both pools cleared."""
        assert self.running.is_empty() and not self.waiting and self.chunked_req is None
        self.tree.reset()
        self.req_pool.clear()
        self.allocator.clear()

    # -- checks ---------------------------------------------------------------------------------

    def owners(self) -> list[Any]:
        reqs = list(self.running.reqs)
        if self.chunked_req is not None and self.chunked_req not in reqs:
            reqs.append(self.chunked_req)
        return [r for r in reqs if r.kv.holds_kv]

    def check_invariant(self) -> None:
        """SGLang's own full-pool conservation check (the scheduler's busy self-check)."""
        from sglang.srt.managers.scheduler_components.invariant_checker import (
            SchedulerInvariantChecker,
        )
        from sglang.srt.managers.scheduler_components.pool_stats_observer import (
            kv_private_tokens,
        )

        uncached = sum(kv_private_tokens(r.kv, self.page_size) for r in self.owners())
        leak, msg = SchedulerInvariantChecker._check_pool_invariant(
            "full",
            self.allocator.available_size(),
            self.tree.full_evictable_size(),
            self.tree.protected_size(),
            0,
            self.capacity,
            uncached,
        )
        assert not leak, msg

    def check_idle(self) -> None:
        """Idle: nothing protected, and every slot is free or cached, exactly once."""
        import torch

        assert self.tree.protected_size() == 0
        free = self.allocator.get_all_free_pages()
        cached = self.tree.all_values_flatten()
        if self.page_size > 1:
            free = free * self.page_size  # page ids -> first slot of each page
            cached = torch.unique(cached // self.page_size) * self.page_size
        every = torch.sort(torch.cat([free, cached]).cpu())[0]
        first = 1 if self.page_size == 1 else self.page_size
        expected = torch.arange(first, self.capacity + first, self.page_size)
        assert torch.equal(every, expected), "free + cached slots are not the whole pool"


@pytest.fixture(autouse=True)
def _no_env_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with the default kvplug cache (radix) unless it sets KVPLUG_SGLANG."""
    monkeypatch.delenv("KVPLUG_SGLANG", raising=False)
