"""Where a job's sandbox comes from: the seat of a sandbox provider.

A stage asks the provider for a sandbox (:meth:`SandboxProvider.open`), drives it through the
:class:`~sandboxes.base.Sandbox` protocol, and stores its ``handle`` (a JSON object) in the job
record, so that a later stage on any node can :meth:`~SandboxProvider.attach` to it and anyone can
:meth:`~SandboxProvider.close` it by that handle. The stages (``tasks/context.py``) know no more
than this.

Today's one provider is our own sandbox hosts, ``hosts`` (:class:`sandboxes.client.HostProvider`):
placement on the least-loaded live host, a handle naming the host, hosts that heartbeat in Redis
and that the beat sweep asks for their sandboxes and strays, and the route to a harness's gateway
(:mod:`sandboxes.gateway_route`: direct on the worker's node, else relayed by the host).

A provider reached by API, with no host of ours (a cloud sandbox service), takes this seat by
implementing the protocol: ``open`` creates a sandbox through the service (waiting out what is not
the job's fault within ``budget_s``, calling ``check()`` to stop when the job is cancelled),
``attach`` rebuilds a driver from the handle it stored (the service's sandbox id), ``close``
deletes it. Not built yet for such a provider (none is needed today): the job record's handle
would name its provider (a ``provider`` field, ``hosts`` when absent), :data:`PROVIDERS` would
list it, and the beat sweep would ask it, as it asks the hosts, for the sandboxes of ended jobs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from prorl_celery.plugins import Registry
from sandboxes.base import Sandbox, SandboxSpec
from sandboxes.gateway_route import GatewayRoute


@runtime_checkable
class ProvidedSandbox(Sandbox, Protocol):
    """A sandbox as a provider hands it out: the protocol, plus what the stage records."""

    @property
    def handle(self) -> Any:
        """What the job record stores (a pydantic model); :meth:`SandboxProvider.attach` takes its dump."""

    @property
    def entry(self) -> Any:
        """The provider's account of the sandbox at its start (runtime, isolation, limits), or None."""

    @property
    def gone(self) -> bool:
        """Whether the sandbox is known to be gone already (closing it again is pointless)."""


@runtime_checkable
class SandboxProvider(Protocol):
    """Where sandboxes come from; built with the job store's Redis client."""

    def open(self, spec: SandboxSpec, job_id: str, *, budget_s: float,
             check: Callable[[], None] | None = None,
             keeper: ProvidedSandbox | None = None) -> tuple[ProvidedSandbox, float]:
        """A new sandbox for ``job_id`` and the seconds waited for it (a full cluster, an image
        being pulled ...), waiting at most ``budget_s``; ``check()`` raises to stop waiting.
        ``keeper``: a sandbox of the job the new one lives and dies with, beside it (a task's
        sidecar service beside the agent's sandbox; ``forward`` then reaches its ports)."""

    def attach(self, handle: dict[str, Any]) -> ProvidedSandbox:
        """The sandbox a stored handle names, driven from this process."""

    def close(self, handle: dict[str, Any] | Any) -> bool:
        """Close the sandbox a handle names; True if this call closed it. Never raises: a
        sandbox that outlives its job is the provider's lease or sweep to end."""

    def gateway_route(self, sandbox: ProvidedSandbox, socket_path: str,
                      listen: Callable[[str], str], key: str | None = None) -> GatewayRoute:
        """How ``sandbox`` reaches a harness's gateway listening in this process on the unix
        socket ``socket_path``: ``direct`` (it sees that socket) or ``relay`` (the provider
        brings it a socket to the gateway; ``listen(host)`` makes the gateway also serve on
        TCP at this node's address ``host``, returning ``host:port``; ``key``, the session's relay
        key, is what the relay proves to the gateway before it carries a byte: see
        :mod:`prorl_celery.handshake`), and the socket's path
        as the sandbox sees it. Raises :class:`~prorl_celery.errors.SandboxError` when there
        is no way."""

    def close_gateway_route(self, sandbox: ProvidedSandbox, socket_path: str) -> None:
        """Undo what :meth:`gateway_route` set up for ``socket_path`` (the session ended);
        never raises."""


PROVIDERS = Registry("sandbox provider", {"hosts": "sandboxes.client:HostProvider"}, paths=True)
DEFAULT = "hosts"


def sandbox_provider(client: Any, name: str = DEFAULT) -> SandboxProvider:
    """The provider ``name`` (a short name or a dotted path), on the job store's Redis ``client``."""
    return PROVIDERS.load(name)(client)
