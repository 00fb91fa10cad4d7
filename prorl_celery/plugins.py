"""Plug-in families: classes named by a short name or a dotted path in a request.

Three families use this (a data source's handler, a sandbox runtime, an LLM protocol's client),
each through one :class:`Registry`: known names and their aliases map to dotted paths, an unknown
name gets an error that lists the known ones, and a dotted path is loaded only from the service's
own packages and the packages the operator lists in ``PRORL_PLUGIN_PACKAGES``, and only if its
source shows a class with what the family requires (read before anything is imported: never a
``__main__`` module). A request must not be able to make the service import, let alone call, whatever it
names: a data source of ``os:abort`` would otherwise take down the API process that checks it.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping

from prorl_celery.errors import UnknownPlugin
from prorl_celery.plugin_source import class_members

BUILTIN_PACKAGES = ("tasks", "sandboxes")


def is_dotted_path(name: str) -> bool:
    return ":" in name or "." in name


def split_path(path: str) -> tuple[str, str]:
    """``pkg.mod:Class`` or ``pkg.mod.Class`` -> (module, attribute)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return module, attr


def allowed_packages() -> list[str]:
    from config.settings import get_settings

    extra = [p.strip() for p in get_settings().plugin_packages.split(",") if p.strip()]
    return [*BUILTIN_PACKAGES, *extra]


def load_class(path: str, what: str, trusted: bool = False, required: tuple[str, ...] = ()) -> type:
    """The class at ``path``; :class:`UnknownPlugin` (saying why) for anything else. Unless the
    path is ``trusted`` (one of a registry's own entries), its module must be in an allowed
    package, and its source must show a class that defines or inherits every name of
    ``required`` (:mod:`prorl_celery.plugin_source`) before the module is imported."""
    module, attr = split_path(path)
    packages = allowed_packages()
    if not trusted and not any(module == p or module.startswith(f"{p}.") for p in packages):
        raise UnknownPlugin(f"{what} {path!r}: module {module!r} is in none of the allowed packages "
                            f"({', '.join(packages)}); an operator adds a package with PRORL_PLUGIN_PACKAGES")
    if not trusted:
        missing = sorted(set(required) - class_members(module, attr, what))
        if missing:
            raise UnknownPlugin(f"{what} {path!r}: its source shows no {', '.join(missing)} on the class "
                                "(defined in it or in a base class found in source), so it is not imported")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever its import raises refuses it
        raise UnknownPlugin(f"cannot load {what} {path!r}: {type(exc).__name__}: {exc}") from None
    if not inspect.isclass(found):
        raise UnknownPlugin(f"{what} {path!r} is not a class")
    return found


Check = Callable[[type], None]


class Registry:
    """One family of plug-ins: ``what`` names it in errors (``"handler"``), ``entries`` maps each
    short name to the dotted path of its class (imported on first use), ``aliases`` maps other
    names to short names, and ``check`` (a conformance check raising :class:`UnknownPlugin`) runs
    on every class loaded, built-in or the operator's."""

    def __init__(self, what: str, entries: Mapping[str, str], aliases: Mapping[str, str] | None = None,
                 check: Check | None = None, paths: bool = True, required: tuple[str, ...] = ()):
        self.what = what
        self.required = required  # what a dotted path's class must show in its source to be imported
        self.entries = dict(entries)
        self.aliases = dict(aliases or {})
        self.check = check
        self.paths = paths  # whether a dotted path outside the entries may be named at all

    def known(self) -> list[str]:
        return sorted([*self.entries, *self.aliases])

    def canonical(self, name: str) -> str:
        """The short name behind an alias (a name that is neither is returned as it is)."""
        return self.aliases.get(name, name)

    def path_of(self, name: str) -> str:
        """The dotted path ``name`` stands for; an unknown name lists the known ones."""
        short = self.canonical(name)
        if short in self.entries:
            return self.entries[short]
        if self.paths and is_dotted_path(short):
            return short
        hint = ", or a dotted path" if self.paths else ""
        raise UnknownPlugin(f"unknown {self.what} {name!r}; known: {', '.join(self.known())}{hint}")

    def load(self, name: str) -> type:
        """The class ``name`` stands for, checked."""
        path = self.path_of(name)
        try:
            cls = load_class(path, self.what, trusted=path in self.entries.values(), required=self.required)
        except UnknownPlugin as exc:
            raise UnknownPlugin(f"{exc}; known: {', '.join(self.known())}") from None
        if self.check is not None:
            self.check(cls)
        return cls
