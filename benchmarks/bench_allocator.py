"""Allocator hot-path cost: alloc+free per decode step and per extend, on cpu and cuda.

    python benchmarks/bench_allocator.py [--device auto|cpu|cuda] [--quick] [--threads N]

For each case the median over ``--repeat`` timed runs of ``--inner`` iterations is printed as
microseconds per step, nanoseconds per token and steps (alloc+free pairs) per second.
``ratio`` compares with a reference free list that appends with ``torch.cat`` on every free (how
SGLang's TokenToKVPoolAllocator keeps its free slots): above 1 means kvplug is faster.
``checks`` says which checks run: ``bounds`` the range check of freed indices only (the default
before ownership tracking), ``owner`` the default (range check + slot ownership: one scatter per
alloc, one scatter and two gathers per free, in the same single host sync), ``off`` neither (no
host sync), ``torch`` (cpu only) the default checks forced onto the torch-op path other devices
take instead of the NumPy views a CPU device uses. A second table puts ``bounds``, ``owner`` and
``torch`` medians side by side: the cost of the default ownership checks, and what the NumPy
path saves on the CPU. No pool memory is allocated: allocators manage indices only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvplug.allocators import PagedAllocator, StandardAllocator, SWAAllocator

CAPACITY = 1 << 18  # 262144 slots
PAGE = 16


class CatFreeList:
    """Reference: free slots as a tensor that ``free`` grows with ``torch.cat``."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.free_slots = torch.arange(1, size + 1, dtype=torch.int64, device=device)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        self.free_slots = torch.cat((self.free_slots, indices))


def timeit(step: Callable[[], None], device: torch.device, repeat: int, inner: int) -> float:
    """Median seconds per ``step()`` call."""
    for _ in range(max(2, inner // 4)):  # warm up
        step()
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def alloc_free(allocator, n: int) -> Callable[[], None]:
    def step() -> None:
        allocator.free(allocator.alloc(n))

    return step


def paged_decode(allocator: PagedAllocator, batch: int, new_pages: bool) -> Callable[[], None]:
    """One decode token per request; every request starts a page, or none does."""
    dev = allocator.device
    if new_pages:
        seq = torch.full((batch,), PAGE + 1, dtype=torch.int64, device=dev)
        last = torch.full((batch,), -1, dtype=torch.int64, device=dev)

        def step() -> None:
            allocator.free(allocator.alloc_decode(seq, last))

        return step
    held = allocator.alloc(batch * PAGE)  # each request owns one page with 3 tokens in it
    seq = torch.full((batch,), 4, dtype=torch.int64, device=dev)
    last = held[::PAGE] + 2

    def step_in_page() -> None:
        allocator.alloc_decode(seq, last)  # takes no page: nothing to free

    return step_in_page


def paged_extend(allocator: PagedAllocator, tokens: int, batch: int = 8) -> Callable[[], None]:
    """A prefill batch of ``batch`` requests with cached prefixes ending mid-page."""
    dev = allocator.device
    per = tokens // batch
    held = allocator.alloc(batch * PAGE)
    pre = torch.full((batch,), 5, dtype=torch.int64, device=dev)
    seq = pre + per
    last = held[::PAGE] + 4

    # free only the new pages (prefix pages stay held): one slot each, at fixed output positions
    first = allocator.alloc_extend(pre, seq, last, per * batch)
    new_page_starts = torch.nonzero(first % PAGE == 0).squeeze(1)
    allocator.free(first[new_page_starts])

    def step() -> None:
        out = allocator.alloc_extend(pre, seq, last, per * batch)
        allocator.free(out[new_page_starts])

    return step


def _path(allocator, host: bool):
    allocator.use_host_path(host)
    return allocator


def run_device(device: torch.device, args: argparse.Namespace) -> list[tuple]:
    """Time every case on one device; rows of (device, allocator, checks, case, n, sec, ref)."""
    batches = [1, 8, 64, 512] if not args.quick else [1, 64, 512]
    extends = [1024, 4096, 16384, 65536] if not args.quick else [1024, 65536]
    rows: list[tuple] = []
    modes = ("bounds", "owner", "torch", "off") if device.type == "cpu" else ("bounds", "owner")
    for checks in modes:
        kw = {
            "device": device,
            "check_bounds": checks != "off",
            "ownership_checks": checks in ("owner", "torch"),
        }
        host = checks != "torch"

        def std(kw=kw, host=host):
            return _path(StandardAllocator(CAPACITY, **kw), host)

        def paged(kw=kw, host=host):
            return _path(PagedAllocator(CAPACITY, PAGE, **kw), host)

        def swa(page_size=1, kw=kw, host=host):
            return _path(
                SWAAllocator(CAPACITY, CAPACITY // 2, 4096, page_size=page_size, **kw), host
            )

        cases = [  # allocator, case, sizes, step for size n, compare with the torch.cat free list
            ("standard", "decode", batches, lambda n: alloc_free(std(), n), True),
            ("swa", "decode", batches, lambda n: alloc_free(swa(), n), False),
            ("paged", "decode/new-page", batches, lambda n: paged_decode(paged(), n, True), False),
            ("paged", "decode/in-page", batches, lambda n: paged_decode(paged(), n, False), False),
            (
                "swa/p16",
                "decode/new-page",
                batches,
                lambda n: paged_decode(swa(PAGE), n, True),
                False,
            ),
            ("standard", "extend", extends, lambda n: alloc_free(std(), n), True),
            ("swa", "extend", extends, lambda n: alloc_free(swa(), n), False),
            ("paged", "alloc+free", extends, lambda n: alloc_free(paged(), n), False),
            ("paged", "extend x8", extends, lambda n: paged_extend(paged(), n), False),
            ("swa/p16", "extend x8", extends, lambda n: paged_extend(swa(PAGE), n), False),
        ]
        for name, case, sizes, make_step, compare in cases:
            for n in sizes:
                seconds = timeit(make_step(n), device, args.repeat, args.inner)
                ref = None
                if compare and checks == "owner":
                    cat_list = CatFreeList(CAPACITY, device)
                    ref = timeit(alloc_free(cat_list, n), device, args.repeat, args.inner)
                rows.append((str(device), name, checks, case, n, seconds, ref))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cpu, plus cuda when torch sees one",
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument(
        "--repeat", type=int, default=None, help="timed runs per case (median taken)"
    )
    parser.add_argument("--inner", type=int, default=None, help="steps per timed run")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch cpu threads (default 1: a scheduler calls the allocator from one thread)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.repeat = args.repeat or (5 if args.quick else 9)
    args.inner = args.inner or (20 if args.quick else 100)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    devices = [torch.device(args.device)] if args.device != "auto" else [torch.device("cpu")]
    if args.device == "auto" and torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} cpu threads, "
        f"capacity {CAPACITY} slots, "
        f"page {PAGE}, median of {args.repeat} x {args.inner} steps"
    )
    if torch.cuda.is_available():
        print(f"cuda: {torch.cuda.get_device_name()}")
    header = (
        f"{'device':<7} {'allocator':<9} {'checks':<6} {'case':<16} {'tokens':>7} "
        f"{'us/step':>9} {'ns/token':>9} {'steps/s':>10} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for device in devices:
        for dev, name, checks, case, n, sec, ref in run_device(device, args):
            rows.append((dev, name, checks, case, n, sec))
            ratio = f"{ref / sec:6.2f}" if ref else ""
            print(
                f"{dev:<7} {name:<9} {checks:<6} {case:<16} {n:>7} "
                f"{sec * 1e6:>9.1f} {sec * 1e9 / n:>9.1f} "
                f"{1 / sec:>10.0f} {ratio:>6}"
            )
    print()
    print("ownership checks (default) vs range check only, median us/step; on the cpu also the")
    print("default checks on the torch-op path (torch) and its time over the NumPy path (xtorch):")
    header = (
        f"{'device':<7} {'allocator':<9} {'case':<16} {'tokens':>7} "
        f"{'bounds':>9} {'owner':>9} {'cost':>7} {'torch':>9} {'xtorch':>7}"
    )
    print(header)
    print("-" * len(header))
    by_key = {(d, a, c, n, k): sec for d, a, k, c, n, sec in rows}
    for dev, name, checks, case, n, sec in rows:
        if checks != "owner":
            continue
        before = by_key[(dev, name, case, n, "bounds")]
        forced = by_key.get((dev, name, case, n, "torch"))
        extra = f" {forced * 1e6:>9.1f} {forced / sec:>7.2f}" if forced else ""
        print(
            f"{dev:<7} {name:<9} {case:<16} {n:>7} {before * 1e6:>9.1f} {sec * 1e6:>9.1f} "
            f"{(sec / before - 1) * 100:>6.0f}%{extra}"
        )


if __name__ == "__main__":
    main()
