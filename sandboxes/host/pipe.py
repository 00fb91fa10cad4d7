"""One relayed connection (:mod:`sandboxes.host.relay`) on the host's event loop: a sandbox's
connection to the relay socket, and the relay's own to the gateway.

The relay connects (without blocking the loop), takes the gateway's challenge, answers it and
checks the gateway's proof (:mod:`prorl_celery.handshake`); only then is the sandbox's side read
at all. After that bytes are copied both ways, at most ``HIGH`` bytes waiting for a side that
does not read (then the other side is no longer read), and an end on one side is passed on as a
half-close, as the in-sandbox forwarder does."""
from __future__ import annotations

import errno
import hmac
import logging
import socket
import time
from typing import Any

from prorl_celery import handshake
from prorl_celery.netloop import READ, WRITE

log = logging.getLogger(__name__)
RECV = 65536
HIGH = 256 * 1024


class _Side:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.out = bytearray()  # bytes waiting to be written to this side
        self.eof = False  # this side ended what it sends
        self.shut = False  # its write side was shut (the other side's end passed on)


class Pipe:
    def __init__(self, relay: Any, client: socket.socket):
        self.relay, self.loop = relay, relay.loop
        relay.pipes.add(self)
        self.client = _Side(client)
        self.since = time.monotonic()
        self.state = "connecting"
        self.got = b""
        self.proof = b""
        host, port = relay.target
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.upstream = _Side(socket.socket(family, socket.SOCK_STREAM))
        self.upstream.sock.setblocking(False)
        err = self.upstream.sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            self._fail(f"connect: {errno.errorcode.get(err, err)}")
            return
        self.loop.register(self.upstream.sock, WRITE, self._on_upstream)

    def expired(self, now: float) -> bool:
        limits = self.relay.limits
        return now - self.since > (limits.idle_s if self.state == "piping" else limits.handshake_s)

    def _fail(self, why: str) -> None:
        log.warning("relay %s: gateway %s:%d: %s", self.relay.path, *self.relay.target, why)
        self.close()

    def _on_upstream(self, mask: int) -> None:
        if self.state == "piping":
            self._io(self.upstream, self.client, mask)
        elif self.state == "connecting":
            err = self.upstream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._fail(f"unreachable: {errno.errorcode.get(err, err)}")
                return
            self.upstream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.state = "opening"
            self.loop.modify(self.upstream.sock, READ, self._on_upstream)
        else:
            self._handshake()

    def _handshake(self) -> None:
        """The gateway's opening, then its proof; anything else closes the connection."""
        need = handshake.CHALLENGE if self.state == "opening" else handshake.PROOF
        try:
            data = self.upstream.sock.recv(need - len(self.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(f"handshake: {exc}")
            return
        if not data:
            self._fail("closed during the handshake (a wrong relay key?)")
            return
        self.got += data
        if len(self.got) < need:
            return
        got, self.got = self.got, b""
        if self.state == "opening":
            answered = handshake.answer(self.relay.key, got)
            if answered is None:
                self._fail("not a gateway's handshake")
                return
            reply, self.proof = answered
            try:
                self.upstream.sock.send(reply)  # 64 bytes into an empty buffer
            except OSError as exc:
                self._fail(f"handshake: {exc}")
                return
            self.state = "proof"
        elif not hmac.compare_digest(got, self.proof):
            self._fail("the gateway's proof is wrong")
        else:
            self.state, self.since = "piping", time.monotonic()
            self.loop.register(self.client.sock, READ, self._on_client)

    def _on_client(self, mask: int) -> None:
        self._io(self.client, self.upstream, mask)

    def _io(self, side: _Side, other: _Side, mask: int) -> None:
        try:
            if mask & READ:
                data = side.sock.recv(RECV)
                if data:
                    other.out += data
                    self._flush(other)  # most often it goes at once, without a round of the loop
                else:
                    side.eof = True
            if mask & WRITE:
                self._flush(side)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.close()
            return
        self.since = time.monotonic()
        self._settle()

    @staticmethod
    def _flush(side: _Side) -> None:
        if side.out:
            sent = side.sock.send(side.out)
            del side.out[:sent]

    def _settle(self) -> None:
        """Pass ends on, close when both are done, watch each side for what it can take."""
        for side, other in ((self.client, self.upstream), (self.upstream, self.client)):
            if side.eof and not other.out and not other.shut:
                other.shut = True
                try:
                    other.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        if self.client.shut and self.upstream.shut:
            self.close()
            return
        for side, other in ((self.client, self.upstream), (self.upstream, self.client)):
            events = (READ if not side.eof and len(other.out) < HIGH else 0) | (WRITE if side.out else 0)
            callback = self._on_client if side is self.client else self._on_upstream
            self.loop.modify(side.sock, events, callback)

    def close(self) -> None:
        if self.state == "closed":
            return
        self.state = "closed"
        for side in (self.client, self.upstream):
            self.loop.unregister(side.sock)
            side.sock.close()
        self.relay.pipes.discard(self)
