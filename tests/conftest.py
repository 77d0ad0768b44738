"""Shared fixtures: fake installed distributions for the entry-point tests, the shared trace."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import settings

from kvplug.registry import reset_registry

# CI (``CI`` set, as ``.ci/run`` and hosted runners do) replays the same examples every run, so
# a gate passes or fails on the code alone; anywhere else each run explores new random ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

_TRACE = Path("shared", "traces", "mooncake_conversation_trace.jsonl")
MOONCAKE_TRACE = next(
    (folder / _TRACE for folder in Path(__file__).resolve().parents if (folder / _TRACE).exists()),
    Path("..", _TRACE),
)
"""The real Mooncake trace in ``../shared/traces`` beside the clone (never copied into it)."""


@pytest.fixture(autouse=True)
def _fresh_process_registry():
    """No test sees another test's process-wide registry."""
    reset_registry()
    yield
    reset_registry()


def write_distribution(
    root: Path, dist: str, version: str, entry_points: dict[str, str], modules: dict[str, str]
) -> Path:
    """Write an installed-looking distribution (dist-info + modules) under ``root``.

    ``importlib.metadata`` finds it once ``root`` is on ``sys.path``: the same path a pip-installed
    plugin takes, without running pip in the test.
    """
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[kvplug]", *(f"{name} = {target}" for name, target in entry_points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


BROKEN_IMPORT = "raise RuntimeError('this plugin is broken on purpose')\n"

RAISING_HOOK = """
from kvplug_hookspecs import hookimpl

@hookimpl
def kvplug_eviction_policies():
    raise ValueError('registration exploded')
"""

MISSPELT_HOOK = """
from kvplug_hookspecs import hookimpl

@hookimpl
def kvplug_eviction_policy():
    return []
"""

EXTRA_POLICY = """
from kvplug_hookspecs import EvictionPolicyRegistration, KeyedEvictionPolicy, hookimpl

class Newest(KeyedEvictionPolicy):
    touch_changes_key = False
    def key(self, c):
        return -c.creation_time

@hookimpl
def kvplug_eviction_policies():
    yield EvictionPolicyRegistration(name="newest_first", factory=Newest, description="test")
"""


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """A site directory with a working, a broken and an extra plugin distribution, on sys.path."""
    write_distribution(
        tmp_path,
        "kvplug-broken",
        "0.0.1",
        {"broken": "kvplug_broken_mod"},
        {"kvplug_broken_mod": BROKEN_IMPORT},
    )
    write_distribution(
        tmp_path,
        "kvplug-extra",
        "2.0",
        {"extra": "kvplug_extra_mod"},
        {"kvplug_extra_mod": EXTRA_POLICY},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name in ("kvplug_broken_mod", "kvplug_extra_mod"):
        sys.modules.pop(name, None)
