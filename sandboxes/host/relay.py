"""A harness session's way out when its gateway runs on another node.

A sandbox has no network; a harness in it reaches its session's gateway through a unix socket in
the node's gateway directory (``settings.gateway_socket_dir``, bound read-only into every bwrap
sandbox). The gateway runs in the run worker that drives the session. When that worker is on the
sandbox's own node it binds the socket itself; when it is on another node the socket it binds is
in *that* node's directory, which this sandbox cannot see. Then the worker asks this host (the
protocol's host-only ``relay`` method) for a socket of the same name here, and each connection to
it is piped to the gateway's TCP address on the worker's node. It ends when the worker asks, or
with its sandbox.

Every relayed connection is authenticated before a byte of its request crosses: the gateway's
relay listener opens with a challenge, the relay answers with an HMAC of the session's relay key
(given by the worker with the relay) and checks the gateway's in return
(:mod:`prorl_celery.handshake`); the sandbox's bytes are not read until then. The harness still
sends its session's credential, and the gateway checks it. All relays of a host share one event
loop thread (:mod:`prorl_celery.netloop`; the pipes: :mod:`sandboxes.host.pipe`), within
:class:`Limits`."""
from __future__ import annotations

import logging
import os
import re
import socket
import stat
from dataclasses import dataclass

from prorl_celery.errors import InvalidRequest
from prorl_celery.netloop import READ, Loop
from sandboxes.base import gateway_dir
from sandboxes.host.pipe import Pipe

log = logging.getLogger(__name__)

SOCKET_NAME = re.compile(r"^[0-9a-f]{32}\.sock$")  # what tasks.harnesses.run names a session's socket


@dataclass
class Limits:
    """A relay's bounds: connections at once, the connect and handshake, an idle connection (a
    little past the gateway's own idle deadline, which ends it first)."""

    connections: int = 64
    handshake_s: float = 10.0
    idle_s: float = 360.0


def socket_path(name: str) -> str:
    """Where the socket ``name`` is on this node; a name that is not a session's is refused."""
    directory = gateway_dir()
    if directory is None:
        raise InvalidRequest("this node has no gateway directory (settings.gateway_socket_dir)", field="socket")
    if not SOCKET_NAME.match(name or ""):
        raise InvalidRequest(f"not a session socket's name: {name!r}", field="socket")
    return os.path.join(directory, name)


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def parse_target(target: str) -> tuple[str, int]:
    host, _, port = (target or "").rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"not an address host:port: {target!r}", field="target")
    return host, int(port)


class Relay:
    """A listening unix socket at ``path``; each connection piped to ``target`` (TCP) once the
    gateway there and this relay proved ``key`` to each other. At most ``limits.connections`` at
    once: more are closed at once (the sandbox's own session is all they can stop)."""

    def __init__(self, path: str, target: tuple[str, int], key: bytes, limits: Limits | None = None):
        self.path, self.target, self.key = path, target, key
        self.limits = limits or Limits()
        self.pipes: set[Pipe] = set()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)  # fails if anything is there: a gateway's own, another relay
        except OSError as exc:
            self._listener.close()
            raise InvalidRequest(f"cannot bind {os.path.basename(path)}: {exc.strerror}", field="socket") from exc
        os.chmod(path, 0o666)  # the sandbox's uid connects; the session's credential is the lock
        self._listener.listen(socket.SOMAXCONN)
        self._listener.setblocking(False)
        self._closed = False
        self.loop = Loop.shared("relay")
        self.loop.call_and_wait(self._begin)

    def _begin(self) -> None:
        self.loop.register(self._listener, READ, self._accept)
        self.loop.add_sweep(self._sweep)

    def _accept(self, mask: int) -> None:
        for _ in range(64):  # a burst, then the other relays' sockets get their turn
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("relay %s: accept failed: %s", self.path, exc)
                return
            if len(self.pipes) >= self.limits.connections:
                log.warning("relay %s: %d connections open already: one more refused", self.path, len(self.pipes))
                client.close()
                continue
            client.setblocking(False)
            Pipe(self, client)  # in self.pipes until it closes

    def _sweep(self, now: float) -> None:
        for pipe in list(self.pipes):
            if pipe.expired(now):
                pipe.close()

    def close(self) -> None:
        """Stop accepting, remove the socket, end its connections."""
        if self._closed:
            return
        self._closed = True
        self.loop.call_and_wait(self._end)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _end(self) -> None:
        self.loop.remove_sweep(self._sweep)
        self.loop.unregister(self._listener)
        self._listener.close()
        for pipe in list(self.pipes):
            pipe.close()
