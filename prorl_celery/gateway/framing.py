"""The gateway's request reader: bytes in, whole requests out, with llhttp (``httptools``, the
parser uvicorn uses) doing the HTTP/1.x framing, and every bound checked as the bytes come.

- The head is at most ``max_head`` bytes and ``max_headers`` fields.
- The caller's ``authorize`` sees the head before a byte of body is taken: a refusal ends the
  request there (the connection is then closed, its body never read).
- The body, by ``Content-Length`` or chunked, is capped on the running total: a length past the
  cap is refused from the head, and a chunk's announced size is never trusted (the parser hands
  over what has arrived; a 256 MB chunk is refused once the total passes the cap, without
  anything of its size allocated).
- ``reserve(n)``/``release(n)``: a budget shared by the session's connections (bytes of bodies in
  flight), taken as body bytes arrive and given back by :meth:`Request.release` once answered.

A :class:`Refusal` says what to answer (status, kind, message); the connection is closed after."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httptools

MAX_HEAD = 64 * 1024
MAX_HEADERS = 100
MAX_BODY = 64 * 1024 * 1024  # a 200k-token history with tools is a few MB


class Refusal(Exception):
    """A request refused by its framing or its head: answered with ``status`` and closed."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class Headers(dict):
    """A request's headers by lower-cased name (the last one of a repeated name)."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return super().get(name.lower(), default)


@dataclass
class Request:
    method: str
    path: str
    headers: Headers
    body: bytes = b""
    keep_alive: bool = True
    reserved: int = 0
    release: Callable[[int], None] = field(default=lambda n: None, repr=False)

    def done(self) -> None:
        """Give the body's bytes back to the session's budget (once)."""
        reserved, self.reserved = self.reserved, 0
        if reserved:
            self.release(reserved)


Authorize = Callable[[str, str, Headers], "Refusal | None"]


class RequestReader:
    """Feed it a connection's bytes (:meth:`feed`); complete requests wait in :attr:`ready`.
    :attr:`started` says a request has begun and :attr:`in_body` that its head is complete (the
    connection's deadlines follow them). :meth:`feed` raises :class:`Refusal`."""

    def __init__(self, authorize: Authorize, reserve: Callable[[int], bool] = lambda n: True,
                 release: Callable[[int], None] = lambda n: None, max_head: int = MAX_HEAD,
                 max_headers: int = MAX_HEADERS, max_body: int = MAX_BODY):
        self._authorize, self._reserve, self._release = authorize, reserve, release
        self.max_head, self.max_headers, self.max_body = max_head, max_headers, max_body
        self._parser = httptools.HttpRequestParser(self)
        self.ready: deque[Request] = deque()
        self.expect_continue = False  # set once a head that asked for it was accepted
        self._head_bytes = 0  # fed since the last request ended, while no head was complete
        self._reset()

    def _reset(self) -> None:
        self.started = self.in_body = False
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._body_len = 0
        self._request: Request | None = None
        self._error: Refusal | None = None

    def feed(self, data: bytes) -> None:
        if not self.in_body:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            raise self._error or Refusal(400, "invalid_request", "malformed HTTP request") from None
        except httptools.HttpParserUpgrade:  # the request before it is whole: served, then closed
            if self.ready:
                self.ready[-1].keep_alive = False
            else:
                raise Refusal(400, "invalid_request", "protocol upgrades are not served") from None
        except httptools.HttpParserError as exc:
            raise Refusal(400, "invalid_request", f"malformed HTTP request: {exc}") from None
        if self.started and not self.in_body and self._head_bytes > self.max_head:
            raise Refusal(431, "invalid_request", f"request head larger than {self.max_head} bytes")

    def abandon(self) -> None:
        """The connection closed mid-request: give back what its body held."""
        if self._body_len:
            self._release(self._body_len)
            self._body_len = 0
        for request in self.ready:
            request.done()
        self.ready.clear()

    # httptools' callbacks (an exception in one stops the parser; feed() raises the Refusal)

    def on_message_begin(self) -> None:
        self._reset()
        self.started = True

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name, value))
        if len(self._fields) > self.max_headers:
            self._fail(Refusal(431, "invalid_request", f"more than {self.max_headers} header fields"))

    def on_headers_complete(self) -> None:
        headers = Headers({n.lower().decode("latin-1"): v.decode("latin-1") for n, v in self._fields})
        method = self._parser.get_method().decode("latin-1")
        path = self._url.decode("latin-1").split("?", 1)[0]
        length = headers.get("content-length")
        if length is not None and int(length) > self.max_body:  # llhttp checked it is a number
            self._fail(Refusal(413, "invalid_request", f"body larger than {self.max_body} bytes"))
        refusal = self._authorize(method, path, headers)
        if refusal is not None:
            self._fail(refusal)
        self.in_body = True
        self.expect_continue = headers.get("expect", "").lower() == "100-continue"
        self._request = Request(method, path, headers, keep_alive=self._parser.should_keep_alive(),
                                release=self._release)

    def on_body(self, data: bytes) -> None:
        self._body_len += len(data)
        if self._body_len > self.max_body:
            self._fail(Refusal(413, "invalid_request", f"body larger than {self.max_body} bytes"))
        if not self._reserve(len(data)):
            self._body_len -= len(data)
            self._fail(Refusal(503, "unavailable", "this session's requests in flight hold too many bytes"))
        self._body.append(data)

    def on_message_complete(self) -> None:
        request = self._request
        assert request is not None
        request.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request.reserved = self._body_len
        self._body_len = self._head_bytes = 0
        self.ready.append(request)
        self._reset()

    def _fail(self, refusal: Refusal) -> None:
        self._error = refusal
        raise refusal
