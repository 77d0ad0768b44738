"""Write a study's results: a rich table, JSON, CSV and a hit-rate-vs-capacity plot."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from .metrics import FIELDS, RunResult

__all__ = ["results_table", "write_csv", "write_json", "write_plot"]


def results_table(results: Sequence[RunResult], title: str) -> Table:
    """One row per run, sorted by capacity then hit rate (best first)."""
    table = Table(title=title, title_justify="left")
    columns = (
        "capacity", "policy", "hit rate", "prefill saved", "evicted", "over-evict",
        "preempted", "done", "cache us/req",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in sorted(results, key=lambda r: (r.capacity_tokens, -r.hit_rate, r.policy)):
        label = r.policy if r.eviction == "shortfall" else f"{r.policy} (full eviction)"
        table.add_row(
            f"{r.capacity_tokens:,}", label, f"{r.hit_rate:.2%}", f"{r.prefill_saved:.2%}",
            f"{r.evicted_tokens:,}", f"{r.over_eviction:.1%}", str(r.preemptions),
            f"{r.completed}/{r.requests}", f"{r.cache_us_per_request:.0f}",
        )  # fmt: skip
    return table


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


def write_plot(results: Sequence[RunResult], path: str | os.PathLike[str], title: str) -> None:
    """Hit rate against capacity, one line per policy (``belady`` dashed), with matplotlib's
    headless Agg backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'kvplug[sim]' (or pip install matplotlib)"
        ) from None
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        label = r.policy if r.eviction == "shortfall" else f"{r.policy} (full eviction)"
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
