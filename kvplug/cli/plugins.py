"""``kvplug plugins``: every plugin, its distribution, its components, and what failed."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.table import Table

from ..registry import ALL_KINDS
from .app import DebugOption, StrictOption, app, load_registry, out


@app.command("plugins")
def plugins_command(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    strict: StrictOption = False,
    debug: DebugOption = False,
) -> None:
    """List plugins, their distributions and components, and plugins that failed to load."""
    registry = load_registry(strict, debug)
    infos = registry.plugin_infos()
    components = {
        kind.field: [
            {
                "name": reg.name,
                "aliases": list(reg.aliases),
                "plugin": registry.provider(kind.field, reg.name),
                "description": reg.description,
                "options": reg.options_model.model_json_schema(),
            }
            for reg in registry.registrations(kind.field)
        ]
        for kind in ALL_KINDS
    }
    if as_json:
        payload = {
            "plugins": [
                {
                    "name": info.name,
                    "distribution": info.distribution,
                    "version": info.version,
                    "builtin": info.builtin,
                    "provides": {k: list(v) for k, v in info.provides.items()},
                    "hooks": list(info.hooks),
                }
                for info in infos
            ],
            "components": components,
            "failed": [
                {
                    "name": f.name,
                    "distribution": f.distribution,
                    "version": f.version,
                    "stage": f.stage,
                    "error": f.error,
                }
                for f in registry.failures
            ],
            "skipped": [{"name": n, "reason": r} for n, r in sorted(registry.skipped.items())],
        }
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return

    table = Table(title="kvplug plugins", title_justify="left")
    table.add_column("plugin", no_wrap=True)
    table.add_column("distribution", no_wrap=True)
    table.add_column("provides")
    for info in infos:
        dist = f"{info.distribution} {info.version}" if info.distribution else "-"
        provides = "\n".join(
            f"{k.label_plural}: {', '.join(info.provides[k.field])}"
            for k in ALL_KINDS
            if info.provides[k.field]
        )
        table.add_row(info.name, dist, provides or "-")
    out.print(table)

    comp_table = Table(title="components", title_justify="left")
    for column in ("kind", "name", "aliases"):
        comp_table.add_column(column, no_wrap=True)
    comp_table.add_column("description")
    for kind in ALL_KINDS:
        for item in components[kind.field]:
            comp_table.add_row(
                kind.label, str(item["name"]), ", ".join(item["aliases"]), str(item["description"])
            )
    out.print(comp_table)

    if registry.failures:
        failed = Table(title="failed plugins", title_justify="left", style="red")
        for column in ("plugin", "distribution", "stage"):
            failed.add_column(column, no_wrap=True)
        failed.add_column("error")
        for f in registry.failures:
            dist = f"{f.distribution} {f.version}" if f.distribution else "-"
            failed.add_row(f.name, dist, f.stage, f.error)
        out.print(failed)
    if registry.skipped:
        out.print(
            "skipped: " + ", ".join(f"{n} ({r})" for n, r in sorted(registry.skipped.items())),
            highlight=False,
        )
