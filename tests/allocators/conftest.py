"""The allocator unit tests run twice on the CPU: on the NumPy path a CPU device uses, and on
the torch path every other device uses, so both are held to the same expected results (the
hypothesis state machines, unittest classes, run on the default path)."""

from __future__ import annotations

import pytest

from kvplug.allocators import BaseAllocator


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "check_path" in metafunc.fixturenames:
        metafunc.parametrize("check_path", ["host", "device"], indirect=True)


@pytest.fixture(autouse=True)
def check_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    path = str(getattr(request, "param", "host"))
    monkeypatch.setattr(BaseAllocator, "prefer_host_path", path == "host")
    return path
