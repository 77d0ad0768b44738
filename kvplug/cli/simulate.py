"""``kvplug simulate``: replay a trace through every policy x capacity and report hit rates;
with ``--instances``, through N instances behind every ``--router``.

With no arguments it runs the seeded synthetic chat workload on the default config at three
capacities, the built-in policies and Belady's offline optimum, in well under a minute.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..config import read_config_file
from ..errors import ConfigError, UnknownComponentError
from ..sim import (
    BELADY,
    PrefillCost,
    RunResult,
    RunSpec,
    SimulationError,
    TraceSource,
    check_names,
    parse_capacity,
    run_grid,
    trace_summary,
)
from ..sim.cluster import ClusterSpec, as_single
from ..sim.replay import _stack_config
from ..sim.report import (
    PlotUnavailable,
    cluster_table,
    results_table,
    write_cluster_csv,
    write_cluster_plot,
    write_csv,
    write_json,
    write_plot,
    write_tier_plot,
)
from ..sim.routers import ROUTERS, make_router
from ..sim.tiers import NO_TIERS, combined_tokens, parse_hierarchies
from ..traces import PRESETS, TraceError
from .app import EXIT_BAD_CONFIG, DebugOption, app, err, fail, out

DEFAULT_POLICIES = "lru,lfu,fifo,slru,arc,s3fifo,lhd,olru,gdsf"
DEFAULT_CAPACITIES = "5%,10%,25%"


def _detect_format(path: Path) -> str:
    """``mooncake`` when the first record has ``hash_ids``, ``tokens`` when it has
    ``token_ids``."""
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                if isinstance(record, dict) and "token_ids" in record:
                    return "tokens"
                return "mooncake"
    return "mooncake"


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise SimulationError(f"--instances: {text!r} is not a positive instance count")
    return int(text)


def _router_options(text: str | None) -> dict[str, dict[str, Any]]:
    """``--router-options`` JSON: router name -> its options (checked by the router)."""
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SimulationError(f"--router-options is not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise SimulationError('--router-options must map router names to options: {"name": {}}')
    for name in data:
        if name not in ROUTERS:
            raise SimulationError(
                f"--router-options: unknown router {name!r}; valid: {', '.join(ROUTERS)}"
            )
    return data


def _cluster_specs(
    runs: list[RunSpec],
    counts: list[int],
    routers: list[str],
    options: dict[str, dict[str, Any]],
    seed: int,
) -> list[RunSpec | ClusterSpec]:
    """Every run on every instance count behind every router, and for each count the one
    instance holding the same total capacity (the reference line)."""
    specs: list[RunSpec | ClusterSpec] = []
    for run in runs:
        for n in counts:
            per_instance = _stack_config(run).pool.capacity_tokens  # whole pages
            total = run.model_copy(update={"capacity_tokens": per_instance * n})
            if n > 1 and total not in specs:
                specs.append(total)
            specs += [
                ClusterSpec(
                    run=run, instances=n, router=r, router_options=options.get(r, {}), seed=seed
                )
                for r in routers
            ]
    return specs


@app.command("simulate")
def simulate_command(
    trace: Annotated[
        Path | None, typer.Option("--trace", help="A Mooncake or token JSONL trace.")
    ] = None,
    trace_format: Annotated[
        str | None, typer.Option("--format", help="mooncake or tokens (default: detected).")
    ] = None,
    synthetic: Annotated[
        str,
        typer.Option(
            "--synthetic", help=f"Synthetic preset without --trace: {', '.join(PRESETS)}."
        ),
    ] = "chat",
    config: Annotated[
        Path | None, typer.Option("--config", help="Engine config (cache, allocator, options).")
    ] = None,
    policy: Annotated[
        str, typer.Option("--policy", help="Comma-separated eviction policies.")
    ] = DEFAULT_POLICIES,
    capacity: Annotated[
        str,
        typer.Option(
            "--capacity", help="Comma-separated capacities: tokens (K/M/G) or % of unique."
        ),
    ] = DEFAULT_CAPACITIES,
    page_size: Annotated[int | None, typer.Option("--page-size", min=1)] = None,
    timing: Annotated[
        str, typer.Option("--timing", help="sequential (one request at a time) or trace.")
    ] = "sequential",
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="First N requests.")] = None,
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="Worker processes.")] = 2,
    belady: Annotated[
        bool, typer.Option("--belady/--no-belady", help="Add the offline optimum.")
    ] = True,
    baseline: Annotated[
        str | None, typer.Option("--baseline", help="full-eviction: also replay the pre-fix bug.")
    ] = None,
    insert: Annotated[
        str, typer.Option("--insert", help="prompt+output (SGLang's order) or prompt.")
    ] = "prompt+output",
    block_size: Annotated[
        int, typer.Option("--block-size", min=1, help="Tokens per Mooncake hash id.")
    ] = 512,
    skip_bad: Annotated[
        bool, typer.Option("--skip-bad", help="Skip malformed trace lines and count them.")
    ] = False,
    tiers: Annotated[
        str | None,
        typer.Option(
            "--tiers",
            help="Storage hierarchies below the device, e.g. 'host=10x' or "
            "'none;host=10x,disk=50x' (sizes: multiples of the device capacity or tokens; "
            "';' runs several side by side).",
        ),
    ] = None,
    combined: Annotated[
        bool,
        typer.Option(
            "--combined/--no-combined",
            help="With --tiers: also run the first policy on one device tier holding the "
            "hierarchy's combined capacity (the single-tier reference).",
        ),
    ] = True,
    cost_linear: Annotated[float, typer.Option("--cost-linear", min=0)] = 1.0,
    cost_quadratic: Annotated[float, typer.Option("--cost-quadratic", min=0)] = 1.0 / 4096,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write results as JSON.")] = None,
    csv_path: Annotated[Path | None, typer.Option("--csv", help="Write results as CSV.")] = None,
    plot_path: Annotated[
        Path | None, typer.Option("--plot", help="Write a hit-rate PNG (needs kvplug[sim]).")
    ] = None,
    instances: Annotated[
        str | None,
        typer.Option(
            "--instances",
            help="Comma-separated instance counts: replay through N instances behind routers "
            "(--capacity is then per instance).",
        ),
    ] = None,
    router: Annotated[
        str, typer.Option("--router", help=f"Comma-separated routers: {', '.join(ROUTERS)}.")
    ] = ",".join(ROUTERS),
    router_options: Annotated[
        str | None,
        typer.Option(
            "--router-options",
            help='Router options as JSON, e.g. \'{"kv_aware": {"overlap_weight": 2}}\'.',
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Routers' tie-breaking seed.")] = 0,
    executor: Annotated[
        str, typer.Option("--executor", help="local (--jobs processes) or ray.")
    ] = "local",
    ray_address: Annotated[
        str | None,
        typer.Option("--ray-address", help="ray.init(address=...): none starts a local Ray."),
    ] = None,
    debug: DebugOption = False,
) -> None:
    """Replay a trace through real kvplug stacks: hit rate, evictions, over-eviction per
    policy and capacity, with Belady's offline optimum beside them. With --instances, through
    N instances behind each router: cluster hit rate and load balance per router, beside one
    instance holding the same total capacity."""
    try:
        if timing not in ("sequential", "trace"):
            raise SimulationError(f"--timing must be sequential or trace, got {timing!r}")
        if insert not in ("prompt+output", "prompt"):
            raise SimulationError(f"--insert must be prompt+output or prompt, got {insert!r}")
        if baseline not in (None, "full-eviction"):
            raise SimulationError(f"--baseline must be full-eviction, got {baseline!r}")
        if executor not in ("local", "ray"):
            raise SimulationError(f"--executor must be local or ray, got {executor!r}")
        counts = [_count(n) for n in _split(instances)] if instances is not None else []
        routers = _split(router)
        for name in routers:
            if name not in ROUTERS:
                raise SimulationError(f"unknown router {name!r}; valid: {', '.join(ROUTERS)}")
        options = _router_options(router_options)
        if trace is None:
            source = TraceSource(kind="synthetic", preset=synthetic, limit=limit)
            source.spec()
        else:
            if trace.is_dir():
                raise SimulationError(f"--trace {str(trace)!r} is a directory, not a trace file")
            if not trace.exists():
                raise SimulationError(f"--trace {str(trace)!r} does not exist")
            kind = trace_format or _detect_format(trace)
            if kind not in ("mooncake", "tokens"):
                raise SimulationError(f"--format must be mooncake or tokens, got {kind!r}")
            source = TraceSource(
                kind=kind, path=str(trace), block_size=block_size, limit=limit, skip_bad=skip_bad
            )
        config_data: dict[str, Any] = read_config_file(config) if config else {}
        summary = trace_summary(source)
        if summary.requests == 0:
            raise SimulationError(f"the trace {source.name} has no requests")
        capacities = [parse_capacity(c, summary.unique_tokens) for c in _split(capacity)]
        policies = _split(policy)
        if belady and source.kind != "tokens" and BELADY not in policies and not counts:
            policies.append(BELADY)
        cost = PrefillCost(linear=cost_linear, quadratic=cost_quadratic)
        hierarchies: list[str | None] = [None] if tiers is None else list(parse_hierarchies(tiers))
        specs: list[Any] = [
            RunSpec(
                source=source,
                config=config_data,
                policy=p,
                capacity_tokens=c,
                page_size=page_size,
                timing=timing,
                cache_output=insert == "prompt+output",
                cost=cost,
                tiers=h,
            )
            for c in capacities
            for h in hierarchies
            for p in (policies if h is None or h.strip().lower() == NO_TIERS else
                      [q for q in policies if q != BELADY])
        ]  # fmt: skip
        if tiers is not None and combined and not counts:  # one device tier as large as each
            specs += [
                specs[0].model_copy(
                    update={"capacity_tokens": total, "tiers": None, "policy": policies[0]}
                )
                for total in sorted(
                    {c + combined_tokens(h, c) for c in capacities for h in hierarchies}
                    - set(capacities)
                )
            ]
        if counts:
            specs = _cluster_specs(specs, counts, routers, options, seed)
        elif baseline:
            specs += [
                s.model_copy(update={"eviction": "full"}) for s in specs if s.policy == policies[0]
            ]
        for s in specs[:1]:  # names and options are checked before any worker starts
            check_names(s.run if isinstance(s, ClusterSpec) else s, policies)
        for s in specs:
            if isinstance(s, ClusterSpec):
                make_router(s.router, s.instances, 1, s.seed, s.router_options)
    except (
        SimulationError,
        TraceError,
        ConfigError,
        UnknownComponentError,
        ValidationError,
    ) as exc:
        raise fail(exc, EXIT_BAD_CONFIG, debug) from None
    except OSError as exc:
        raise fail(exc, EXIT_BAD_CONFIG, debug) from None

    if summary.skipped:
        err.print(f"skipped {len(summary.skipped)} malformed line(s); first: {summary.skipped[0]}")
    results: list[Any] = []
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task("simulating", total=len(specs))
        try:
            results = run_grid(
                specs,
                jobs=jobs,
                on_result=lambda r: progress.advance(task),
                executor="ray" if executor == "ray" else "local",
                address=ray_address,
            )
        except (SimulationError, TraceError) as exc:
            raise fail(exc, EXIT_BAD_CONFIG, debug) from None
    title = (
        f"{source.name}: {summary.requests:,} requests, {summary.prompt_tokens:,} prompt tokens "
        f"({summary.unique_tokens:,} unique), {timing} timing"
    )
    wide = Console(soft_wrap=True, width=None if out.is_terminal else 160)
    if counts:
        results = [as_single(r) if isinstance(r, RunResult) else r for r in results]
        wide.print(cluster_table(results, title))
    else:
        wide.print(results_table(results, title))
    meta = {
        "trace": source.name,
        "requests": summary.requests,
        "prompt_tokens": summary.prompt_tokens,
        "unique_tokens": summary.unique_tokens,
        "skipped_lines": len(summary.skipped),
        "timing": timing,
        "insert": insert,
        "cost": cost.model_dump(),
    }
    if counts:
        meta.update(instances=counts, routers=routers, router_options=options, seed=seed)
    if json_path:
        write_json(results, json_path, meta)
    if csv_path:
        (write_cluster_csv if counts else write_csv)(results, csv_path)
    if plot_path:
        try:
            if counts:
                write_cluster_plot(results, plot_path, title=source.name)
            elif tiers is not None:
                write_tier_plot(results, plot_path, title=source.name)
            else:
                write_plot(results, plot_path, title=source.name)
        except PlotUnavailable as exc:
            raise fail(exc, EXIT_BAD_CONFIG, debug) from None
