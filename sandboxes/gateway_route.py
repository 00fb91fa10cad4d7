"""How a sandbox of our hosts reaches its harness's gateway: the ``hosts`` provider's answer
(:meth:`sandboxes.client.HostProvider.gateway_route`).

A harness's gateway listens in the run worker on a unix socket in the node's gateway directory,
which every sandbox on that node sees (bwrap binds it). ``direct``: the sandbox's host is on the
worker's node and sees the socket the worker bound. ``relay``: it is on another node; the gateway
also listens on the worker's address toward that host, and the host relays a socket of the same
name in its own gateway directory to it (:mod:`sandboxes.host.relay`). A sandbox driven in this
process (not through a host) is on this node: ``direct``."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from prorl_celery.errors import SandboxError
from prorl_celery.http import route_source

log = logging.getLogger(__name__)


class GatewayRoute(NamedTuple):
    route: str  # direct or relay
    path: str  # the socket's path as the sandbox sees it


def gateway_route(sandbox: Any, socket_path: str, listen: Callable[[str], str],
                  key: str | None = None) -> GatewayRoute:
    """The route from ``sandbox`` to a gateway on ``socket_path`` in this process; ``listen(host)``
    makes the gateway also serve on TCP at this node's address ``host`` (``host:port`` back);
    ``key`` the session's relay key the host proves before it relays (:mod:`prorl_celery.handshake`)."""
    from sandboxes.client import RemoteSandbox

    if not isinstance(sandbox, RemoteSandbox):  # an in-process sandbox is on this node
        return GatewayRoute("direct", socket_path)
    name = os.path.basename(socket_path)
    answer = sandbox.relay(name)
    if answer.route == "none":
        host = urlsplit(sandbox.handle.address)
        here = route_source(host.hostname, host.port or 80)  # this node's address on the way to that host
        if here is None:
            raise SandboxError(f"no route to the sandbox's host {sandbox.handle.address} for its gateway relay")
        answer = sandbox.relay(name, target=listen(here), key=key)
        log.info("sandbox %s is on another node (%s): its gateway relayed by its host",
                 sandbox.handle.sandbox_id, sandbox.handle.address)
    return GatewayRoute(answer.route, answer.path)


def close_gateway_route(sandbox: Any, socket_path: str) -> None:
    """Remove the relay :func:`gateway_route` opened (if any); best effort."""
    from sandboxes.client import RemoteSandbox

    if not isinstance(sandbox, RemoteSandbox):
        return
    try:
        sandbox.relay(os.path.basename(socket_path), close=True)
    except Exception as exc:  # noqa: BLE001 - the relay goes with the sandbox anyway
        log.debug("sandbox %s: relay not closed: %s", sandbox.handle.sandbox_id, exc)
