"""Eviction policies against LRU and the offline leaf-only Belady bound, on real and synthetic
prefix-cache traces.

For each workload and each cache capacity (1, 3, 5, 10, 25 % of the trace's unique tokens) it
replays the requests through a real ``RadixCache`` (page size 1) and reports the token hit rate
of every policy, of ``belady`` (evicts the leaf whose content is needed farthest in the future:
the offline bound for a leaf-only cache), the fraction of the LRU->Belady gap each policy closes,
the prefill compute saved (hit tokens weighted by depth with the default
:class:`~kvplug.policies.cost.CostModel`), and each policy's worst loss against LRU over every
workload and capacity.

Replay is sequential, one request at a time, as an engine does it: match, lock, evict the
shortfall, allocate, insert, unlock (no batching, no decode tokens).

Workloads:

* ``conversation`` — the Mooncake conversation trace at ``../shared/traces/`` relative to the
  repository root (each 512-token hash block becomes ``--block-tokens`` distinct tokens); read in
  place, never copied;
* ``zipf_system`` — requests over shared system prompts with Zipf popularity, unique suffixes;
* ``chat`` — multi-turn sessions with think times: each turn re-sends the history plus a reply
  and a new message;
* ``agentic`` — long-context agent sessions whose tool-call turns append a little each time;
* ``scan`` — a loop over more distinct prompts than fit, with a few hot prompts;
* ``flip`` — adversarial for a learned policy: in the first half content reused once is reused
  again soon and fresh content rarely; in the second half the opposite;
* ``tool-loop``, ``shared-system``, ``doc-bursts`` — the ``kvplug simulate --synthetic`` presets
  of those names (:mod:`kvplug.traces.shapes`): agent tool loops over long shared contexts with
  sub-agent forks, many small sessions behind one system prompt, bursty re-reads of documents;
* ``tree-search`` — the held-out preset: reasoning tree search with backtracking (report it as
  *unseen*: no policy default was tuned on it).

    python benchmarks/bench_policies.py                 # everything (several minutes)
    python benchmarks/bench_policies.py --quick         # small synthetic traces, no Mooncake
    python benchmarks/bench_policies.py --workloads conversation --capacities 1,3,5
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvplug.allocators.standard import StandardAllocator
from kvplug.caches.radix import RadixCache, RadixNode
from kvplug.plugins.policies import kvplug_eviction_policies
from kvplug.policies import CostModel
from kvplug.traces import PRESETS, synthetic_trace
from kvplug_hookspecs import EvictionCandidate, EvictParams, KeyedEvictionPolicy

ROOT = Path(__file__).resolve().parent.parent
_TRACE = Path("shared") / "traces" / "mooncake_conversation_trace.jsonl"
# ../shared/traces/ relative to the repository root (a git worktree may sit one level deeper)
MOONCAKE = next((p / _TRACE for p in ROOT.parents if (p / _TRACE).exists()), ROOT.parent / _TRACE)
POLICIES = ("lru", "arc", "s3fifo", "lhd", "olru", "gdsf")
CAPACITIES = (1, 3, 5, 10, 25)
COST = CostModel()

Trace = list[list[int]]  # requests as lists of block ids; a block is block_tokens tokens


# -- workloads -------------------------------------------------------------------------------


def conversation(path: Path = MOONCAKE, limit: int | None = None) -> Trace:
    trace = []
    with path.open() as f:
        for line in f:
            trace.append(json.loads(line)["hash_ids"])
            if limit is not None and len(trace) >= limit:
                break
    return trace


class _Blocks:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def zipf_system(n: int, seed: int = 1) -> Trace:
    rng, blocks = random.Random(seed), _Blocks()
    systems = [blocks.take(rng.randint(4, 32)) for _ in range(60)]
    weights = [1 / (r + 1) ** 1.1 for r in range(len(systems))]
    return [rng.choices(systems, weights)[0] + blocks.take(rng.randint(1, 8)) for _ in range(n)]


def _interleave(sessions: list[list[tuple[float, list[int]]]]) -> Trace:
    events = [item for session in sessions for item in session]
    events.sort(key=lambda e: e[0])
    return [blocks for _, blocks in events]


def chat(n: int, seed: int = 2) -> Trace:
    rng, blocks = random.Random(seed), _Blocks()
    system = blocks.take(4)
    sessions, total = [], 0
    while total < n:
        start, history, turns = rng.uniform(0, n), list(system), []
        t = start
        while True:
            history = history + blocks.take(rng.randint(1, 4))  # the user's message
            turns.append((t, list(history)))
            history += blocks.take(rng.randint(1, 3))  # the reply
            t += rng.expovariate(1 / 60)  # think time
            if rng.random() < 0.3:
                break
        sessions.append(turns)
        total += len(turns)
    return _interleave(sessions)[:n]


def agentic(n: int, seed: int = 3) -> Trace:
    rng, blocks = random.Random(seed), _Blocks()
    tools = blocks.take(16)
    sessions, total = [], 0
    while total < n:
        history, t, turns = tools + blocks.take(rng.randint(40, 120)), rng.uniform(0, n), []
        for _ in range(rng.randint(10, 30)):
            turns.append((t, list(history)))
            history = history + blocks.take(rng.randint(1, 2))  # a tool call and its result
            t += rng.expovariate(1 / 8)
        sessions.append(turns)
        total += len(turns)
    return _interleave(sessions)[:n]


def scan(n: int, seed: int = 4) -> Trace:
    rng, blocks = random.Random(seed), _Blocks()
    header = blocks.take(2)
    loop = [header + blocks.take(8) for _ in range(max(1, n // 3))]
    hot = [header + blocks.take(8) for _ in range(20)]
    return [rng.choice(hot) if rng.random() < 0.2 else loop[i % len(loop)] for i in range(n)]


def flip(n: int, seed: int = 5) -> Trace:
    """First half: half the prompts come back twice soon, the rest never. Second half: every
    prompt comes back once, late, and content reused once is never used again."""
    rng, blocks = random.Random(seed), _Blocks()
    header = blocks.take(2)
    events: list[tuple[float, list[int]]] = []
    for i in range(n // 2):
        prompt, t = header + blocks.take(rng.randint(2, 6)), float(i)
        if i < n // 4:
            events.append((t, prompt))
            if rng.random() < 0.5:
                events.append((t + rng.uniform(5, 30), prompt))
                events.append((t + rng.uniform(35, 60), prompt))
        else:
            events.append((t, prompt))
            events.append((t + rng.uniform(80, 200), prompt))
    events.sort(key=lambda e: e[0])
    return [p for _, p in events]


def preset(name: str) -> Callable[[int], Trace]:
    """The ``--synthetic`` preset ``name``'s first ``n`` prompts, as block ids."""

    def make(n: int) -> Trace:
        spec = PRESETS[name].model_copy(update={"num_requests": n})
        return [list(r.block_ids or ()) for r in synthetic_trace(spec)]

    return make


WORKLOADS: dict[str, Callable[[int], Trace]] = {
    "zipf_system": zipf_system,
    "chat": chat,
    "agentic": agentic,
    "scan": scan,
    "flip": flip,
    "tool-loop": preset("tool-loop"),
    "shared-system": preset("shared-system"),
    "doc-bursts": preset("doc-bursts"),
    "tree-search": preset("tree-search"),
}


# -- the offline bound -----------------------------------------------------------------------


class FutureIndex:
    """For every prefix of block ids, the sorted request indices that contain it."""

    def __init__(self, trace: Trace) -> None:
        self.ids: dict[tuple[int, int], int] = {}
        self.uses: list[list[int]] = [[]]
        for i, request in enumerate(trace):
            node = 0
            for block in request:
                key = (node, block)
                child = self.ids.get(key)
                if child is None:
                    child = self.ids[key] = len(self.uses)
                    self.uses.append([])
                self.uses[child].append(i)
                node = child
        self.now = 0

    def next_use(self, prefix_id: int) -> int:
        uses = self.uses[prefix_id]
        j = bisect.bisect_right(uses, self.now)
        return uses[j] if j < len(uses) else 1 << 60


class BeladyPolicy(KeyedEvictionPolicy):
    """Evict the leaf whose first block is needed farthest in the future (offline)."""

    def __init__(self, future: FutureIndex, block_tokens: int) -> None:
        super().__init__()
        self.future, self.block_tokens = future, block_tokens

    def key(self, candidate: EvictionCandidate) -> Any:
        assert isinstance(candidate, RadixNode)
        path, node = [], candidate
        while node.parent is not None:
            path.append(node)
            node = node.parent
        prefix, ids, bt = 0, self.future.ids, self.block_tokens
        for n in reversed(path):  # the block ids from the root to the candidate's first block
            for token in n.key[:1] if n is candidate else n.key[::bt]:
                prefix = ids.get((prefix, token // bt), -1)
                if prefix < 0:
                    return -(1 << 60)  # never requested: evict first
        return -self.future.next_use(prefix)


# -- replay ----------------------------------------------------------------------------------


def expand(request: list[int], block_tokens: int) -> list[int]:
    return [b * block_tokens + i for b in request for i in range(block_tokens)]


def replay(
    trace: Trace,
    capacity: int,
    new_policy: Callable[[], Any],
    block_tokens: int,
    future: FutureIndex | None = None,
) -> tuple[float, float]:
    """Token hit rate and prefill compute saved of one policy at one capacity."""
    allocator = StandardAllocator(capacity, device="cpu", check_bounds=False)
    cache = RadixCache(allocator, new_policy)
    hit = total = saved = cost = 0.0
    for i, request in enumerate(trace):
        tokens = expand(request, block_tokens)[: capacity // 2]
        if future is not None:
            future.now = i
        m = cache.match_prefix(tokens)
        cache.inc_lock_ref(m.last_node)
        need = len(tokens) - m.prefix_len
        short = need - allocator.available_size()
        if short > 0:
            cache.evict(EvictParams(num_tokens=short))
        new = allocator.alloc(need)
        assert new is not None
        cache.insert(tokens, torch.cat([m.device_indices, new]))
        cache.dec_lock_ref(m.last_node)
        hit += m.prefix_len
        total += len(tokens)
        saved += COST.tokens_cost(0, m.prefix_len)
        cost += COST.tokens_cost(0, len(tokens))
    return hit / total, saved / cost


def policy_factories() -> dict[str, Callable[[], Any]]:
    registrations = {r.name: r for r in kvplug_eviction_policies()}
    out = {}
    for name in POLICIES:
        r = registrations[name]
        out[name] = lambda r=r: r.factory(r.options_model())
    return out


def rows(
    name: str, trace: Trace, capacities: tuple[int, ...], block_tokens: int
) -> Iterator[dict[str, Any]]:
    unique = len({b for request in trace for b in request}) * block_tokens
    factories = policy_factories()
    future = FutureIndex(trace)
    for percent in capacities:
        capacity = max(64, unique * percent // 100)
        row: dict[str, Any] = {"workload": name, "capacity_pct": percent, "tokens": capacity}
        start = time.perf_counter()
        for policy, factory in factories.items():
            row[policy], row[f"{policy}_compute"] = replay(trace, capacity, factory, block_tokens)
        row["belady"], row["belady_compute"] = replay(
            trace, capacity, lambda: BeladyPolicy(future, block_tokens), block_tokens, future
        )
        row["seconds"] = time.perf_counter() - start
        yield row


def gap_closed(row: dict[str, Any], policy: str) -> float | None:
    gap = row["belady"] - row["lru"]
    return (row[policy] - row["lru"]) / gap if gap > 1e-9 else None


def print_row(row: dict[str, Any]) -> None:
    cells = [f"{row['workload']:<12} {row['capacity_pct']:>3}%"]
    for p in (*POLICIES, "belady"):
        cells.append(f"{100 * row[p]:6.2f}")
    for p in POLICIES[1:]:
        g = gap_closed(row, p)
        cells.append("   n/a" if g is None else f"{100 * g:6.1f}")
    if "olru_compute" in row:
        cells.append(f"{100 * row['olru_compute']:6.2f}")
    print(" ".join(cells), flush=True)


def main() -> None:
    global POLICIES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small synthetic traces only")
    parser.add_argument("--workloads", default=None, help="comma list (default: all)")
    parser.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    parser.add_argument("--requests", type=int, default=4000, help="per synthetic workload")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--trace", type=Path, default=MOONCAKE, help="Mooncake JSONL trace")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--policies", default=None, help="comma list, lru first (default: all)")
    args = parser.parse_args()
    if args.policies is not None:
        POLICIES = tuple(args.policies.split(","))
    names = ["conversation", *WORKLOADS] if args.workloads is None else args.workloads.split(",")
    if args.quick:
        names = [n for n in names if n != "conversation"]
        args.requests = min(args.requests, 800)
    capacities = tuple(int(c) for c in args.capacities.split(","))
    header = ["workload       cap", *(f"{p:>6}" for p in (*POLICIES, "belady"))]
    header += [f"{'g_' + p[:4]:>6}" for p in POLICIES[1:]] + ["olru_cs"]
    print("token hit rate %, gap closed % (g_: share of the LRU->Belady gap), olru compute saved %")
    print(" ".join(header))
    out = []
    for name in names:
        if name == "conversation":
            trace = conversation(args.trace)
        else:
            trace = WORKLOADS[name](args.requests)
        for row in rows(name, trace, capacities, args.block_tokens):
            print_row(row)
            out.append(row)
    print("\nworst vs lru over every workload and capacity (pp):")
    for p in POLICIES[1:]:
        worst = min(out, key=lambda r, p=p: r[p] - r["lru"])
        print(
            f"  {p:<7} {100 * (worst[p] - worst['lru']):+.2f} "
            f"({worst['workload']} at {worst['capacity_pct']}%)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
