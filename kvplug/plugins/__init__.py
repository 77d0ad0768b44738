"""kvplug's own default plugins, registered before any entry-point plugin.

Each module is a pluggy plugin (module-level ``@hookimpl`` functions).
"""

BUILTIN_PLUGINS: tuple[str, ...] = (
    "kvplug.plugins.allocators",
    "kvplug.plugins.caches",
    "kvplug.plugins.policies",
    "kvplug.plugins.tiers",
)
"""Module names of the built-in plugins; each is registered under its own module name."""
