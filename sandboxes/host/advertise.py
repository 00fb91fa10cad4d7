"""The address a sandbox host publishes for workers on other nodes to reach it.

Bound to one interface, the host publishes that interface. Bound to all of them (``0.0.0.0``,
``::``), it publishes, in this order: the operator's ``node_addr`` setting; else the source
address of this node's route to Redis (the interface the head sees this node on, so every node
that reaches Redis over the same network reaches the host too); else the hostname's address when
it is not loopback. ``gethostbyname(gethostname())`` alone is not enough: on many distributions
``/etc/hosts`` maps the hostname to ``127.0.1.1``, and a node whose hostname does not resolve
would publish ``127.0.0.1``, which no other node can reach.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import urllib.parse

from prorl_celery.http import route_source

log = logging.getLogger(__name__)
WILDCARDS = ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _hostname_address() -> str | None:
    try:
        found = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if is_loopback(found) else found


def node_address(redis_url: str | None, node_addr: str | None = None) -> str:
    """This node's address as the other nodes see it (see the module's docstring)."""
    if node_addr:
        return node_addr
    parts = urllib.parse.urlsplit(redis_url or "")
    routed = route_source(parts.hostname, parts.port or 6379) if parts.hostname else None
    if routed and not is_loopback(routed):
        return routed
    named = _hostname_address()  # Redis on this node (or unknown): the hostname's address
    if named:
        return named
    if not (routed and parts.hostname and is_loopback(parts.hostname)):
        log.warning("no address other nodes can reach this host at: publishing %s "
                    "(set PRORL_NODE_ADDR or --advertise)", routed or "127.0.0.1")
    return routed or "127.0.0.1"


def advertised_url(bind: str, port: int, redis_url: str | None, node_addr: str | None = None) -> str:
    """``http://<address>:<port>`` for a host bound to ``bind``."""
    host = node_address(redis_url, node_addr) if bind in WILDCARDS else bind
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
