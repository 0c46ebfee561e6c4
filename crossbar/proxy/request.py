"""The HTTP request class crossbar's site uses: bodies capped while they arrive.

twisted.web reads a whole request body before ``render``; :class:`CappedRequest` refuses
one over :data:`MAX_BODY` as soon as it is known to be too big (docs/design.md §The proxy,
rule 4): on ``Content-Length`` before any of the body is read (and before ``100 Continue``
would be sent), or, for a chunked body, at the byte that crosses the limit. The body is
held in memory (never a temporary file: no blocking disk I/O on the reactor thread).

Bodies cost bounded memory (docs/design.md §The proxy, rule 9): small
chunks are joined into :data:`PIECE`-byte pieces as they arrive (at most ~1.1 times the
body's size whatever its framing), a chunked body whose chunks average under
:data:`MIN_CHUNK_AVERAGE` bytes is refused 400, a body is released the moment its
request ends or its client leaves, and all held bodies together stay under
:data:`BODY_BUDGET` (503 with ``Retry-After`` beyond it).

Each piece is also fed to a :class:`crossbar.proxy.peek.BodyPeek` as it arrives, so the model
and the affinity key are known when the body is complete (``request.peeked``) without
ever parsing the whole body in one reactor turn (docs/design.md §"Quality bar").
"""

from __future__ import annotations

from io import BytesIO
from typing import Any, Callable

from twisted.internet.interfaces import ISSLTransport
from twisted.python.failure import Failure
from twisted.web.server import Request

from crossbar.errors import raw_error_answer
from crossbar.proxy.cors import cors_headers
from crossbar.proxy.peek import NOTHING, BodyPeek, Peeked

__all__ = [
    "BODIES", "BODY_BUDGET", "MAX_BODY", "MIN_CHUNK_AVERAGE", "NO_BODY_METHODS", "BodyBudget", "CappedRequest",
]

MAX_BODY = 16 * 1024 * 1024
"""The largest request body crossbar accepts, in bytes (docs/design.md §The proxy, rule 4)."""

NO_BODY_METHODS = frozenset({b"GET", b"HEAD"})
"""Methods whose body (if any) is never peeked (docs/design.md §The proxy, rule 4)."""

_LINGER_SECONDS = 5.0

BODY_BUDGET = 256 * 1024 * 1024
"""Bytes of request bodies one crossbar process holds at once, all requests together
(docs/design.md §The proxy, rule 9): a body that would go over it is refused 503 with
``Retry-After`` (16 full-size bodies at once; the rest wait for a retry)."""

PIECE = 64 * 1024
"""Small body chunks are joined into pieces of this many bytes as they arrive: a body
sent as millions of 1-byte chunks is held as 64 KiB pieces, not millions of ``bytes``
objects (each ~33 bytes of overhead), and fed to the peek in those pieces."""

MIN_CHUNK_AVERAGE = 64
"""A chunked body whose chunks average fewer bytes than this, past the first
:data:`_CHUNK_GRACE` of them, is refused 400: framing that is mostly overhead costs the
reactor one parse per chunk (16 million 1-byte chunks took 40 s of CPU) and is no
client's honest shape (docs/design.md §The proxy, rule 9)."""

_CHUNK_GRACE = 1024


class BodyBudget:
    """The bytes of request bodies held by this process, against ``limit`` (bytes)."""

    def __init__(self, limit: int = BODY_BUDGET) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        """Hold ``size`` more bytes if that stays within the limit; whether it did."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        """``size`` bytes held are released."""
        self.held = max(0, self.held - size)


BODIES = BodyBudget()
"""The process's budget, shared by every :class:`CappedRequest` (its ``budget``)."""


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
    budget = BODIES
    defaultContentType = None  # never invent a Content-Type for an upstream answer
    on_lost: Callable[[Failure], None] | None = None
    """Called with the reason when the client's connection is lost before the request
    finished: what a ``notifyFinish`` Deferred's errback hears, without a Deferred made
    and fired per request (the exchange's :meth:`~crossbar.proxy.exchange.Exchange.on_client_gone`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused = False
        self._received = 0
        self._held = 0  # bytes of this body counted against the budget
        self._calls = 0  # chunks handed over by a chunked body's decoder
        self._chunked = False
        self._tail = bytearray()  # small chunks not yet joined into a piece
        self._linger: Any = None
        self._peek: BodyPeek | None = None  # made by the first body chunk
        self.peeked: Peeked = NOTHING
        self.body_chunks: list[bytes] = []
        """The body as it arrived, in pieces (never copied into one buffer: a 16 MiB
        body grown in a ``BytesIO`` costs a multi-millisecond copy on the reactor; small
        chunks are joined into :data:`PIECE`-byte pieces, so the body costs at most
        about 1.1 times its size whatever its framing); ``content`` stays empty. Emptied
        the moment the request ends or its client leaves (:meth:`release_body`)."""

    def gotLength(self, length: int | None) -> None:
        self.content = BytesIO()
        self._chunked = length is None
        if length is not None and length > self.max_body:
            self.refuse(413, "body too large")
        elif length and self.budget.held + length > self.budget.limit:
            self.refuse(503, "too many request bodies held")

    def handleContentChunk(self, data: bytes) -> None:
        if self.refused:
            return
        size = len(data)
        self._received += size
        if self._received > self.max_body:
            self.refuse(413, "body too large")
            return
        if self._chunked:
            self._calls += 1
            if self._calls > _CHUNK_GRACE and self._received < self._calls * MIN_CHUNK_AVERAGE:
                self.refuse(400, "chunk framing too small")
                return
        if not self.budget.take(size):
            self.refuse(503, "too many request bodies held")
            return
        self._held += size
        tail = self._tail
        if size >= PIECE and not tail:
            self._keep(data)
            return
        tail += data
        if len(tail) >= PIECE:
            self._flush_tail()

    def _flush_tail(self) -> None:
        if self._tail:
            piece, self._tail = bytes(self._tail), bytearray()
            self._keep(piece)

    def _keep(self, piece: bytes) -> None:
        self.body_chunks.append(piece)
        if self._peek is None:
            self._peek = BodyPeek()
        self._peek.feed(piece)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if not self.refused:
            self._flush_tail()
        peek, self._peek = self._peek, None
        if peek is not None and not self.refused and command not in NO_BODY_METHODS:
            self.peeked = peek.finish()
        super().requestReceived(command, path, version)

    def release_body(self) -> None:
        """Drop the held body now and give its bytes back to the budget: the request
        ended or its client left (docs/design.md §The proxy, rule 9). The list is emptied in
        place, so whoever else holds it (the exchange, for a failover) lets go too."""
        self.body_chunks.clear()
        self._tail = bytearray()
        self._peek = None
        held, self._held = self._held, 0
        self.budget.give(held)

    def finish(self) -> None:
        super().finish()
        self.on_lost = None  # as Twisted drops its notifyFinish Deferreds; no cycle with the exchange left
        self.release_body()

    def process(self) -> None:
        if self.refused:
            return
        super().process()

    def refuse(self, code: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """Answer ``code`` with the JSON error ``message`` (and ``headers``) now,
        on the request head, without reading the body: the 413 for a body over the
        limit, a keyed route's 401 (docs/design.md §Access). The connection closes after it.
        """
        if self.refused:
            return
        self.refused = True
        self.content = BytesIO()
        self.release_body()
        # No "100 Continue" for a body we will not read (HTTPChannel sends it after
        # gotLength returns when this header is present).
        self.requestHeaders.removeHeader(b"expect")
        transport: Any = self.channel.transport  # an ITCPTransport (write, half-close, abort)
        answer, sent = raw_error_answer(code, message, head_only=self.head_line()[0] == b"HEAD",
                                        extra=headers + cors_headers(self.requestHeaders))
        transport.write(answer)
        self.channel.persistent = False
        self.refused_answer(code, sent)
        # What the client still sends is read and dropped unparsed: no chunk framing
        # of a refused body costs the reactor anything (Twisted drops bytes after a
        # non-persistent request the same way).
        self.channel.dataReceived = _drop  # type: ignore[method-assign]
        # Half-close a plain TCP connection (the client can still send, and read the
        # answer instead of a reset); TLS (an ``ssl:`` listener) is closed whole: its
        # half-close broke inside Twisted's TLS layer when the client then closed.
        # The channel's close unregisters it as the transport's producer first: Twisted's
        # TLS layer sends no close while a producer is registered, so the connection
        # stayed open until the client closed it. Either way the connection
        # is dropped after _LINGER_SECONDS at the latest (a TLS client that never
        # answers the close, a TCP client that keeps sending).
        half_close = None if ISSLTransport.providedBy(transport) else getattr(transport, "loseWriteConnection", None)
        if half_close is None:
            self.channel.loseConnection()
        else:
            half_close()
        self._linger = self.channel.callLater(_LINGER_SECONDS, transport.abortConnection)

    def head_line(self) -> tuple[bytes, bytes]:
        """The request's method and target; a subclass that knows them on the head
        (before Twisted sets ``method`` and ``uri``, after the body) says so."""
        return self.method, self.uri

    def refused_answer(self, code: int, body_bytes: int) -> None:
        """Called once a refusal (``code``, with ``body_bytes`` of body) was written: a
        subclass records it (docs/design.md §The proxy, rule 8). This one does nothing."""

    def connectionLost(self, reason: Any) -> None:
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        self.release_body()  # the request and its channel form a cycle: free it now
        super().connectionLost(reason)
        on_lost, self.on_lost = self.on_lost, None
        if on_lost is not None:
            on_lost(reason)


def _drop(data: bytes) -> None:
    """Read and ignore (a refused request's connection, until it closes)."""
