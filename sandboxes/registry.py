"""Sandbox runtimes by short name or dotted path, imported only when first used.

Nothing here knows a runtime by its name but ``local``, the one the operator must allow (checked
without importing it, on the API too): what a runtime needs, whether it works here and what
``auto`` prefers are its own hooks (:class:`~sandboxes.base.SandboxRuntime`)."""
from __future__ import annotations

import functools
import logging
from typing import Any

from prorl_celery.errors import PolicyDenied, SandboxError, UnknownPlugin
from prorl_celery.plugins import is_dotted_path
from prorl_celery.plugins import Registry
from sandboxes.base import Sandbox, SandboxSpec
from sandboxes.check import METHODS, check_runtime_class

log = logging.getLogger(__name__)

RUNTIMES = Registry("sandbox runtime", {
    "bwrap": "sandboxes.runtimes.bwrap:BwrapSandbox",
    "local": "sandboxes.runtimes.local:LocalSandbox",
    "singularity": "sandboxes.runtimes.singularity:SingularitySandbox",
}, check=check_runtime_class, required=tuple(METHODS))
AUTO = "auto"  # the available runtime of the highest auto_rank (bwrap); local only where allowed
LOCAL = "local"


def known_runtimes() -> list[str]:
    return RUNTIMES.known()


def load_runtime(name: str) -> type:
    """The runtime class for a short name (``local``) or a dotted path (``pkg.mod:Class``).

    A runtime class takes ``(spec: SandboxSpec, job_id: str, config=None)``, implements
    :class:`~sandboxes.base.Sandbox`, and has the hooks of :class:`~sandboxes.base.SandboxRuntime`.
    """
    return RUNTIMES.load(name)


AUTO_UNAVAILABLE = ("sandbox runtime 'auto' needs bubblewrap, which is missing or cannot create "
                    "namespaces on this host, and will not fall back to 'local' (no isolation): "
                    "install bubblewrap with scripts/install-system-deps.sh, or let the operator "
                    "allow the unisolated runtime with PRORL_ALLOW_LOCAL_RUNTIME=1 (prorl-celery "
                    "up --dev)")


def isolation_of(name: str) -> str:
    """How a runtime isolates its sandboxes (``namespaces``, ``none`` ...), as /healthz shows."""
    try:
        return str(load_runtime(name).isolation)
    except UnknownPlugin:
        return "unknown"


def runtime_works(name: str, config: dict[str, Any] | None = None) -> bool:
    """Whether ``name`` can run here with its configuration (:meth:`available`)."""
    try:
        cls = load_runtime(name)
    except UnknownPlugin:
        return False
    return bool(cls.available(config))


def _local_allowed() -> bool:
    from config.settings import get_settings

    return bool(get_settings().allow_local_runtime)


def names_local(runtime: str | None) -> bool:
    """Whether a runtime name, short or dotted, is the built-in ``local`` (without importing)."""
    if not runtime:
        return False
    return runtime == LOCAL or runtime.replace(".LocalSandbox", ":LocalSandbox") == RUNTIMES.entries[LOCAL]


def local_refused(field: str) -> PolicyDenied:
    return PolicyDenied("sandbox runtime 'local' has no isolation and this service does not allow "
                        "it; the operator enables it with PRORL_ALLOW_LOCAL_RUNTIME=1 (or "
                        "prorl-celery up --dev)", field=field)


def available_runtimes(runtime_config: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Registered runtimes that can run on this machine and that the operator allows (``local``
    only with ``allow_local_runtime``)."""
    config = runtime_config or {}
    return [name for name in known_runtimes()
            if (not names_local(name) or _local_allowed()) and runtime_works(name, config.get(name))]


def requested_runtime(spec: SandboxSpec) -> str:
    """What the spec (or the configured default) asks for; may be ``auto``."""
    from config.settings import get_settings

    return spec.runtime or get_settings().sandbox_runtime


def _auto_rank(name: str) -> int:
    try:
        return int(load_runtime(name).auto_rank)
    except UnknownPlugin:
        return 0


def _unisolated(name: str) -> bool:
    """``local``, or a runtime that says it isolates nothing (a subclass of it, say)."""
    return names_local(name) or isolation_of(name) == "none"


def resolve_auto(served: list[str], runtime_config: dict[str, dict[str, Any]] | None = None) -> str | None:
    """What ``auto`` means among ``served``: the one of the highest ``auto_rank`` that works here
    (bwrap), ``local`` only when the operator allows it (said in the log and in every result);
    else None."""
    config = runtime_config or {}
    ranked = sorted((name for name in served if _auto_rank(name) > 0), key=_auto_rank, reverse=True)
    for name in ranked:
        if _unisolated(name):
            if not _local_allowed():
                continue
            log.warning("sandbox runtime 'auto': no isolating runtime works here; using 'local', which "
                        "has NO isolation, because PRORL_ALLOW_LOCAL_RUNTIME is set")
            return name
        if runtime_works(name, config.get(name)):
            return name
    return None


@functools.cache
def auto_runtime() -> str:
    """What ``auto`` means in this process (see :func:`resolve_auto`); an error if nothing."""
    name = resolve_auto([name for name in known_runtimes() if not is_dotted_path(name)])
    if name is None:
        raise SandboxError(AUTO_UNAVAILABLE)
    return name


def runtime_name(spec: SandboxSpec) -> str:
    """The runtime that serves ``spec`` in this process (``auto`` resolved)."""
    name = requested_runtime(spec)
    return auto_runtime() if name == AUTO else name


def create_sandbox(spec: SandboxSpec, job_id: str, config: dict[str, Any] | None = None) -> Sandbox:
    """Start a sandbox of ``spec.runtime`` (default: ``settings.sandbox_runtime``) in this
    process. The operator's policy is the sandbox host's to apply (:class:`ServedRuntimes`)."""
    return load_runtime(runtime_name(spec))(spec, job_id, config)


class ServedRuntimes:
    """The runtimes one sandbox host was started with, and the one choice it makes per create:
    which of them serves a spec. Anything else is refused, whatever the request names."""

    def __init__(self, names: list[str] | None = None,
                 runtime_config: dict[str, dict[str, Any]] | None = None):
        if names and any(names_local(name) for name in names) and not _local_allowed():
            raise local_refused("--runtimes")
        self.names = list(names) if names else available_runtimes(runtime_config)
        if not self.names:
            raise SandboxError("this host has no sandbox runtime to serve: " + AUTO_UNAVAILABLE)
        self.auto = resolve_auto(self.names, runtime_config)
        self._classes = {name: load_runtime(name) for name in self.names}

    def isolation(self) -> dict[str, str]:
        return {name: isolation_of(name) for name in self.names}

    def select(self, requested: str) -> str:
        """The served runtime for a requested name (``auto``, a short name, a dotted path)."""
        if requested == AUTO:
            if self.auto is None:
                raise SandboxError(AUTO_UNAVAILABLE)
            return self.auto
        if requested in self._classes:
            return requested
        if names_local(requested) and not _local_allowed():
            raise local_refused("spec.runtime")
        cls = load_runtime(requested)  # an unknown name lists the known ones
        for name, served in self._classes.items():
            if cls is served:
                return name
        raise PolicyDenied(f"sandbox runtime {requested!r} is not served by this host (it serves "
                           f"{', '.join(self.names)})", field="spec.runtime")
