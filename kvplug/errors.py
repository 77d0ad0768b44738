"""Every error kvplug raises on purpose derives from :class:`KvplugError` (conda's model).

Callers catch one root; each subclass says what went wrong and, where a CLI maps it to an exit
code, which one. Validation errors of Pydantic models (``pydantic.ValidationError``) stay what
they are: they name the field and are what plugin authors already know.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection

__all__ = [
    "ConfigError",
    "DuplicateComponentError",
    "KvplugError",
    "PluginError",
    "PolicyError",
    "UnknownComponentError",
]


class KvplugError(Exception):
    """The root of every error kvplug raises on purpose."""


class ConfigError(KvplugError, ValueError):
    """A config file or variable that cannot be read (CLI exit code 2)."""


class PluginError(KvplugError):
    """A plugin could not be loaded or conflicts with another (CLI exit code 3)."""


class PolicyError(PluginError):
    """An eviction policy raised (or broke its contract) inside a cache operation; the cache
    and allocator were restored to their state before the call. ``__cause__`` is the error."""


class DuplicateComponentError(PluginError):
    """Two plugins registered the same component name (or alias) of one kind."""


class UnknownComponentError(KvplugError, LookupError):
    """A config names a component no plugin provides; the message lists every valid name."""

    def __init__(
        self,
        label: str,
        label_plural: str,
        name: str,
        valid: Collection[str],
        failed: Collection[str] = (),
    ) -> None:
        self.label, self.name, self.valid = label, name, sorted(valid)
        close = difflib.get_close_matches(name, self.valid, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        broken = (
            f" (plugins that failed to load: {', '.join(sorted(failed))}; see `kvplug plugins`)"
            if failed
            else ""
        )
        super().__init__(
            f"unknown {label} {name!r}.{hint} Valid {label_plural}: "
            f"{', '.join(self.valid) or '(none registered)'}{broken}"
        )

    def __str__(self) -> str:  # LookupError would repr() the message
        return str(self.args[0])
