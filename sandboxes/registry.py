"""Sandbox runtimes by short name or dotted path, imported only when first used."""
from __future__ import annotations

import importlib
from typing import Any

from prorl_celery.errors import UnknownPlugin
from sandboxes.base import Sandbox, SandboxSpec

RUNTIMES: dict[str, str] = {
    "local": "sandboxes.local:LocalSandbox",
    # Register each runtime here once its module exists:
    # "bwrap": "sandboxes.bwrap:BwrapSandbox",
    # "singularity": "sandboxes.singularity:SingularitySandbox",
}


def known_runtimes() -> list[str]:
    return sorted(RUNTIMES)


def is_dotted_path(name: str) -> bool:
    return ":" in name or "." in name


def load_runtime(name: str) -> type:
    """The runtime class for a short name (``local``) or a dotted path (``pkg.mod:Class``).

    A runtime class takes ``(spec: SandboxSpec, job_id: str, config=None)``, implements
    :class:`~sandboxes.base.Sandbox`, and may define ``available() -> bool``.
    """
    path = RUNTIMES.get(name)
    if path is None and not is_dotted_path(name):
        raise UnknownPlugin(f"unknown sandbox runtime {name!r}; known: {', '.join(known_runtimes())}")
    path = path or name
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UnknownPlugin(f"cannot load sandbox runtime {name!r} from {path!r}: {exc}; "
                            f"known: {', '.join(known_runtimes())}") from exc


def available_runtimes() -> list[str]:
    """Registered runtimes that can run on this machine (their binary is present)."""
    names = []
    for name in known_runtimes():
        try:
            cls = load_runtime(name)
        except UnknownPlugin:
            continue
        if getattr(cls, "available", lambda: True)():
            names.append(name)
    return names


def runtime_name(spec: SandboxSpec) -> str:
    from config.settings import get_settings

    return spec.runtime or get_settings().sandbox_runtime


def create_sandbox(spec: SandboxSpec, job_id: str, config: dict[str, Any] | None = None) -> Sandbox:
    """Start a sandbox of ``spec.runtime`` (default: ``settings.sandbox_runtime``) in this process."""
    return load_runtime(runtime_name(spec))(spec, job_id, config)
