"""Classes named by a dotted path in a request (a data source's handler, a sandbox runtime).

A request must not be able to make the service import, let alone call, whatever it names: a
data source of ``os:abort`` would otherwise take down the API process that checks it. So a
dotted path is loaded only from the service's own packages and the packages the operator lists
in ``PRORL_PLUGIN_PACKAGES``, and only if it names a class.
"""
from __future__ import annotations

import importlib
import inspect

from prorl_celery.errors import UnknownPlugin

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


def load_class(path: str, what: str) -> type:
    """The class at ``path``; :class:`UnknownPlugin` (saying why) for anything else."""
    module, attr = split_path(path)
    packages = allowed_packages()
    if not any(module == p or module.startswith(f"{p}.") for p in packages):
        raise UnknownPlugin(f"{what} {path!r}: module {module!r} is in none of the allowed packages "
                            f"({', '.join(packages)}); an operator adds a package with PRORL_PLUGIN_PACKAGES")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UnknownPlugin(f"cannot load {what} {path!r}: {exc}") from exc
    if not inspect.isclass(found):
        raise UnknownPlugin(f"{what} {path!r} is not a class")
    return found
