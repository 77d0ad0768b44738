"""``kvplug config validate|show|schema``: check and explain engine configs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from kvplug_hookspecs import KVCacheConfig

from ..config import load_config
from ..errors import ConfigError, UnknownComponentError
from ..registry import COMPONENT_KINDS
from .app import (
    EXIT_BAD_CONFIG,
    DebugOption,
    StrictOption,
    config_app,
    fail,
    load_registry,
    out,
)


def _resolve_file(path: Path, strict: bool, debug: bool) -> dict[str, Any]:
    try:
        config = load_config(path)
    except (ConfigError, ValidationError) as exc:
        raise fail(exc, EXIT_BAD_CONFIG, debug) from None
    registry = load_registry(strict, debug)
    try:
        return registry.resolve_config(config).as_dict()
    except (UnknownComponentError, ValidationError) as exc:
        raise fail(exc, EXIT_BAD_CONFIG, debug) from None


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
