"""The HTTP request class crossbar's site uses: bodies capped while they arrive.

twisted.web reads a whole request body before ``render``; :class:`CappedRequest` refuses
one over :data:`MAX_BODY` as soon as it is known to be too big (DESIGN.md §The proxy,
rule 4): on ``Content-Length`` before any of the body is read (and before ``100 Continue``
would be sent), or, for a chunked body, at the byte that crosses the limit. The body is
held in memory (never a temporary file: no blocking disk I/O on the reactor thread).

Each chunk is also fed to a :class:`crossbar.proxy.peek.BodyPeek` as it arrives, so the model
and the affinity key are known when the body is complete (``request.peeked``) without
ever parsing the whole body in one reactor turn (DESIGN.md §"Quality bar").
"""

from __future__ import annotations

from io import BytesIO
from typing import Any

from twisted.internet.interfaces import ISSLTransport
from twisted.web.server import Request

from crossbar.errors import json_error_bytes
from crossbar.proxy.cors import cors_headers
from crossbar.proxy.peek import NOTHING, BodyPeek, Peeked

__all__ = ["MAX_BODY", "NO_BODY_METHODS", "CappedRequest"]

MAX_BODY = 16 * 1024 * 1024
"""The largest request body crossbar accepts, in bytes (DESIGN.md §The proxy, rule 4)."""

NO_BODY_METHODS = frozenset({b"GET", b"HEAD"})
"""Methods whose body (if any) is never peeked (DESIGN.md §The proxy, rule 4)."""

_LINGER_SECONDS = 5.0


class CappedRequest(Request):
    """A ``twisted.web.server.Request`` that refuses bodies over ``max_body`` bytes early.

    A refused request is answered ``413 {"error": "body too large"}`` straight on the
    transport, its write side is closed, and whatever the client still sends is read
    and dropped for a few seconds (so the client can read the answer instead of getting
    a connection reset), then the connection is closed. Such a request never reaches a
    resource.

    ``peeked`` (a :class:`crossbar.proxy.peek.Peeked`): the body's model and affinity key, set
    once the whole body has arrived (before ``process``); ``Peeked(None, None)`` for
    GET and HEAD, a body that is not a JSON object, and until the body is complete.
    """

    max_body = MAX_BODY
    defaultContentType = None  # never invent a Content-Type for an upstream answer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused = False
        self._received = 0
        self._linger: Any = None
        self._peek: BodyPeek | None = None  # made by the first body chunk
        self.peeked: Peeked = NOTHING
        self.body_chunks: list[bytes] = []
        """The body as it arrived, chunk by chunk (never copied into one buffer: a
        16 MiB body grown in a ``BytesIO`` costs a multi-millisecond copy on the
        reactor); ``content`` stays empty."""

    def gotLength(self, length: int | None) -> None:
        self.content = BytesIO()
        if length is not None and length > self.max_body:
            self.refuse(413, b"Content Too Large", "body too large")

    def handleContentChunk(self, data: bytes) -> None:
        if self.refused:
            return
        self._received += len(data)
        if self._received > self.max_body:
            self.refuse(413, b"Content Too Large", "body too large")
            return
        self.body_chunks.append(data)
        if self._peek is None:
            self._peek = BodyPeek()
        self._peek.feed(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        peek, self._peek = self._peek, None
        if peek is not None and not self.refused and command not in NO_BODY_METHODS:
            self.peeked = peek.finish()
        super().requestReceived(command, path, version)

    def process(self) -> None:
        if self.refused:
            return
        super().process()

    def refuse(self, code: int, phrase: bytes, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """Answer ``code phrase`` with the JSON error ``message`` (and ``headers``) now,
        on the request head, without reading the body: the 413 for a body over the
        limit, a keyed route's 401 (DESIGN.md §Access). The connection closes after it.
        """
        if self.refused:
            return
        self.refused = True
        self.content = BytesIO()
        self.body_chunks = []
        self._peek = None
        # No "100 Continue" for a body we will not read (HTTPChannel sends it after
        # gotLength returns when this header is present).
        self.requestHeaders.removeHeader(b"expect")
        body = json_error_bytes(message)
        sent = b"" if self.head_line()[0] == b"HEAD" else body  # a HEAD answer has no content
        transport: Any = self.channel.transport  # an ITCPTransport (write, half-close, abort)
        headers += cors_headers(self.requestHeaders)
        transport.write(
            b"HTTP/1.1 %d %s\r\n" % (code, phrase)
            + b"".join(name + b": " + value + b"\r\n" for name, value in headers)
            + b"Content-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode("ascii") + b"\r\n"
            b"Connection: close\r\n\r\n" + sent
        )
        self.channel.persistent = False
        self.refused_answer(code, len(sent))
        # Half-close a plain TCP connection (the client can still send, and read the
        # answer instead of a reset); TLS (an ``ssl:`` listener) is closed whole: its
        # half-close broke inside Twisted's TLS layer when the client then closed.
        half_close = None if ISSLTransport.providedBy(transport) else getattr(transport, "loseWriteConnection", None)
        if half_close is None:
            transport.loseConnection()
            return
        half_close()
        self._linger = self.channel.callLater(_LINGER_SECONDS, transport.abortConnection)

    def head_line(self) -> tuple[bytes, bytes]:
        """The request's method and target; a subclass that knows them on the head
        (before Twisted sets ``method`` and ``uri``, after the body) says so."""
        return self.method, self.uri

    def refused_answer(self, code: int, body_bytes: int) -> None:
        """Called once a refusal (``code``, with ``body_bytes`` of body) was written: a
        subclass records it (DESIGN.md §The proxy, rule 8). This one does nothing."""

    def connectionLost(self, reason: Any) -> None:
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        super().connectionLost(reason)
