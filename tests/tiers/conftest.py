"""Fixtures of the storage-tier tests: a real ``redis-server`` process, tier contexts, stacks.

``redis_server`` starts the Debian ``redis-server`` binary (7.0 on these machines; a
``valkey-server`` works too) on a free loopback port with a temporary directory and no
persistence, waits until it answers ``PING`` and stops it afterwards. No mock stands in for it: a
machine without the binary skips those tests with the command that installs it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

INSTALL_HINT = "install redis-server: apt-get install redis-server"
REDIS_BINARY = shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ping(port: int, timeout: float = 0.2) -> bool:
    """Whether a server on ``port`` answers ``PING`` (raw RESP, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One real ``redis-server`` process on a fixed port; ``kill()`` (SIGKILL) and ``start()``
    again on the same port, as an operator's restart would."""

    def __init__(self, directory: Path) -> None:
        assert REDIS_BINARY is not None
        self.binary = REDIS_BINARY
        self.port = free_port()
        self.dir = directory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.dir),
                "--enable-debug-command", "local",  # DEBUG SLEEP: a slow server
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the server dies mid-run, as a crash would (its data is gone: no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh real Redis server for one test (skipped, with the install command, without one)."""
    if REDIS_BINARY is None:
        pytest.skip(INSTALL_HINT)
    pytest.importorskip("redis", reason="pip install 'kvplug[redis]'")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
