"""Real faults for the tier tests: a read-only directory, a full disk, a process that dies while
writing. No mock: the directory, the file system and the process are real."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

NOBODY = 65534


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` (a directory) cannot be written while inside: mode 0555, and as root (whom
    modes don't stop) the process's effective uid and gid are ``nobody``
    meanwhile (every thread's)."""
    mode = path.stat().st_mode
    path.chmod(0o555)
    root = os.geteuid() == 0
    if root:
        for up in [path, *path.parents]:  # nobody must reach the directory to read its pages
            if up.stat().st_mode & 0o005 != 0o005:
                up.chmod(up.stat().st_mode | 0o005)
        for file in path.iterdir():  # ... and read them (the umask may have hidden them)
            file.chmod(file.stat().st_mode | 0o004)
        os.setegid(NOBODY)
        os.seteuid(NOBODY)
    try:
        yield
    finally:
        if root:
            os.seteuid(0)
            os.setegid(0)
        path.chmod(mode)


@contextlib.contextmanager
def disk_full(max_file_bytes: int) -> Iterator[None]:
    """A file system that takes no file beyond ``max_file_bytes``: writes past it fail with
    ``EFBIG`` (``RLIMIT_FSIZE``; ``SIGXFSZ`` ignored, so the write raises instead of killing)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
