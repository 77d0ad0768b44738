"""Write a study's results: a rich table, JSON, CSV and a hit-rate-vs-capacity plot (and for
clusters, a hit-rate and imbalance by router plot)."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from .metrics import FIELDS, RunResult

__all__ = [
    "cluster_table",
    "results_table",
    "write_cluster_csv",
    "write_cluster_plot",
    "write_csv",
    "write_json",
    "write_plot",
    "write_tier_plot",
]


def results_table(results: Sequence[RunResult], title: str) -> Table:
    """One row per run, sorted by capacity then hit rate (best first)."""
    table = Table(title=title, title_justify="left")
    tier_names = _tier_names(results)
    columns: tuple[str, ...] = (
        "capacity", "policy", "hit rate", "prefill saved", "evicted", "over-evict",
        "preempted", "done", "cache us/req",
    )  # fmt: skip
    if tier_names:  # a storage hierarchy: where the hits came from, and what it moved
        columns = (
            "capacity", "tiers", "policy", "hit rate", "device", *tier_names, "moved GB",
            "prefill s saved", "evicted", "over-evict", "done", "cache us/req",
        )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("policy", "tiers") else "right")
    key = lambda r: (r.capacity_tokens, r.tiers, -r.hit_rate, r.policy)  # noqa: E731
    for r in sorted(results, key=key):
        label = r.policy if r.eviction == "shortfall" else f"{r.policy} (full eviction)"
        if tier_names:
            table.add_row(
                f"{r.capacity_tokens:,}", r.tiers or "-", label, f"{r.hit_rate:.2%}",
                f"{r.device_hit_rate:.2%}", *(f"{r.tier_hit_rate(t):.2%}" for t in tier_names),
                f"{sum(r.transfer_bytes.values()) / 1e9:.2f}",
                f"{r.prefill_seconds_saved:,.0f}/{r.prefill_seconds:,.0f}",
                f"{r.evicted_tokens:,}", f"{r.over_eviction:.1%}",
                f"{r.completed}/{r.requests}", f"{r.cache_us_per_request:.0f}",
            )  # fmt: skip
            continue
        table.add_row(
            f"{r.capacity_tokens:,}", label, f"{r.hit_rate:.2%}", f"{r.prefill_saved:.2%}",
            f"{r.evicted_tokens:,}", f"{r.over_eviction:.1%}", str(r.preemptions),
            f"{r.completed}/{r.requests}", f"{r.cache_us_per_request:.0f}",
        )  # fmt: skip
    return table


def _tier_names(results: Sequence[RunResult]) -> list[str]:
    """Every tier any run has, in the order they first appear (fastest first)."""
    names: dict[str, None] = {}
    for r in results:
        for name in r.tier_hit_tokens:
            names.setdefault(name)
    return list(names)


def write_json(
    results: Sequence[RunResult], path: str | os.PathLike[str], meta: dict[str, Any]
) -> None:
    """``{"meta": {...}, "runs": [RunResult fields, ...]}``."""
    payload = {"meta": meta, "runs": [r.as_dict() for r in results]}
    with open(path, "w", encoding="utf-8") as out:
        json.dump(payload, out, indent=2)
        out.write("\n")


def write_csv(results: Sequence[RunResult], path: str | os.PathLike[str]) -> None:
    """One row per run, one column per :class:`RunResult` field."""
    with open(path, "w", encoding="utf-8", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(FIELDS))
        writer.writeheader()
        for r in results:
            writer.writerow(r.as_dict())


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    """matplotlib's pyplot on the headless Agg backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'kvplug[sim]' (or pip install matplotlib)"
        ) from None
    return plt


def write_tier_plot(results: Sequence[RunResult], path: str | os.PathLike[str], title: str) -> None:
    """One stacked bar per run: the hit rate split into device and each tier (a run without
    tiers is all device), grouped by device capacity."""
    plt = _pyplot()
    tier_names = _tier_names(results)
    runs = sorted(results, key=lambda r: (r.capacity_tokens, r.tiers, r.policy))
    labels = [
        f"{r.capacity_tokens / 1e6:.3g}M {r.policy}" + (f"\n+{r.tiers}" if r.tiers else "")
        for r in runs
    ]
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(runs)), 4.8))
    bottom = [0.0] * len(runs)
    for name in ["device", *tier_names]:
        values = [
            100 * (r.device_hit_rate if r.tier_hit_tokens else r.hit_rate)
            if name == "device"
            else 100 * r.tier_hit_rate(name)
            for r in runs
        ]
        ax.bar(range(len(runs)), values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"{title}: hits per tier")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plot(results: Sequence[RunResult], path: str | os.PathLike[str], title: str) -> None:
    """Hit rate against capacity, one line per policy (``belady`` dashed), with matplotlib's
    headless Agg backend."""
    plt = _pyplot()
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        label = r.policy if r.eviction == "shortfall" else f"{r.policy} (full eviction)"
        if r.tiers:
            label += f" +{r.tiers}"
        lines.setdefault(label, []).append((r.capacity_tokens, r.hit_rate))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sorted(lines.items()):
        points.sort()
        style = "--" if label == "belady" else "-"
        ax.plot(
            [p[0] for p in points], [100 * p[1] for p in points], style, marker="o", label=label
        )
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cluster_table(results: Sequence[Any], title: str) -> Table:
    """One row per cluster run, grouped by total capacity; ``single`` rows are one instance
    holding the whole capacity (the reference line)."""
    table = Table(title=title, title_justify="left")
    columns = (
        "capacity/inst", "instances", "router", "hit rate", "prefill saved", "load max/mean",
        "requests max/mean", "max queue", "preempted", "evicted", "done",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "router" else "right")
    for r in sorted(results, key=_cluster_order):
        table.add_row(
            f"{r.capacity_tokens:,}", str(r.instances), r.router, f"{r.hit_rate:.2%}",
            f"{r.prefill_saved:.2%}", f"{r.load_imbalance:.3f}", f"{r.request_imbalance:.3f}",
            str(r.max_queue), str(r.preemptions), f"{r.evicted_tokens:,}",
            f"{r.completed}/{r.requests}",
        )  # fmt: skip
    return table


def _cluster_order(r: Any) -> tuple[Any, ...]:
    return (r.capacity_tokens * r.instances, r.policy, r.router != "single", -r.hit_rate)


def write_cluster_csv(results: Sequence[Any], path: str | os.PathLike[str]) -> None:
    """One row per cluster run (lists as JSON)."""
    from .cluster import CLUSTER_FIELDS

    with open(path, "w", encoding="utf-8", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(CLUSTER_FIELDS))
        writer.writeheader()
        for r in results:
            row = {k: json.dumps(v) if isinstance(v, list) else v for k, v in r.as_dict().items()}
            writer.writerow(row)


def write_cluster_plot(results: Sequence[Any], path: str | os.PathLike[str], title: str) -> None:
    """Hit rate (left) and load max/mean (right) by router, one bar group per instance count;
    the one-instance run with the same total capacity is the dashed reference line."""
    plt = _pyplot()
    routed = [r for r in results if r.router != "single"]
    routers = sorted({r.router for r in routed})
    counts = sorted({r.instances for r in routed})
    fig, (hit_ax, load_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    width = 0.8 / max(1, len(counts))
    for k, n in enumerate(counts):
        by = {r.router: r for r in routed if r.instances == n}
        xs = [i + k * width for i in range(len(routers))]
        hit_ax.bar(xs, [100 * by[x].hit_rate if x in by else 0 for x in routers], width,
                   label=f"{n} instances")  # fmt: skip
        load_ax.bar(xs, [by[x].load_imbalance if x in by else 0 for x in routers], width,
                    label=f"{n} instances")  # fmt: skip
        for single in (r for r in results if r.router == "single"):
            if single.capacity_tokens == n * routed[0].capacity_tokens:
                hit_ax.axhline(100 * single.hit_rate, linestyle="--", color=f"C{k}",
                               label=f"one instance, {n}x capacity")  # fmt: skip
    for ax, label in ((hit_ax, "token hit rate (%)"), (load_ax, "max / mean tokens served")):
        ax.set_xticks([i + width * (len(counts) - 1) / 2 for i in range(len(routers))])
        ax.set_xticklabels(routers, rotation=30, ha="right")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    load_ax.axhline(1.0, color="grey", linewidth=0.8)
    hit_ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
