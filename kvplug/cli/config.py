"""``kvplug config validate|show|schema``: check and explain engine configs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.markup import escape

from kvplug_hookspecs import KVCacheConfig

from ..config import load_config, variable_for
from ..errors import ConfigError, UnknownComponentError
from ..pools import resolve_device
from ..registry import COMPONENT_KINDS
from .app import (
    EXIT_BAD_CONFIG,
    DebugOption,
    StrictOption,
    config_app,
    err,
    fail,
    load_registry,
    one_line,
    out,
)


def _load_file(path: Path, debug: bool) -> KVCacheConfig:
    try:
        return load_config(path)
    except (ConfigError, ValidationError) as exc:
        raise fail(exc, EXIT_BAD_CONFIG, debug) from None


def _resolve(config: KVCacheConfig, strict: bool, debug: bool) -> dict[str, Any]:
    registry = load_registry(strict, debug)
    try:
        return registry.resolve_config(config).as_dict()
    except (UnknownComponentError, ValidationError) as exc:
        raise fail(_name_the_variable(exc), EXIT_BAD_CONFIG, debug) from None


def _name_the_variable(exc: UnknownComponentError | ValidationError) -> Exception:
    """The error, with the ``KVPLUG_*`` variable behind it named when one is."""
    if isinstance(exc, ValidationError):
        locs = [error["loc"] for error in exc.errors()]
    else:
        locs = [(kind.field, "name") for kind in COMPONENT_KINDS if kind.label == exc.label]
    for loc in locs:
        var = variable_for(loc)
        if var is not None:
            return ConfigError(f"{one_line(exc)} (set by {var}={os.environ[var]!r})")
    return exc


def _resolve_file(path: Path, strict: bool, debug: bool) -> dict[str, Any]:
    return _resolve(_load_file(path, debug), strict, debug)


def device_problem(device: str) -> str | None:
    """Why this machine cannot use ``device``, or ``None`` when it can.

    A config written for a GPU server is still valid on a laptop, so this is a warning unless
    ``--strict`` asks for the config to be usable here.
    """
    try:
        resolve_device(device)
    except ValueError as exc:
        return str(exc)
    return None


ConfigPath = Annotated[Path, typer.Argument(help="A .toml or .json config file.")]


@config_app.command("validate")
def config_validate(
    paths: Annotated[list[Path], typer.Argument(help="One or more .toml or .json config files.")],
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Fail on any broken plugin (also KVPLUG_STRICT_PLUGINS=1) and on a device "
            "this machine does not have.",
        ),
    ] = False,
    debug: DebugOption = False,
) -> None:
    """Check configs: structure, component names, each plugin's options, the device."""
    for path in paths:
        config = _load_file(path, debug)
        resolved = _resolve(config, strict, debug)
        problem = device_problem(config.pool.device)
        if problem is not None:
            message = f"{path}: {problem}"
            if strict:
                raise fail(ConfigError(message), EXIT_BAD_CONFIG, debug)
            err.print(f"warning: {escape(message)}", highlight=False)
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
