"""The ``disk`` tier on a real directory: atomic writes, warm restart, its bound, a read-only or
full directory, and corrupt files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvplug.tiers.disk import DiskTier, DiskTierOptions
from kvplug.tiers.pages import decode_page, encode_page
from kvplug_hookspecs import StorageTier

from .faults import disk_full, read_only
from .helpers import chain, namespace, same_page, tier_context

REPO = Path(__file__).resolve().parents[2]
NS = namespace(4)


def disk(path: Path, capacity_bytes: int = 1 << 30, **options) -> DiskTier:
    return DiskTier(
        tier_context(4, ns=NS),
        DiskTierOptions(path=str(path), capacity_bytes=capacity_bytes, **options),
    )


def keys(pages):
    return [p.key for p in pages]


def files(path: Path) -> list[Path]:
    return sorted((path / NS.id).iterdir())


def page_bytes() -> int:
    """Bytes of a page file with a parent (a prefix's first page has none: 32 bytes less)."""
    return len(encode_page(NS.id, chain(2, 4, ns=NS)[1]))


def size_of(pages) -> int:
    return sum(len(encode_page(NS.id, p)) for p in pages)


def test_round_trip_and_files_are_named_by_key(tmp_path):
    tier = disk(tmp_path)
    assert isinstance(tier, StorageTier)
    pages = chain(3, 4, ns=NS)
    assert tier.put(pages) == []
    assert [f.name for f in files(tmp_path)] == sorted(p.key.hex() + ".kvpg" for p in pages)
    assert tier.contains(keys(pages)) == 3
    assert all(same_page(g, p) for g, p in zip(tier.get(keys(pages)), pages, strict=True))
    s = tier.stats()
    size = size_of(pages)
    assert (s.pages, s.tokens, s.bytes, s.stored_pages, s.stored_bytes) == (3, 12, size, 3, size)
    assert (s.loaded_pages, s.loaded_bytes, s.medium) == (3, size, "Disk")


@pytest.mark.parametrize("fsync", [False, True])
def test_warm_restart_finds_the_pages(tmp_path, fsync):
    pages = chain(5, 4, ns=NS)
    first = disk(tmp_path, fsync=fsync)
    first.put(pages)
    first.close()
    second = disk(tmp_path)
    assert second.contains(keys(pages)) == 5
    assert all(same_page(g, p) for g, p in zip(second.get(keys(pages)), pages, strict=True))
    assert second.stats().bytes == size_of(pages)
    # another namespace on the same directory sees none of them
    other = DiskTier(
        tier_context(4, ns=namespace(4, model_id="other")), DiskTierOptions(path=str(tmp_path))
    )
    assert other.contains(keys(pages)) == 0


def test_warm_restart_evicts_oldest_first(tmp_path):
    size = page_bytes()
    a, b = chain(2, 4, seed=1, ns=NS), chain(2, 4, seed=2, ns=NS)
    first = disk(tmp_path)
    first.put(a)
    for i, f in enumerate(sorted(files(tmp_path), key=lambda f: f.name)):
        os.utime(f, ns=(10**9 * (i + 1),) * 2)  # a's files: old
    first.put(b)
    second = disk(tmp_path, capacity_bytes=3 * size)
    second.put(chain(1, 4, seed=3, ns=NS))
    assert second.contains(keys(b)) == 2 and second.stats().pages == 3
    assert second.stats().evicted_pages == 2


def test_size_bound(tmp_path):
    size = page_bytes()
    tier = disk(tmp_path, capacity_bytes=4 * size)
    a, b = chain(3, 4, seed=1, ns=NS), chain(3, 4, seed=2, ns=NS)
    tier.put(a)
    tier.get(keys(a))
    tier.put(b)
    s = tier.stats()
    assert (s.pages, s.bytes, s.evicted_pages) == (4, size_of([a[0], *b]), 2)
    assert len(files(tmp_path)) == 4
    # the least recent go first, a prefix's tail before its head (a hit touches the head last)
    assert tier.contains(keys(a)) == 1 and tier.contains(keys(b)) == 3


def test_a_leftover_tmp_file_is_never_a_page_and_is_removed_on_restart(tmp_path):
    pages = chain(2, 4, ns=NS)
    tier = disk(tmp_path)
    tier.put(pages[:1])
    data = encode_page(NS.id, pages[1])
    partial = tmp_path / NS.id / f".tmp-{pages[1].key.hex()}-1-1"
    partial.write_bytes(data[: len(data) // 2])
    assert tier.contains(keys(pages)) == 1
    again = disk(tmp_path)
    assert again.contains(keys(pages)) == 1
    assert not partial.exists()


CRASH = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    from kvplug.tiers.disk import DiskTier, DiskTierOptions
    from tests.tiers.helpers import chain, namespace, tier_context
    ns = namespace(4)
    tier = DiskTier(tier_context(4, ns=ns), DiskTierOptions(path=sys.argv[1]))
    pages = chain(6, 4, ns=ns)
    tier.put(pages[:3])
    print("stored", flush=True)
    # the next write stops half way: SIGXFSZ kills the process inside write(), as a crash would
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it by default
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
    tier.put(pages[3:])
    print("not reached", flush=True)
    """
)


def test_a_process_killed_mid_write_leaves_no_readable_partial_page(tmp_path):
    size = page_bytes()  # pages[3], the first that fails, has a parent
    proc = subprocess.run(
        [sys.executable, "-c", CRASH, str(tmp_path), str(size // 2)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode < 0, proc.stderr  # killed by a signal, mid-write
    assert proc.stdout.split() == ["stored"]
    names = [f.name for f in files(tmp_path)]
    tmps = [n for n in names if n.startswith(".tmp-")]
    assert len(tmps) == 1 and (tmp_path / NS.id / tmps[0]).stat().st_size == size // 2
    pages = chain(6, 4, ns=NS)
    assert sorted(n for n in names if n.endswith(".kvpg")) == sorted(
        p.key.hex() + ".kvpg" for p in pages[:3]
    )
    restarted = disk(tmp_path)
    assert restarted.contains(keys(pages)) == 3
    got = restarted.get(keys(pages))
    assert all(same_page(g, p) for g, p in zip(got[:3], pages[:3], strict=True))
    assert got[3:] == [None, None, None]
    assert not any(f.name.startswith(".tmp-") for f in files(tmp_path))


def test_read_only_directory_put_fails_loads_still_work(tmp_path):
    tier = disk(tmp_path)
    old, new = chain(2, 4, seed=1, ns=NS), chain(2, 4, seed=2, ns=NS)
    tier.put(old)
    with read_only(tmp_path / NS.id):
        with pytest.raises(PermissionError):
            tier.put(new)
        assert tier.contains(keys(new)) == 0
        got = tier.get(keys(old))  # reading is still allowed
        assert all(same_page(g, p) for g, p in zip(got, old, strict=True))
    assert not any(f.name.startswith(".tmp-") for f in files(tmp_path))
    assert tier.stats().pages == 2 and tier.stats().stored_pages == 2
    tier.put(new)  # writable again
    assert tier.contains(keys(new)) == 2


def test_full_disk_put_fails_nothing_partial_is_visible(tmp_path):
    tier = disk(tmp_path)
    pages = chain(2, 4, ns=NS)
    with disk_full(page_bytes() // 3), pytest.raises(OSError):
        tier.put(pages)
    assert tier.contains(keys(pages)) == 0 and tier.stats().pages == 0
    assert files(tmp_path) == []
    tier.put(pages)
    assert tier.contains(keys(pages)) == 2


def test_corrupt_and_truncated_files_are_discarded_and_counted(tmp_path):
    tier = disk(tmp_path)
    pages = chain(3, 4, ns=NS)
    tier.put(pages)
    path1 = tmp_path / NS.id / (pages[1].key.hex() + ".kvpg")
    data = bytearray(path1.read_bytes())
    data[len(data) // 2] ^= 0x10
    path1.write_bytes(bytes(data))
    path2 = tmp_path / NS.id / (pages[2].key.hex() + ".kvpg")
    path2.write_bytes(path2.read_bytes()[:-7])
    got = tier.get(keys(pages))
    # a flipped KV bit still decodes: the hierarchy's check_page catches it (checksum)
    assert same_page(got[0], pages[0]) and got[1] is not None and not same_page(got[1], pages[1])
    assert got[2] is None and not path2.exists()
    s = tier.stats()
    assert (s.pages, s.corrupt_pages, s.loaded_pages) == (2, 1, 2)
    # a file deleted behind the tier's back is a miss, and forgotten
    path1.unlink()
    assert tier.get([pages[1].key]) == [None] and tier.contains(keys(pages)) == 1


def test_concurrent_puts_and_gets(tmp_path):
    tier = disk(tmp_path)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for c in range(10):
                pages = chain(3, 4, seed=t * 10 + c + 1, ns=NS)
                tier.put(pages)
                got = tier.get(keys(pages))
                assert all(same_page(g, p) for g, p in zip(got, pages, strict=True))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    s = tier.stats()
    assert (s.pages, s.stored_pages, s.loaded_pages) == (120, 120, 120)
    assert len(files(tmp_path)) == 120
    assert all(decode_page(NS.id, f.read_bytes()) for f in files(tmp_path))
