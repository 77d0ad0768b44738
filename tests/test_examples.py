"""The quickstart example runs on every bundled config and keeps its accounting exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "examples" / "configs").iterdir())


@pytest.mark.parametrize("config", [None, *CONFIGS], ids=lambda c: c.name if c else "default")
def test_quickstart_serves_requests_and_evicts_exactly_the_shortfall(config):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUG_")}
    env.update(KVPLUG_POOL_CAPACITY_TOKENS="8192", KVPLUG_POOL_DEVICE="cpu")
    args = [sys.executable, str(ROOT / "examples" / "quickstart.py")] + (
        [str(config)] if config else []
    )
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    lines = dict(
        line.split(None, 1) for line in result.stdout.splitlines() if line.startswith("  ")
    )
    assert lines["match_queries"] == "200"
    assert lines["shortfall_requested_tokens"] == lines["shortfall_freed_tokens"]
    assert int(lines["evicted_tokens"]) > 0
    words = result.stdout.splitlines()[3].split()  # "free F + cached C = capacity"
    assert words[0] == "free" and int(words[1]) + int(words[4]) == int(words[6]) == 8192
