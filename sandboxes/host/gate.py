"""The sandbox host's door: a request judged from its head, before waitress reads its body.

Waitress reads a whole request (up to ``max_request_body_size``, 1 GB by default, spilled to a
temporary file) before it calls the app, so a check in the app comes after the body has been
taken. Here waitress's own parser asks, the moment a request's head is complete, whether the
request is refused (no or a wrong token: :func:`sandboxes.host.app.head_check`); a refused request
is answered from its head and the connection closed, its body never read. A body past the host's
cap (``sandbox_write_max_mb``) is refused the same way (413, from the Content-Length, or once a
chunked body's running total passes it), in the service's JSON error shape.

The same channel answers with :class:`OneSendTask`: waitress sends a response's head and its body
in two sends (each write goes out at once), two segments that wake the caller twice; here a head
and the body that fits its Content-Length leave in one.
"""
from __future__ import annotations

import http
import json
from collections.abc import Callable

from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.task import WSGITask
from waitress.utilities import Error, RequestEntityTooLarge

# (method, path, headers as waitress keeps them: upper case, "_" for "-") -> None, or the
# refusal's status and JSON body
HeadCheck = Callable[[str, str, dict[str, str]], "tuple[int, bytes] | None"]


class Refused(Error):
    """A refusal waitress answers itself (its error task: written, then the connection closed)."""

    def __init__(self, code: int, body: bytes):
        super().__init__(body.decode())
        self.code, self.reason, self.payload = code, http.HTTPStatus(code).phrase, body

    def to_response(self, ident: str | None = None) -> tuple[str, list[tuple[str, str]], bytes]:
        return f"{self.code} {self.reason}", [("Content-Type", "application/json")], self.payload


def too_large(cap: int) -> Refused:
    body = {"error": {"type": "request_too_large",
                      "message": f"the request body passes the host's cap of {cap} bytes "
                                 "(sandbox_write_max_mb)"}}
    return Refused(413, json.dumps(body).encode())


def gated_channel(check: HeadCheck) -> type[HTTPChannel]:
    """A waitress channel class whose parser runs ``check`` on each request's head."""

    class GatedParser(HTTPRequestParser):
        def received(self, data: bytes) -> int:
            had_head = self.headers_finished
            consumed = super().received(data)
            if not had_head and self.headers_finished and \
                    (self.error is None or isinstance(self.error, RequestEntityTooLarge)):
                refusal = check(self.command or "", self.path or "", self.headers)
                if refusal is not None:
                    self.error, self.completed = Refused(*refusal), True
                    self.expect_continue = False  # no "100 Continue" to a refused request
            if isinstance(self.error, RequestEntityTooLarge):
                self.error = too_large(self.adj.max_request_body_size)
            return consumed

    class GatedChannel(HTTPChannel):
        parser_class = GatedParser
        task_class = OneSendTask

    return GatedChannel


class OneSendTask(WSGITask):
    """waitress's WSGI task, whose first write sends the response's head and the body together
    when the body fits the Content-Length (anything else: waitress's own writes, unchanged)."""

    def write(self, data: bytes) -> None:
        if self.wrote_header or not data or not self.complete:
            return super().write(data)  # (not complete: waitress raises)
        head = self.build_response_header()  # decides chunking and the close, as in waitress
        self.wrote_header = True
        room = None if self.content_length is None else self.content_length - self.content_bytes_written
        if self.has_body and not self.chunked_response and room is not None and len(data) <= room:
            self.content_bytes_written += len(data)
            self.channel.write_soon(head + data)
            return None
        self.channel.write_soon(head)
        return super().write(data)
