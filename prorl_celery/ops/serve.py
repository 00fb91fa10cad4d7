"""The API's HTTP server: waitress, with the two guards it lacks against cheap connections.

Waitress reads every connection in one event loop and gives a thread only to a complete request,
so an idle connection costs a socket, not a thread. What it does not bound is who holds them: at
``connection_limit`` it stops accepting, and a connection that never sends a byte is closed only
after ``channel_timeout`` of silence; 1,024 such sockets (no token needed) kept ``/healthz`` from
answering for 15 minutes. So the server here adds:

- a per-client cap: one remote address holds at most ``max_per_client`` connections. Past it, a
  new connection takes the place of that client's idlest one (no request being served, the
  longest since it last sent a byte), which is closed; only when every one of them is serving a
  request is the new one closed instead. Refusing the newcomer outright let a harness on the
  trainer's host, holding the cap in idle sockets, keep that host's own prober from ``/healthz``
  until the head deadline; now the prober's connection is served and an idle socket pays;
- a deadline for a request's head: a connection must deliver the head within
  ``header_timeout_s`` of opening, or of the first byte of a later request on it, else it is
  closed. A request being served (a long poll, an event stream, ``/process``) is never cut: only
  connections with no request in flight are checked, as waitress checks ``channel_timeout``.

Everything else (threads, buffers, ``connection_limit``, ``channel_timeout``) is waitress's own
configuration, passed through.
"""
from __future__ import annotations

import logging
import socket
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
    """Connections held per remote address, shared by the listening sockets of one server, and
    each client's open channels (to choose which one a newcomer past the cap replaces)."""

    def __init__(self, max_per_client: int):
        self.max_per_client = max_per_client
        self.held: Counter[str] = Counter()
        self.channels: dict[str, set[GuardedChannel]] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def admit(self, client: str) -> bool:
        """Count one more connection of ``client``; False (and not counted) past its cap."""
        with self._lock:
            if self.held[client] >= self.max_per_client:
                if client not in self._warned:
                    self._warned.add(client)
                    log.warning("client %s holds %d connections (the cap): its idlest ones make room for new ones",
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

    def track(self, channel: GuardedChannel) -> None:
        with self._lock:
            self.channels.setdefault(channel.client, set()).add(channel)

    def untrack(self, channel: GuardedChannel) -> None:
        with self._lock:
            mine = self.channels.get(channel.client)
            if mine is not None:
                mine.discard(channel)
                if not mine:
                    del self.channels[channel.client]

    def idlest(self, client: str) -> GuardedChannel | None:
        """``client``'s channel that serves no request, has no answer left to send, and sent its
        last byte longest ago (the one waitress's idle timeout would close first); None if none."""
        with self._lock:
            idle = [ch for ch in self.channels.get(client, ()) if not ch.requests and not ch.total_outbufs_len]
        return min(idle, key=lambda ch: ch.last_activity, default=None)


class GuardedChannel(HTTPChannel):
    """A connection its server admitted (counted against its client's cap until it is closed),
    with the time its pending request head began."""

    def __init__(self, server: GuardedServer, sock, addr, adj: Adjustments, map=None):
        self.client = str(addr[0]) if addr else "?"
        self.counted = True  # the server admitted it: see GuardedServer.handle_accept
        self.head_since: float | None = time.time()  # a new connection owes its first head
        super().__init__(server, sock, addr, adj, map)
        server.caps.track(self)

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
            self.server.caps.untrack(self)
            self.server.caps.release(self.client)
        super().del_channel(map)


class GuardedServer(TcpWSGIServer):
    """One listening socket of the API; :func:`make_server` builds them."""

    channel_class = GuardedChannel

    def __init__(self, application, *, caps: ClientCaps, header_timeout_s: float, reuse_port: bool = False,
                 **kw: Any):
        self.caps, self.header_timeout_s, self.reuse_port = caps, header_timeout_s, reuse_port
        super().__init__(application, **kw)

    def set_reuse_addr(self) -> None:
        """SO_REUSEADDR as waitress sets it, and with ``reuse_port`` SO_REUSEPORT: several API
        processes listen on one port and the kernel spreads new connections between them."""
        super().set_reuse_addr()
        if self.reuse_port:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)

    def handle_accept(self) -> None:
        """Accept what waits, a batch per turn of the loop (waitress takes one, and a turn looks
        at every connection: a flood of 2,000 took seconds to drain). A connection past its
        client's cap replaces that client's idlest one, or, when every one serves a request, is
        closed at once, before a channel is made for it."""
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
            if not self._make_room(client):
                conn.close()
                continue
            try:
                self.set_socket_options(conn)
            except OSError:  # the peer closed it before it was set up
                self.caps.release(client)
                conn.close()
                continue
            self.channel_class(self, conn, self.fix_addr(addr), self.adj, map=self._map)

    def _make_room(self, client: str) -> bool:
        """Count a new connection of ``client``, closing its idlest one if it is at its cap."""
        if self.caps.admit(client):
            return True
        idlest = self.caps.idlest(client)
        if idlest is None:
            return False
        idlest.handle_close()  # in the loop's own thread, which owns the channel; releases its count
        return self.caps.admit(client)

    def maintenance(self, now: float) -> None:
        super().maintenance(now)
        cutoff = now - self.header_timeout_s
        for channel in self.active_channels.values():
            since = getattr(channel, "head_since", None)
            if since is not None and since < cutoff and not channel.requests:
                channel.will_close = True


def make_server(app, *, max_per_client: int, header_timeout_s: float, reuse_port: bool = False,
                **options: Any) -> GuardedServer:
    """The API's server on every address ``options`` (waitress's adjustments: host, port, threads
    ...) name, one event loop and one thread pool for all; ``run()`` serves until interrupted.
    ``cleanup_interval`` (how often idle connections are looked at) defaults to 1 s here, so that
    the head deadline holds to about a second."""
    adj = Adjustments(**{"cleanup_interval": 1, **options})
    dispatcher = ThreadedTaskDispatcher()
    dispatcher.set_thread_count(adj.threads)
    caps, shared = ClientCaps(max_per_client), {}
    servers = [GuardedServer(app, caps=caps, header_timeout_s=header_timeout_s, reuse_port=reuse_port, map=shared,
                             dispatcher=dispatcher,
                             adj=adj, sockinfo=sockinfo) for sockinfo in adj.listen]
    return servers[0]  # its loop serves the shared map, so every listening socket
