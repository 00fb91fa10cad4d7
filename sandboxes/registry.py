"""Sandbox runtimes by short name or dotted path, imported only when first used."""
from __future__ import annotations

import functools
import logging
from typing import Any

from prorl_celery.errors import UnknownPlugin
from prorl_celery.plugins import is_dotted_path, load_class
from sandboxes.base import Sandbox, SandboxSpec

log = logging.getLogger(__name__)

RUNTIMES: dict[str, str] = {
    "bwrap": "sandboxes.bwrap:BwrapSandbox",
    "local": "sandboxes.local:LocalSandbox",
    "singularity": "sandboxes.singularity:SingularitySandbox",
}
AUTO = "auto"  # bwrap where it works, else local (with a warning)


def known_runtimes() -> list[str]:
    return sorted(RUNTIMES)


def load_runtime(name: str) -> type:
    """The runtime class for a short name (``local``) or a dotted path (``pkg.mod:Class``).

    A runtime class takes ``(spec: SandboxSpec, job_id: str, config=None)``, implements
    :class:`~sandboxes.base.Sandbox`, and may define ``available() -> bool``.
    """
    path = RUNTIMES.get(name)
    if path is None and not is_dotted_path(name):
        raise UnknownPlugin(f"unknown sandbox runtime {name!r}; known: {', '.join(known_runtimes())}")
    try:
        return load_class(path or name, "sandbox runtime")
    except UnknownPlugin as exc:
        raise UnknownPlugin(f"{exc}; known: {', '.join(known_runtimes())}") from None


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


def requested_runtime(spec: SandboxSpec) -> str:
    """What the spec (or the configured default) asks for; may be ``auto``."""
    from config.settings import get_settings

    return spec.runtime or get_settings().sandbox_runtime


@functools.cache
def auto_runtime() -> str:
    """What ``auto`` means on this machine: ``bwrap`` if it works here, else ``local``."""
    if getattr(load_runtime("bwrap"), "available")():
        return "bwrap"
    log.warning("sandbox runtime 'auto': bubblewrap is missing or cannot create namespaces here; "
                "falling back to 'local', which has NO isolation (install it with "
                "scripts/install-system-deps.sh)")
    return "local"


def runtime_name(spec: SandboxSpec) -> str:
    """The runtime that serves ``spec`` on this machine (``auto`` resolved)."""
    name = requested_runtime(spec)
    return auto_runtime() if name == AUTO else name


def create_sandbox(spec: SandboxSpec, job_id: str, config: dict[str, Any] | None = None) -> Sandbox:
    """Start a sandbox of ``spec.runtime`` (default: ``settings.sandbox_runtime``) in this process."""
    return load_runtime(runtime_name(spec))(spec, job_id, config)
