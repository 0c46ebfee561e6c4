"""A raw HTTP/1.1 client for streaming tests: no buffering, every read recorded.

:class:`RawClient` writes one request on a real loopback TCP connection and records
each ``dataReceived`` call with its arrival time, so tests can see exactly when bytes
arrive, pause reading (a slow client), close early (a client that leaves) and check
whether a chunked body ended cleanly (the terminating ``0`` chunk) or was cut off.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

__all__ = ["RawClient", "Response", "connect_raw", "parse_response", "request_bytes"]


def request_bytes(method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> bytes:
    """An HTTP/1.1 request for ``127.0.0.1`` with ``Connection: close`` (so the
    connection ends with the answer) and ``Content-Length`` when there is a body."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


class Response:
    """A parsed (possibly truncated) HTTP/1.1 response.

    :ivar status: the status code.
    :ivar headers: lower-cased name -> list of values.
    :ivar body: the de-chunked body bytes received.
    :ivar complete: True when the body ended properly (``0`` chunk, or ``Content-Length``
        bytes), False when it was cut off.
    """

    def __init__(self, status: int, headers: dict[str, list[str]], body: bytes, complete: bool) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.complete = complete

    def header(self, name: str) -> str | None:
        values = self.headers.get(name.lower())
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)


def parse_response(raw: bytes) -> Response | None:
    """Parse one response from ``raw`` (the bytes of a closed connection); None before
    the end of the headers."""
    head, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    if "chunked" in ",".join(headers.get("transfer-encoding", [])).lower():
        parts: list[bytes] = []
        pos = 0
        while True:
            eol = rest.find(b"\r\n", pos)
            if eol < 0:
                return Response(status, headers, b"".join(parts), False)
            size = int(rest[pos:eol].split(b";")[0], 16)
            start = eol + 2
            if size == 0:
                return Response(status, headers, b"".join(parts), rest[start:start + 2] == b"\r\n")
            parts.append(rest[start:start + size])
            if len(rest) < start + size + 2:
                return Response(status, headers, b"".join(parts), False)
            pos = start + size + 2
    length = headers.get("content-length")
    if length is not None:
        n = int(length[0])
        return Response(status, headers, rest[:n], len(rest) >= n)
    return Response(status, headers, rest, True)


class RawClient(Protocol):
    """Sends ``request`` on connect; records every read as ``(time.time(), bytes)``.

    :ivar reads: each ``dataReceived`` as ``(time.time(), data)`` (unless ``keep_reads``
        is False).
    :ivar received: body and head bytes received so far.
    :ivar after_read: called after each read (e.g. to pause the transport: a slow client).
    :ivar closed: fires (with None) once the connection is gone.
    :ivar reason: why it closed (a ``Failure``), once it has.
    """

    def __init__(self, request: bytes, rcvbuf: int | None = None, keep_reads: bool = True) -> None:
        self.request = request
        self.rcvbuf = rcvbuf
        self.keep_reads = keep_reads
        self.after_read: Any = None
        self.reads: list[tuple[float, bytes]] = []
        self.received = 0
        self.closed: Deferred[None] = Deferred()
        self.reason: Failure | None = None
        self._waiters: list[tuple[bytes, Deferred[None]]] = []
        self._buffer = bytearray()

    def connectionMade(self) -> None:
        if self.rcvbuf is not None:
            self.transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)  # type: ignore[attr-defined]
        self.transport.write(self.request)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        if self.keep_reads:
            self.reads.append((time.time(), data))
        self.received += len(data)
        self._buffer += data
        for waiter in list(self._waiters):
            marker, d = waiter
            if marker in self._buffer:
                self._waiters.remove(waiter)
                d.callback(None)
        if self.after_read is not None:
            self.after_read(self)

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.reason = reason
        self.closed.callback(None)
        for _, d in self._waiters:
            d.errback(reason)
        self._waiters = []

    @property
    def data(self) -> bytes:
        return bytes(self._buffer)

    def wait_for(self, marker: bytes) -> Deferred[None]:
        """Fires once ``marker`` has been received (errbacks if the connection closes first)."""
        d: Deferred[None] = Deferred()
        if marker in self._buffer:
            d.callback(None)
        elif self.closed.called:
            d.errback(RuntimeError(f"closed before {marker!r}"))
        else:
            self._waiters.append((marker, d))
        return d

    def response(self) -> Response | None:
        return parse_response(self.data)


async def connect_raw(
    case: TestCase, base_url: str, request: bytes, rcvbuf: int | None = None, keep_reads: bool = True
) -> RawClient:
    """Connect a :class:`RawClient` to ``base_url`` (``http://127.0.0.1:PORT``); the
    connection is aborted at cleanup if still open."""
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    client = RawClient(request, rcvbuf, keep_reads)
    await TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(Factory.forProtocol(lambda: client))

    async def close() -> None:
        if not client.closed.called:
            client.transport.abortConnection()  # type: ignore[union-attr]
            await client.closed

    case.addCleanup(lambda: Deferred.fromCoroutine(close()))
    return client
