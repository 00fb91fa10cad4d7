"""The API's HTTP server: waitress, with the two guards it lacks against cheap connections.

Waitress reads every connection in one event loop and gives a thread only to a complete request,
so an idle connection costs a socket, not a thread. What it does not bound is who holds them: at
``connection_limit`` it stops accepting, and a connection that never sends a byte is closed only
after ``channel_timeout`` of silence; 1,024 such sockets (no token needed) kept ``/healthz`` from
answering for 15 minutes. So the server here adds:

- a per-client cap: past ``max_per_client`` connections from one remote address, a new one is
  closed as soon as it is accepted (the others of that client, and every other client, go on);
- a deadline for a request's head: a connection must deliver the head within
  ``header_timeout_s`` of opening, or of the first byte of a later request on it, else it is
  closed. A request being served (a long poll, an event stream, ``/process``) is never cut: only
  connections with no request in flight are checked, as waitress checks ``channel_timeout``.

Everything else (threads, buffers, ``connection_limit``, ``channel_timeout``) is waitress's own
configuration, passed through.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher

log = logging.getLogger(__name__)
ACCEPT_BATCH = 64  # connections accepted per turn of the event loop


class ClientCaps:
    """Connections held per remote address, shared by the listening sockets of one server."""

    def __init__(self, max_per_client: int):
        self.max_per_client = max_per_client
        self.held: Counter[str] = Counter()
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def admit(self, client: str) -> bool:
        """Count one more connection of ``client``; False (and not counted) past its cap."""
        with self._lock:
            if self.held[client] >= self.max_per_client:
                if client not in self._warned:
                    self._warned.add(client)
                    log.warning("client %s holds %d connections (the cap): closing its new ones",
                                client, self.held[client])
                return False
            self.held[client] += 1
            return True

    def release(self, client: str) -> None:
        with self._lock:
            self.held[client] -= 1
            if self.held[client] <= 0:
                del self.held[client]
                self._warned.discard(client)


class GuardedChannel(HTTPChannel):
    """A connection its server admitted (counted against its client's cap until it is closed),
    with the time its pending request head began."""

    def __init__(self, server: GuardedServer, sock, addr, adj: Adjustments, map=None):
        self.client = str(addr[0]) if addr else "?"
        self.counted = True  # the server admitted it: see GuardedServer.handle_accept
        self.head_since: float | None = time.time()  # a new connection owes its first head
        super().__init__(server, sock, addr, adj, map)

    def received(self, data: bytes) -> bool:
        done = super().received(data)
        if self.request is None or self.request.headers_finished:
            self.head_since = None  # no head pending: a request is served, its body comes, or none
        elif self.head_since is None:
            self.head_since = time.time()  # the first bytes of a new request's head
        return done

    def del_channel(self, map=None) -> None:
        if self.counted:
            self.counted = False
            self.server.caps.release(self.client)
        super().del_channel(map)


class GuardedServer(TcpWSGIServer):
    """One listening socket of the API; :func:`make_server` builds them."""

    channel_class = GuardedChannel

    def __init__(self, application, *, caps: ClientCaps, header_timeout_s: float, **kw: Any):
        self.caps, self.header_timeout_s = caps, header_timeout_s
        super().__init__(application, **kw)

    def handle_accept(self) -> None:
        """Accept what waits, a batch per turn of the loop (waitress takes one, and a turn looks
        at every connection: a flood of 2,000 took seconds to drain), closing at once, before a
        channel is made for it, a connection past its client's cap."""
        room = min(ACCEPT_BATCH, self.adj.connection_limit - len(self._map))
        for _ in range(max(1, room)):
            try:
                pair = self.accept()
            except OSError:  # e.g. out of file descriptors: as waitress, log and let the loop go on
                log.warning("accept failed", exc_info=True)
                return
            if pair is None:
                return
            conn, addr = pair
            client = str(addr[0]) if addr else "?"
            if not self.caps.admit(client):
                conn.close()
                continue
            try:
                self.set_socket_options(conn)
            except OSError:  # the peer closed it before it was set up
                self.caps.release(client)
                conn.close()
                continue
            self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)

    def maintenance(self, now: float) -> None:
        super().maintenance(now)
        cutoff = now - self.header_timeout_s
        for channel in self.active_channels.values():
            since = getattr(channel, "head_since", None)
            if since is not None and since < cutoff and not channel.requests:
                channel.will_close = True


def make_server(app, *, max_per_client: int, header_timeout_s: float, **options: Any) -> GuardedServer:
    """The API's server on every address ``options`` (waitress's adjustments: host, port, threads
    ...) name, one event loop and one thread pool for all; ``run()`` serves until interrupted.
    ``cleanup_interval`` (how often idle connections are looked at) defaults to 1 s here, so that
    the head deadline holds to about a second."""
    adj = Adjustments(**{"cleanup_interval": 1, **options})
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    caps, shared = ClientCaps(max_per_client), {}
    servers = [GuardedServer(app, caps=caps, header_timeout_s=header_timeout_s, map=shared, dispatcher=dispatcher,
                             adj=adj, sockinfo=sockinfo) for sockinfo in adj.listen]
    return servers[0]  # its loop serves the shared map, so every listening socket
