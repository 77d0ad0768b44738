"""vLLM's own tests with a kvplug policy installed on every ``BlockPool``, test by test.

    .venv-vllm/bin/python scripts/vllm_own_tests.py VLLM_SOURCE [--policies lru,lru-queue,lru+]
        [TEST_FILE ...]

``VLLM_SOURCE`` is the unpacked source distribution of the installed vLLM release (its
``tests/`` folder; the sdist from PyPI, e.g. ``vllm-0.34.0.tar.gz``, unpacked anywhere outside
the repository). The test files default to vLLM's block-pool tests:
``tests/v1/core/test_prefix_caching.py``, ``test_kv_cache_utils.py`` and
``test_single_type_kv_cache_manager.py``. Each configuration runs them in a fresh pytest
process (vLLM's root conftest is skipped: ``--noconftest``; those files need none of it):
first stock, then with every ``BlockPool`` built by the tests given a kvplug policy right after
vLLM's ``__init__``. The script prints each configuration's counts and every test whose outcome
differs from the stock run, and exits 1 if any does. ``HF_HUB_OFFLINE=1`` is set: tests that
need a model from the Hub fail at once (stock too) instead of waiting on the network; ``-k``
leaves tests out.

Configurations: ``lru`` (kvplug's default for lru: vLLM's own list), ``lru-queue`` (the LRU
key ranked through kvplug's policy queue without chain protection: the machinery every other
policy uses, which must give vLLM's outcomes too), ``lru+`` (lru with chain protection), or any
policy name from the registry (with its default chain protection; a policy other than LRU
changes which block is evicted, so tests that assert vLLM's exact ids differ by design).

This module is also the pytest plugin (``-p vllm_own_tests``) that installs the policy.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ENV = "KVPLUG_OWN_TESTS_POLICY"
DEFAULT_TESTS = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
)
ROOT = Path(__file__).resolve().parent.parent


def make_policy(name: str) -> tuple[Any, bool | None]:
    """The policy object and chain protection for a configuration name."""
    from kvplug import get_registry
    from kvplug.policies.builtin import LRUPolicy

    if name == "lru-queue":

        class QueueLRU(LRUPolicy):
            """LRU ranked by kvplug's policy queue (a subclass is not taken for vLLM's order)."""

        return QueueLRU(), False
    if name == "lru+":
        return LRUPolicy(), True
    registration = get_registry().get("eviction_policy", name)
    return registration.factory(registration.options_model()), None


def pytest_configure(config: Any) -> None:
    """Install the policy named by ``KVPLUG_OWN_TESTS_POLICY`` on every new ``BlockPool``."""
    name = os.environ.get(ENV)
    if not name:
        return
    from vllm.v1.core.block_pool import BlockPool

    from kvplug.integrations.vllm.block_pool import install_policy

    original = BlockPool.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        policy, protection = make_policy(name)
        install_policy(self, policy, chain_protection=protection)

    BlockPool.__init__ = __init__  # type: ignore[method-assign]


def outcomes(
    source: Path, tests: list[str], policy: str | None, keyword: str | None = None
) -> dict[str, str]:
    """Each test's outcome (passed, failed, error, skipped) in one pytest run."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        env = dict(os.environ)
        env.pop(ENV, None)
        env.setdefault("HF_HUB_OFFLINE", "1")  # a test that wants a model fails, never waits
        if policy is not None:
            env[ENV] = policy
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "scripts"), str(ROOT), str(source), env.get("PYTHONPATH", "")]
        )
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += ["--noconftest", "-p", "vllm_own_tests", f"--junitxml={report}", *tests]
        if keyword:
            command += ["-k", keyword]
        subprocess.run(
            command,
            cwd=source,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
            timeout=1800,
        )
        if not report.exists():
            raise SystemExit(f"pytest wrote no report for {policy or 'stock'}")
        found = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed"}.get(child.tag, child.tag)
            found[f"{case.get('classname')}::{case.get('name')}"] = outcome
        return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="an unpacked vLLM source distribution")
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS))
    parser.add_argument("--policies", default="lru,lru-queue,lru+")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (to leave tests out)")
    args = parser.parse_args()
    import vllm

    stock = outcomes(args.source, args.tests, None, args.keyword)
    counts = {o: list(stock.values()).count(o) for o in sorted(set(stock.values()))}
    print(f"vllm {vllm.__version__}, {len(stock)} tests; stock: {counts}")
    differ = False
    for policy in args.policies.split(","):
        got = outcomes(args.source, args.tests, policy, args.keyword)
        diff = sorted(t for t in stock.keys() | got.keys() if stock.get(t) != got.get(t))
        counts = {o: list(got.values()).count(o) for o in sorted(set(got.values()))}
        print(f"{policy}: {counts}; {len(diff)} outcomes differ from stock")
        for test in diff:
            print(f"    {test}: stock {stock.get(test)}, {policy} {got.get(test)}")
        differ = differ or bool(diff)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
