"""The ``kvplug`` app and what every command shares: consoles, options, one-line errors.

Exit codes: 0 success, 2 a bad config (unreadable file, invalid value, unknown component name),
3 a plugin error (strict mode, conflicting names). Errors are one line on stderr; ``--debug``
shows the traceback.
"""

from __future__ import annotations

import warnings
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from .. import __version__
from ..errors import PluginError
from ..registry import PluginRegistry, env_flag

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


def one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        parts = [
            f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
        ]
        return f"invalid config: {'; '.join(parts)}"
    return str(exc).replace("\n", " ")


def fail(exc: BaseException, code: int, debug: bool) -> typer.Exit:
    if debug:
        err.print_exception(show_locals=False)
    err.print(f"[bold red]error:[/] {one_line(exc)}", highlight=False, markup=True)
    return typer.Exit(code)


def load_registry(strict: bool, debug: bool) -> PluginRegistry:
    try:
        strict = strict or env_flag("KVPLUG_STRICT_PLUGINS")
        return PluginRegistry(strict=strict).load_plugins()
    except PluginError as exc:
        raise fail(exc, EXIT_PLUGIN_ERROR, debug) from None
    except ValueError as exc:  # a malformed KVPLUG_* boolean
        raise fail(exc, EXIT_PLUGIN_ERROR, debug) from None


def _version_callback(value: bool) -> None:
    if value:
        out.print(f"kvplug {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Show the version."
        ),
    ] = False,
) -> None:
    """kvplug command line."""
