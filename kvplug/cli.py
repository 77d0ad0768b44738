"""The ``kvplug`` command line: list plugins, validate and show configs.

Exit codes: 0 success, 2 a bad config (unreadable file, invalid value, unknown component name),
3 a plugin error (strict mode, conflicting names). Errors are one line on stderr; ``--debug``
shows the traceback.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from kvplug_hookspecs import KVCacheConfig
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from . import __version__
from .config import ConfigError, load_config
from .registry import (
    COMPONENT_KINDS,
    PluginError,
    PluginRegistry,
    UnknownComponentError,
    env_flag,
)

# torch warns on import when numpy is absent; kvplug never converts tensors to numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

EXIT_BAD_CONFIG = 2
EXIT_PLUGIN_ERROR = 3

app = typer.Typer(
    name="kvplug",
    help="Pluggable KV-cache memory: allocators, prefix caches and eviction policies as plugins.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Validate, show and describe engine configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

DebugOption = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]
StrictOption = Annotated[
    bool,
    typer.Option("--strict", help="Fail on any broken plugin (also KVPLUG_STRICT_PLUGINS=1)."),
]


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        parts = [
            f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
        ]
        return f"invalid config: {'; '.join(parts)}"
    return str(exc).replace("\n", " ")


def _fail(exc: BaseException, code: int, debug: bool) -> typer.Exit:
    if debug:
        err.print_exception(show_locals=False)
    err.print(f"[bold red]error:[/] {_one_line(exc)}", highlight=False, markup=True)
    return typer.Exit(code)


def _registry(strict: bool, debug: bool) -> PluginRegistry:
    try:
        strict = strict or env_flag("KVPLUG_STRICT_PLUGINS")
        return PluginRegistry(strict=strict).load_plugins()
    except PluginError as exc:
        raise _fail(exc, EXIT_PLUGIN_ERROR, debug) from None
    except ValueError as exc:  # a malformed KVPLUG_* boolean
        raise _fail(exc, EXIT_PLUGIN_ERROR, debug) from None


def _version_callback(value: bool) -> None:
    if value:
        out.print(f"kvplug {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """kvplug command line."""


@app.command("plugins")
def plugins_command(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    strict: StrictOption = False,
    debug: DebugOption = False,
) -> None:
    """List plugins, their distributions and components, and plugins that failed to load."""
    registry = _registry(strict, debug)
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
        for kind in COMPONENT_KINDS
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
            for k in COMPONENT_KINDS
            if info.provides[k.field]
        )
        table.add_row(info.name, dist, provides or "-")
    out.print(table)

    comp_table = Table(title="components", title_justify="left")
    for column in ("kind", "name", "aliases"):
        comp_table.add_column(column, no_wrap=True)
    comp_table.add_column("description")
    for kind in COMPONENT_KINDS:
        for item in components[kind.field]:
            comp_table.add_row(kind.label, item["name"], ", ".join(item["aliases"]), item["description"])
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


def _resolve_file(path: Path, strict: bool, debug: bool) -> dict[str, Any]:
    try:
        config = load_config(path)
    except (ConfigError, ValidationError) as exc:
        raise _fail(exc, EXIT_BAD_CONFIG, debug) from None
    registry = _registry(strict, debug)
    try:
        return registry.resolve_config(config).as_dict()
    except (UnknownComponentError, ValidationError) as exc:
        raise _fail(exc, EXIT_BAD_CONFIG, debug) from None


ConfigPath = Annotated[Path, typer.Argument(help="A .toml or .json config file.")]


@config_app.command("validate")
def config_validate(
    paths: Annotated[list[Path], typer.Argument(help="One or more .toml or .json config files.")],
    strict: StrictOption = False,
    debug: DebugOption = False,
) -> None:
    """Check configs: structure, component names and each plugin's options."""
    for path in paths:
        resolved = _resolve_file(path, strict, debug)
        names = ", ".join(f"{k.field}={resolved[k.field]['name']}" for k in COMPONENT_KINDS)
        out.print(f"{path}: valid ({names})", highlight=False)


@config_app.command("show")
def config_show(path: ConfigPath, strict: StrictOption = False, debug: DebugOption = False) -> None:
    """Print the resolved config as JSON: canonical names, every default filled in."""
    resolved = _resolve_file(path, strict, debug)
    sys.stdout.write(json.dumps(resolved, indent=2) + "\n")


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON schema of the engine config."""
    sys.stdout.write(json.dumps(KVCacheConfig.model_json_schema(), indent=2) + "\n")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
