"""Loading a :class:`KVCacheConfig` from a dict, a TOML or JSON file, and ``KVPLUG_*`` variables.

Precedence, lowest first: the model's defaults, the dict or file, the environment. The file's
top level holds the config fields; in a ``pyproject.toml`` they live under ``[tool.kvplug]``.

Environment variables:

* ``KVPLUG_ALLOCATOR``, ``KVPLUG_PREFIX_CACHE``, ``KVPLUG_EVICTION_POLICY`` — a component name, or
  a JSON object ``{"name": ..., "options": {...}}``;
* ``KVPLUG_ALLOCATOR_OPTIONS`` (and ``_PREFIX_CACHE_``, ``_EVICTION_POLICY_``) — a JSON object
  merged over that component's options;
* ``KVPLUG_POOL_<FIELD>`` — one pool field, e.g. ``KVPLUG_POOL_CAPACITY_TOKENS=4096``,
  ``KVPLUG_POOL_DEVICE=cpu`` (values are parsed as JSON when they parse, else kept as text).

Only structure is validated here; each component's options are validated by its plugin's own
model when the registry resolves the config.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvplug_hookspecs import KVCacheConfig, PoolGeometry

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "config_from_env",
    "load_config",
    "read_config_file",
    "variable_for",
]

_SELECTIONS = ("allocator", "prefix_cache", "eviction_policy")


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a ``.toml`` or ``.json`` config file into a plain dict.

    Every failure is a one-line :class:`ConfigError` naming the file, so the CLI never shows a
    traceback for a path that is missing, a directory, unreadable or malformed.
    """
    path = Path(path)
    where = f"config file {str(path)!r}"
    if path.is_dir():
        raise ConfigError(f"{where} is a directory, not a file")
    if not path.exists():
        raise ConfigError(f"{where} does not exist")
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"{where}: unsupported suffix {suffix!r}; use .toml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not valid UTF-8: {exc}") from exc
    try:
        data: Any = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where} is not valid {suffix[1:].upper()}: {exc}") from exc
    if path.name == "pyproject.toml":
        # A pyproject without the table is most likely the wrong file: never silent defaults.
        tool = data.get("tool")
        if not isinstance(tool, dict) or "kvplug" not in tool:
            raise ConfigError(f"{where} has no [tool.kvplug] table")
        data = tool["kvplug"]
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold an object at the top level")
    return data


def _parse_env_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The config fields set by ``KVPLUG_*`` variables, as a partial dict."""
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    for field in _SELECTIONS:
        var = f"KVPLUG_{field.upper()}"
        if var in env:
            value = _parse_env_value(env[var])
            if not isinstance(value, (str, dict)):
                raise ConfigError(f"{var}={env[var]!r}: expected a name or a JSON object")
            data[field] = value if isinstance(value, dict) else {"name": value}
        options_var = f"{var}_OPTIONS"
        if options_var in env:
            options = _parse_env_value(env[options_var])
            if not isinstance(options, dict):
                raise ConfigError(f"{options_var}={env[options_var]!r}: expected a JSON object")
            data.setdefault(field, {})["options"] = options
    pool_fields = set(PoolGeometry.model_fields)
    for var, raw in env.items():
        if not var.startswith("KVPLUG_POOL_"):
            continue
        field = var.removeprefix("KVPLUG_POOL_").lower()
        if field not in pool_fields:
            raise ConfigError(
                f"unknown variable {var}; pool fields are: "
                + ", ".join(f"KVPLUG_POOL_{name.upper()}" for name in sorted(pool_fields))
            )
        value = _parse_env_value(raw)
        data.setdefault("pool", {})[field] = raw if field in ("device", "dtype") else value
    return data


def _env_sources(environ: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """Which ``KVPLUG_*`` variable set which config field, by the field's location."""
    sources: dict[tuple[str, ...], str] = {}
    for field in _SELECTIONS:
        var = f"KVPLUG_{field.upper()}"
        if var in environ:  # a bare name sets only the name; a JSON object may set options too
            whole = isinstance(_parse_env_value(environ[var]), dict)
            sources[(field,) if whole else (field, "name")] = var
        if f"{var}_OPTIONS" in environ:
            sources[(field, "options")] = f"{var}_OPTIONS"
    for var in environ:
        if var.startswith("KVPLUG_POOL_"):
            sources[("pool", var.removeprefix("KVPLUG_POOL_").lower())] = var
    return sources


def variable_for(
    loc: tuple[str | int, ...], environ: Mapping[str, str] | None = None
) -> str | None:
    """The ``KVPLUG_*`` variable that set the config field at ``loc``, or ``None``.

    Errors found after loading (an unknown component name, a plugin's option) use this too, so
    a user is told the variable they set, not only a field they may not know it feeds.
    """
    env = os.environ if environ is None else environ
    sources = _env_sources(env)
    path = tuple(str(part) for part in loc)
    for prefix in sorted(sources, key=len, reverse=True):
        if path[: len(prefix)] == prefix:
            return sources[prefix]
    return None


def _blame_variable(exc: ValidationError, environ: Mapping[str, str]) -> ConfigError | None:
    """A :class:`ConfigError` naming the variable behind the first error a variable caused."""
    for error in exc.errors():
        var = variable_for(error["loc"], environ)
        if var is not None:
            loc = ".".join(str(part) for part in error["loc"])
            return ConfigError(f"{var}={environ[var]!r} is invalid: {loc}: {error['msg']}")
    return None


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base`` (a bare name replaces a selection)."""
    merged = dict(base)
    for key, value in override.items():
        current = merged.get(key)
        if key in _SELECTIONS and isinstance(current, str):
            current = {"name": current}
        if isinstance(current, dict) and isinstance(value, dict):
            merged[key] = _merge(current, value)
        else:
            merged[key] = value
    return merged


def _selection_name(value: Any) -> Any:
    """The name a selection value gives, or ``None`` (it may be any type: validated later)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return value.get("name")
    return None


def load_config(
    source: KVCacheConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    use_env: bool = True,
) -> KVCacheConfig:
    """Build a :class:`KVCacheConfig` from a dict, a file path or nothing, then the environment.

    A selection set by the environment to a different name drops the file's options for it.
    Raises :class:`ConfigError` for unreadable input or an invalid ``KVPLUG_*`` variable (the
    message names the variable) and ``pydantic.ValidationError`` (naming the field) for invalid
    values of the dict or file.
    """
    if isinstance(source, KVCacheConfig):
        data: dict[str, Any] = source.model_dump()
    elif source is None:
        data = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        data = read_config_file(source)
    else:
        raise TypeError(f"cannot load a config from {type(source).__name__}")
    env: Mapping[str, str] = {}
    if use_env:
        env = os.environ if environ is None else environ
        overrides = config_from_env(env)
        for field in _SELECTIONS:
            new = overrides.get(field, {})
            if "name" in new and new["name"] != _selection_name(data.get(field)):
                data.pop(field, None)  # a different component: the old options do not apply
        data = _merge(data, overrides)
    try:
        return KVCacheConfig.model_validate(data)
    except ValidationError as exc:
        blamed = _blame_variable(exc, env)
        if blamed is None:
            raise
        raise blamed from exc
