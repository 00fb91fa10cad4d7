"""A harness session's way out when its gateway runs on another node.

A sandbox has no network; a harness in it reaches its session's gateway through a unix socket in
the node's gateway directory (``settings.gateway_socket_dir``, bound read-only into every bwrap
sandbox). The gateway runs in the run worker that drives the session. When that worker is on the
sandbox's own node it binds the socket itself; when it is on another node the socket it binds is
in *that* node's directory, which this sandbox cannot see. Then the worker asks this host (the
protocol's host-only ``relay`` method) for a socket of the same name here, and each connection to
it is piped to the gateway's TCP address on the worker's node. The relay knows no credential: the
harness sends its session's own, and the gateway checks it. It ends when the worker asks, or with
its sandbox."""
from __future__ import annotations

import logging
import os
import re
import socket
import stat
import threading

from prorl_celery.errors import InvalidRequest
from sandboxes.base import gateway_dir

log = logging.getLogger(__name__)

SOCKET_NAME = re.compile(r"^[0-9a-f]{32}\.sock$")  # what tasks.harnesses.run names a session's socket
CONNECT_TIMEOUT_S = 10.0
CHUNK = 65536


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
    """A listening unix socket at ``path``; each connection piped to ``target`` (TCP)."""

    def __init__(self, path: str, target: tuple[str, int]):
        self.path, self.target = path, target
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(path)  # fails if anything is there: a gateway's own, another relay
        except OSError as exc:
            self._listener.close()
            raise InvalidRequest(f"cannot bind {os.path.basename(path)}: {exc.strerror}", field="socket") from exc
        os.chmod(path, 0o666)  # the sandbox's uid connects; the session's credential is the lock
        self._listener.listen(64)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"relay-{os.path.basename(path)[:8]}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            log.warning("relay %s: gateway %s:%d unreachable: %s", self.path, *self.target, exc)
            client.close()
            return
        upstream.settimeout(None)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
        back.start()
        _pipe(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        """Stop accepting and remove the socket (connections in flight end with their peers)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy until ``src`` ends, then pass the end on (half-close), as the in-sandbox forwarder does."""
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
        try:
            sock.shutdown(how)
        except OSError:
            pass
