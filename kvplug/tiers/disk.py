"""``disk``: KV pages as files in a directory, bounded in bytes, kept across restarts.

Each page is one file ``<path>/<namespace id>/<key hex>.kvpg`` in the byte form of
:mod:`kvplug.tiers.pages` (header, tokens, KV, CRC-32C). A write goes to a temporary file in the
same directory and is renamed into place (``os.replace`` is atomic on POSIX), so a crash never
leaves a half-written page under a page's name, and a page is visible only once written. A
process started later on the same directory finds the pages the previous one wrote (warm
restart: the index is rebuilt from the directory, oldest modification first). Past
``capacity_bytes`` the least recently used pages are deleted (a prefix's tail first: a hit
touches its pages head last). A file that fails to decode or its checks is deleted and counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from kvplug_hookspecs import FrozenModel, PageData, TierContext, TierStats

from .pages import CorruptPageError, decode_page, encode_page

__all__ = ["DiskTier", "DiskTierOptions"]

log = logging.getLogger(__name__)

_SUFFIX = ".kvpg"


class DiskTierOptions(FrozenModel):
    """Options of the ``disk`` tier.

    ``path``: the directory (created when missing; one subdirectory per namespace).
    ``capacity_bytes``: the bound on the page files' total size. ``fsync``: flush each page to
    the device before it becomes visible (survives a power loss, not only a process crash; slower).
    ``latency_s`` / ``bandwidth_bytes_per_s``: an NVMe drive's, for the cost model.
    """

    path: str
    capacity_bytes: int = Field(default=16 << 30, gt=0, strict=True)
    fsync: bool = False
    latency_s: float = Field(default=100e-6, ge=0)
    bandwidth_bytes_per_s: float = Field(default=3e9, gt=0)


class DiskTier:
    """Page files in one directory; the index (key -> file size) is in memory, LRU ordered."""

    name = "disk"
    medium = "Disk"

    def __init__(self, context: TierContext, options: DiskTierOptions) -> None:
        self.latency_s = options.latency_s
        self.bandwidth_bytes_per_s = options.bandwidth_bytes_per_s
        self.capacity_bytes = options.capacity_bytes
        self._fsync = options.fsync
        self._namespace = context.namespace.id
        self._dir = Path(options.path) / self._namespace
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._tokens_per_page = context.page_size
        self._stored = [0, 0]  # pages, bytes
        self._loaded = [0, 0]
        self._evicted = self._corrupt = 0
        self._scan()

    def _scan(self) -> None:
        """Rebuild the index from the directory: the pages an earlier process left."""
        found = []
        for entry in os.scandir(self._dir):
            if entry.name.endswith(_SUFFIX):
                try:
                    key = bytes.fromhex(entry.name[: -len(_SUFFIX)])
                    stat = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((stat.st_mtime_ns, key, stat.st_size))
            elif entry.name.startswith(".tmp-"):  # a write a crash interrupted
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        if found:
            log.info("disk tier %s: %d pages from an earlier run", self._dir, len(found))

    def _file(self, key: bytes) -> Path:
        return self._dir / (key.hex() + _SUFFIX)

    def contains(self, keys: Sequence[bytes]) -> int:
        count = 0
        with self._lock:
            for key in keys:
                if key not in self._index:
                    break
                count += 1
        return count

    def get(self, keys: Sequence[bytes]) -> list[PageData | None]:
        out: list[PageData | None] = []
        for key in keys:
            with self._lock:
                present = key in self._index
            if not present:
                out.append(None)
                continue
            try:
                data = self._file(key).read_bytes()
                page = decode_page(self._namespace, data)
            except FileNotFoundError:
                with self._lock:
                    self._forget(key)
                out.append(None)
                continue
            except CorruptPageError as exc:
                log.warning("disk tier: discarding corrupt page %s: %s", key.hex()[:16], exc)
                self.remove([key])
                with self._lock:
                    self._corrupt += 1
                out.append(None)
                continue
            out.append(page)
            with self._lock:
                self._loaded[0] += 1
                self._loaded[1] += len(data)
        with self._lock:  # the head last: the tail is then the least recent
            for key in reversed(keys):
                if key in self._index:
                    self._index.move_to_end(key)
        return out

    def put(self, pages: Sequence[PageData]) -> list[PageData]:
        for page in pages:
            with self._lock:
                if page.key in self._index:
                    self._index.move_to_end(page.key)
                    continue
            data = encode_page(self._namespace, page)
            target = self._file(page.key)
            tmp = self._dir / f".tmp-{page.key.hex()}-{os.getpid()}-{threading.get_ident()}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    if self._fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            with self._lock:
                self._index[page.key] = len(data)
                self._bytes += len(data)
                self._stored[0] += 1
                self._stored[1] += len(data)
                victims = []
                while self._bytes > self.capacity_bytes and len(self._index) > 1:
                    key, _ = next(iter(self._index.items()))
                    victims.append(key)
                    self._forget(key)
                    self._evicted += 1
            for key in victims:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._file(key))
        return []  # the last local tier: what it pushes out is deleted

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            with self._lock:
                present = key in self._index
                self._forget(key)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._file(key))
            removed += present
        return removed

    def clear(self) -> None:
        with self._lock:
            keys = list(self._index)
        self.remove(keys)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                name=self.name,
                medium=self.medium,
                pages=len(self._index),
                tokens=len(self._index) * self._tokens_per_page,
                bytes=self._bytes,
                stored_pages=self._stored[0],
                stored_bytes=self._stored[1],
                loaded_pages=self._loaded[0],
                loaded_bytes=self._loaded[1],
                evicted_pages=self._evicted,
                corrupt_pages=self._corrupt,
            )

    def close(self) -> None:
        """Nothing to release: the files stay for the next process."""

    def __repr__(self) -> str:
        return f"DiskTier(path={str(self._dir)!r}, pages={len(self._index)})"
