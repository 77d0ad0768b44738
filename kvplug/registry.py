"""The plugin registry: built-in plugins first, then entry points of group ``kvplug``.

A small subclass of ``pluggy.PluginManager`` (tox's ``plugin/manager.py`` is the model). It is
used at start-up only: it discovers plugins, collects their registrations, checks names for
clashes, resolves a config's names and validates their options. ``kvplug.build`` asks it once;
after that nothing here is on the engine's path.

Environment (read by :func:`PluginRegistry.load_plugins` when no keyword overrides it):

* ``KVPLUG_DISABLE_PLUGIN_AUTOLOAD`` — a boolean (``1/true/yes/on`` or ``0/false/no/off``): skip
  entry-point plugins entirely (built-ins still load).
* ``KVPLUG_PLUGINS=a,b`` — allow-list of entry-point names; set but empty allows none.
* ``KVPLUG_BLOCK_PLUGINS=a,b`` — block-list of plugin names (entry-point or built-in module).
* ``KVPLUG_STRICT_PLUGINS`` — a boolean: a broken plugin raises :class:`PluginError` instead of
  being reported in :attr:`PluginRegistry.failures`.
"""

from __future__ import annotations

import difflib
import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import import_module, metadata
from typing import Any, Literal, overload

import pluggy
from pydantic import BaseModel, ValidationError

from kvplug_hookspecs import (
    PROJECT_NAME,
    AllocatorRegistration,
    ComponentRegistration,
    ComponentSelection,
    EvictionPolicy,
    EvictionPolicyRegistration,
    KVCacheConfig,
    PrefixCacheRegistration,
    StorageTierRegistration,
    hookspecs,
)

from .errors import DuplicateComponentError, PluginError, UnknownComponentError
from .events import HookEvents
from .plugins import BUILTIN_PLUGINS

__all__ = [
    "ALL_KINDS",
    "COMPONENT_KINDS",
    "STORAGE_TIER_KIND",
    "ComponentKind",
    "DuplicateComponentError",
    "PluginError",
    "PluginFailure",
    "PluginInfo",
    "PluginRegistry",
    "ResolvedComponent",
    "ResolvedConfig",
    "UnknownComponentError",
    "env_flag",
    "get_registry",
    "reset_registry",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT_NAME


# -------------------------------------------------------------------------------------------
# Records
# -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComponentKind:
    """One kind of component: its config field, hook and registration class."""

    field: str
    label: str
    label_plural: str
    hook: str
    registration: type[ComponentRegistration]


COMPONENT_KINDS: tuple[ComponentKind, ...] = (
    ComponentKind(
        "allocator", "allocator", "allocators", "kvplug_allocators", AllocatorRegistration
    ),
    ComponentKind(
        "prefix_cache",
        "prefix cache",
        "prefix caches",
        "kvplug_prefix_caches",
        PrefixCacheRegistration,
    ),
    ComponentKind(
        "eviction_policy",
        "eviction policy",
        "eviction policies",
        "kvplug_eviction_policies",
        EvictionPolicyRegistration,
    ),
)
"""The kinds a config selects exactly one of."""
STORAGE_TIER_KIND = ComponentKind(
    "storage_tier",
    "storage tier",
    "storage tiers",
    "kvplug_storage_tiers",
    StorageTierRegistration,
)
"""Storage tiers: a config lists any number, in order, under ``storage.tiers``."""
ALL_KINDS: tuple[ComponentKind, ...] = (*COMPONENT_KINDS, STORAGE_TIER_KIND)
_KIND_BY_FIELD = {kind.field: kind for kind in ALL_KINDS}


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that failed; the others loaded. ``stage`` says where it broke."""

    name: str
    distribution: str | None
    version: str | None
    stage: str
    error: str
    exception: BaseException = field(repr=False, compare=False)

    def describe(self) -> str:
        """One line naming the plugin, its distribution and the error."""
        dist = f" (distribution {self.distribution} {self.version})" if self.distribution else ""
        return f"plugin {self.name!r}{dist} failed at {self.stage}: {self.error}"


@dataclass(frozen=True)
class PluginInfo:
    """A loaded plugin: who ships it, and which components it provides, by kind field."""

    name: str
    distribution: str | None
    version: str | None
    builtin: bool
    provides: dict[str, tuple[str, ...]]
    hooks: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResolvedComponent:
    """A selected component: its registration and its validated options instance."""

    registration: ComponentRegistration
    options: BaseModel


def new_policy_factory(resolved: ResolvedComponent) -> Callable[[], EvictionPolicy]:
    """Fresh instances of a resolved eviction policy (options validated once, at resolve): a
    cache with two evictable sets, like ``swa_radix``, calls it twice."""
    registration, options = resolved.registration, resolved.options

    def new_policy() -> EvictionPolicy:
        policy: EvictionPolicy = registration.factory(options)
        return policy

    return new_policy


@dataclass(frozen=True)
class ResolvedConfig:
    """A config whose names were found and whose options passed the plugins' models."""

    config: KVCacheConfig
    allocator: ResolvedComponent
    prefix_cache: ResolvedComponent
    eviction_policy: ResolvedComponent
    storage_tiers: tuple[ResolvedComponent, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The config with canonical names and every option default filled in."""
        data = self.config.model_dump(mode="json")
        for kind in COMPONENT_KINDS:
            part: ResolvedComponent = getattr(self, kind.field)
            data[kind.field] = {
                "name": part.registration.name,
                "options": part.options.model_dump(mode="json"),
            }
        data["storage"]["tiers"] = [
            {"name": t.registration.name, "options": t.options.model_dump(mode="json")}
            for t in self.storage_tiers
        ]
        return data


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Read a boolean environment variable; anything but a known spelling is an error."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use 1/true/yes/on or 0/false/no/off")


def _env_list(name: str, environ: Mapping[str, str]) -> list[str] | None:
    """A comma-separated list, or ``None`` when the variable is unset."""
    if name not in environ:
        return None
    return [part.strip() for part in environ[name].split(",") if part.strip()]


# -------------------------------------------------------------------------------------------
# The registry
# -------------------------------------------------------------------------------------------


class PluginRegistry(pluggy.PluginManager):
    """kvplug's plugin manager: discovery, failure isolation, name resolution.

    ``strict=True`` turns every plugin failure into a :class:`PluginError`.
    """

    def __init__(self, *, strict: bool = False) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.strict = strict
        self.failures: list[PluginFailure] = []
        self.skipped: dict[str, str] = {}
        self._distributions: dict[str, tuple[str | None, str | None]] = {}
        self._builtin_names: set[str] = set()
        self._collected: dict[str, dict[str, tuple[str, ComponentRegistration]]] | None = None

    # --- loading ---------------------------------------------------------------------------

    def register(self, plugin: object, name: str | None = None) -> str | None:
        self._collected = None
        return super().register(plugin, name)

    def unregister(self, plugin: object | None = None, name: str | None = None) -> Any:
        self._collected = None
        return super().unregister(plugin, name)

    def _fail(
        self,
        name: str,
        stage: str,
        exc: BaseException,
        distribution: tuple[str | None, str | None] = (None, None),
    ) -> None:
        failure = PluginFailure(name, *distribution, stage, f"{type(exc).__name__}: {exc}", exc)
        if self.strict:
            raise PluginError(failure.describe()) from exc
        log.warning("%s", failure.describe())
        self.failures.append(failure)

    def load_builtins(self) -> None:
        """Register kvplug's own plugins (each under its module name) unless blocked."""
        version = _distribution_version("kvplug")
        for module_name in BUILTIN_PLUGINS:
            if self.is_blocked(module_name) or self.has_plugin(module_name):
                continue
            try:
                self.register(import_module(module_name), name=module_name)
            except Exception as exc:  # a broken built-in must not hide the rest either
                self._fail(module_name, "import", exc, ("kvplug", version))
                continue
            self._distributions[module_name] = ("kvplug", version)
            self._builtin_names.add(module_name)

    def load_entrypoints(self, *, allow: Collection[str] | None = None) -> None:
        """Load entry points of group ``kvplug``; ``allow`` (if given) is an allow-list."""
        seen: set[str] = set()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(ep.name)
            dist = (ep.dist.name, ep.dist.version) if ep.dist is not None else (None, None)
            if self.is_blocked(ep.name):
                self.skipped[ep.name] = "blocked"
                continue
            if allow is not None and ep.name not in allow:
                self.skipped[ep.name] = "not in KVPLUG_PLUGINS"
                continue
            if self.has_plugin(ep.name):
                continue
            try:
                plugin = ep.load()
            except Exception as exc:
                self._fail(ep.name, f"import of {ep.value!r}", exc, dist)
                continue
            try:
                self.register(plugin, name=ep.name)
            except Exception as exc:
                self._fail(ep.name, "registration", exc, dist)
                continue
            self._distributions[ep.name] = dist
        self._drop_unknown_hooks()

    def load_plugins(
        self,
        *,
        autoload: bool | None = None,
        allow: Collection[str] | None = None,
        block: Iterable[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> PluginRegistry:
        """Built-ins, then entry points, honouring the ``KVPLUG_*`` variables (keywords win)."""
        env = os.environ if environ is None else environ
        if block is None:
            block = _env_list("KVPLUG_BLOCK_PLUGINS", env) or ()
        for name in block:
            self.set_blocked(name)
        self.load_builtins()
        if autoload is None:
            autoload = not env_flag("KVPLUG_DISABLE_PLUGIN_AUTOLOAD", env)
        if autoload:
            self.load_entrypoints(
                allow=allow if allow is not None else _env_list("KVPLUG_PLUGINS", env)
            )
        self.collect()  # registration hooks run now, so failures surface at start-up
        return self

    def _drop_unknown_hooks(self) -> None:
        """Catch misspelt hookimpls: unregister their plugin and report it, then check_pending."""
        spec_names = sorted(name for name, caller in vars(self.hook).items() if _has_spec(caller))
        for hook_name, caller in list(vars(self.hook).items()):
            if not isinstance(caller, pluggy.HookCaller) or caller.has_spec():
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                close = difflib.get_close_matches(hook_name, spec_names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                error = pluggy.PluginValidationError(
                    impl.plugin, f"unknown hook {hook_name!r} in plugin {impl.plugin_name!r}{hint}"
                )
                dist = self._distributions.pop(impl.plugin_name, (None, None))
                if self.is_registered(impl.plugin):
                    self.unregister(impl.plugin)
                self._fail(impl.plugin_name, "validation", error, dist)
        self.check_pending()

    # --- components ------------------------------------------------------------------------

    def collect(self) -> dict[str, dict[str, tuple[str, ComponentRegistration]]]:
        """Run the registration hooks once: ``{kind field: {name or alias: (plugin, reg)}}``.

        Each plugin's hookimpl is called on its own, so one that raises or returns the wrong
        type is reported (or raised in strict mode) without losing the others' components.
        """
        if self._collected is not None:
            return self._collected
        collected: dict[str, dict[str, tuple[str, ComponentRegistration]]] = {}
        for kind in ALL_KINDS:
            by_name: dict[str, tuple[str, ComponentRegistration]] = {}
            for impl in getattr(self.hook, kind.hook).get_hookimpls():
                if impl.hookwrapper or impl.wrapper:
                    continue
                registrations = self._call_registration_hook(kind, impl)
                for registration in registrations:
                    for name in registration.names:
                        if name in by_name:
                            other = by_name[name][0]
                            raise DuplicateComponentError(
                                f"{kind.label} {name!r} is provided by two plugins: "
                                f"{self._describe(other)} and {self._describe(impl.plugin_name)}; "
                                f"uninstall one or block it with KVPLUG_BLOCK_PLUGINS="
                                f"{impl.plugin_name}"
                            )
                        by_name[name] = (impl.plugin_name, registration)
            collected[kind.field] = by_name
        self._collected = collected
        return collected

    def _call_registration_hook(
        self, kind: ComponentKind, impl: pluggy.HookImpl
    ) -> list[ComponentRegistration]:
        dist = self._distributions.get(impl.plugin_name, (None, None))
        try:
            result: Any = impl.function()
            registrations = list(result) if result is not None else []
            for item in registrations:
                if not isinstance(item, kind.registration):
                    raise TypeError(
                        f"{kind.hook}() returned {item!r}; expected {kind.registration.__name__}"
                    )
        except Exception as exc:
            self._fail(impl.plugin_name, f"hook {kind.hook}()", exc, dist)
            return []
        return registrations

    def _describe(self, plugin_name: str) -> str:
        dist, version = self._distributions.get(plugin_name, (None, None))
        return f"{plugin_name!r} ({dist} {version})" if dist else repr(plugin_name)

    def registrations(self, kind_field: str) -> list[ComponentRegistration]:
        """The distinct registrations of one kind, sorted by name."""
        unique = {id(reg): reg for _, reg in self.collect()[kind_field].values()}
        return sorted(unique.values(), key=lambda reg: reg.name)

    def provider(self, kind_field: str, name: str) -> str:
        """The plugin name that provides component ``name`` of a kind."""
        return self.collect()[kind_field][name][0]

    @overload
    def get(self, kind_field: Literal["allocator"], name: str) -> AllocatorRegistration: ...
    @overload
    def get(self, kind_field: Literal["prefix_cache"], name: str) -> PrefixCacheRegistration: ...
    @overload
    def get(
        self, kind_field: Literal["eviction_policy"], name: str
    ) -> EvictionPolicyRegistration: ...
    @overload
    def get(self, kind_field: Literal["storage_tier"], name: str) -> StorageTierRegistration: ...
    @overload
    def get(self, kind_field: str, name: str) -> ComponentRegistration: ...
    def get(self, kind_field: str, name: str) -> ComponentRegistration:
        """The registration called ``name`` (or aliased so); unknown names list the valid ones.

        Typed per kind (conda's ``get_hook_results`` does the same): ``get("allocator", ...)``
        is an :class:`AllocatorRegistration`, so a checker follows ``.factory(...)``.
        """
        kind = _KIND_BY_FIELD[kind_field]
        table = self.collect()[kind_field]
        key = name.strip().lower()
        if key not in table:
            raise UnknownComponentError(
                kind.label, kind.label_plural, name, table, {f.name for f in self.failures}
            )
        return table[key][1]

    def resolve(
        self,
        kind_field: str,
        selection: ComponentSelection,
        loc: tuple[str | int, ...] | None = None,
    ) -> ResolvedComponent:
        """Find a selection's registration and validate its options with the plugin's model.

        ``loc``: where the selection sits in the config, for error messages (``(kind_field,)``).
        """
        registration = self.get(kind_field, selection.name)
        try:
            options = registration.options_model.model_validate(selection.options)
        except ValidationError as exc:
            where = (*(loc or (kind_field,)), "options")
            raise _prefixed(exc, where, title=KVCacheConfig.__name__) from None
        return ResolvedComponent(registration, options)

    def policy_factory(self, selection: ComponentSelection) -> Callable[[], EvictionPolicy]:
        """Validate an eviction-policy selection now; return a maker of fresh instances."""
        return new_policy_factory(self.resolve("eviction_policy", selection))

    def resolve_config(self, config: KVCacheConfig) -> ResolvedConfig:
        """Resolve every selection of a config (errors before anything is built)."""
        tiers = tuple(
            self.resolve("storage_tier", tier, ("storage", "tiers", i))
            for i, tier in enumerate(config.storage.tiers)
        )
        return ResolvedConfig(
            config=config,
            **{
                kind.field: self.resolve(kind.field, getattr(config, kind.field))
                for kind in COMPONENT_KINDS
            },
            storage_tiers=tiers,
        )

    def plugin_infos(self) -> list[PluginInfo]:
        """Every loaded plugin with its distribution and the components it provides."""
        collected = self.collect()
        infos = []
        for name, plugin in self.list_name_plugin():
            if name is None:
                continue
            hooks = tuple(sorted(caller.name for caller in self.get_hookcallers(plugin) or ()))
            provides = {
                kind.field: tuple(
                    sorted(
                        {
                            reg.name
                            for plugin, reg in collected[kind.field].values()
                            if plugin == name
                        }
                    )
                )
                for kind in ALL_KINDS
            }
            dist, version = self._distributions.get(name, (None, None))
            infos.append(
                PluginInfo(name, dist, version, name in self._builtin_names, provides, hooks)
            )
        return infos

    # --- observers ---------------------------------------------------------------------------

    def cache_events(self) -> HookEvents | None:
        """An event sink for caches, or ``None`` when no plugin implements an observer hook.

        Resolved once (at ``kvplug.build``): observers registered later do not see that cache.
        """
        impls = {
            name: [impl.function for impl in reversed(getattr(self.hook, name).get_hookimpls())]
            for name in ("kvplug_prefix_stored", "kvplug_prefix_removed", "kvplug_cache_cleared")
        }
        if not any(impls.values()):
            return None
        return HookEvents(
            impls["kvplug_prefix_stored"],
            impls["kvplug_prefix_removed"],
            impls["kvplug_cache_cleared"],
        )


def _has_spec(caller: object) -> bool:
    return isinstance(caller, pluggy.HookCaller) and caller.has_spec()


def _distribution_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _prefixed(exc: ValidationError, prefix: tuple[str | int, ...], title: str) -> ValidationError:
    """Re-raise a plugin options error with locations under the config field it came from."""
    line_errors = [
        {
            "type": err["type"],
            "loc": (*prefix, *err["loc"]),
            "input": err["input"],
            "ctx": err.get("ctx", {}),
        }
        for err in exc.errors()
    ]
    try:
        return ValidationError.from_exception_data(title, line_errors)  # type: ignore[arg-type]
    except Exception:  # an error type pydantic cannot rebuild: keep the original
        return exc


_registry: PluginRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> PluginRegistry:
    """The process-wide registry, loaded on first use from the environment.

    Loaded once under a lock, so threads that build stacks at the same time share one registry
    (and plugins are imported once).
    """
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = PluginRegistry(strict=env_flag("KVPLUG_STRICT_PLUGINS")).load_plugins()
        return _registry


def reset_registry() -> None:
    """Forget the process-wide registry (tests, or after installing plugins at run time)."""
    global _registry
    with _registry_lock:
        _registry = None
