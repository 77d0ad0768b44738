"""The ``kvplug`` app and what every command shares: consoles, options, one-line errors.

Exit codes: 0 success, 2 a bad config or usage (unreadable file, invalid value, unknown
component name, bad ``KVPLUG_*`` variable, missing argument, unknown option), 3 a plugin error
(strict mode, conflicting names). Errors are one line on stderr; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from .. import __version__
from ..errors import PluginError
from ..registry import PluginRegistry, env_flag

try:  # recent typer vendors click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer depends on click itself
    from click.exceptions import ClickException  # type: ignore[import-not-found,no-redef]

EXIT_BAD_CONFIG = 2
EXIT_PLUGIN_ERROR = 3


class OneLineErrorsGroup(TyperGroup):
    """The top-level command: a usage error is one line on stderr with exit 2, never a box.

    Scripts and engines read stderr; a multi-line rich panel is hard to log and to grep.
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            result = super().main(
                args,
                prog_name,
                complete_var,
                standalone_mode=False,
                windows_expand_args=windows_expand_args,
                **extra,
            )
        except ClickException as exc:
            if not standalone_mode:
                raise
            if type(exc).__name__ != "NoArgsIsHelpError":  # its help is already printed
                err.print(f"error: {usage_line(exc)}", highlight=False, markup=False)
            sys.exit(exc.exit_code)
        except typer.Abort:
            if not standalone_mode:
                raise
            err.print("error: aborted", highlight=False, markup=False)
            sys.exit(1)
        if not standalone_mode:
            return result
        # Without standalone mode typer returns the code of a ``typer.Exit`` instead of exiting.
        sys.exit(result if isinstance(result, int) else 0)


def usage_line(exc: ClickException) -> str:
    """``Missing argument 'PATHS...'. (see 'kvplug config validate --help')`` on one line."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if ctx is None:
        return message
    return f"{message} (see '{ctx.command_path} --help')"


app = typer.Typer(
    cls=OneLineErrorsGroup,
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
    # escape(): a message may hold brackets (``[tool.kvplug]``) that rich would take as markup.
    err.print(f"[bold red]error:[/] {escape(one_line(exc))}", highlight=False, markup=True)
    return typer.Exit(code)


def load_registry(strict: bool, debug: bool) -> PluginRegistry:
    try:
        strict = strict or env_flag("KVPLUG_STRICT_PLUGINS")
        return PluginRegistry(strict=strict).load_plugins()
    except PluginError as exc:
        raise fail(exc, EXIT_PLUGIN_ERROR, debug) from None
    except ValueError as exc:  # a malformed KVPLUG_* boolean: a bad setting, named in the message
        raise fail(exc, EXIT_BAD_CONFIG, debug) from None


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
