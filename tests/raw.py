"""Raw-socket HTTP/1.1 for tests that must send exact bytes (and read exact answers).

treq and twisted.web.client normalise what they send and buffer what they read; these
helpers do neither. :func:`request_bytes` and :func:`post_bytes` build requests byte
for byte. :class:`RawClient` is a Twisted protocol on a real loopback connection: it
writes what it is given and records every read with its arrival time, so a test can
see when bytes arrive, pause reading (a slow client, with a small ``SO_RCVBUF``) or
leave early. :func:`raw_exchange` is the one-shot form: send, collect until crossbar
closes (or half-closes) the connection, return the bytes.

:func:`parse_responses` is a deliberately strict HTTP/1.1 response parser, so a test
can assert that an answer is well-formed; :meth:`RawClient.response` uses the same
parser but accepts an answer that was cut off (``complete`` False) — what a failed
stream looks like to its client.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from zope.interface import implementer

from tests.harness import TwoHosts, port_of, wait_for
from tests.logs import LogCapture

__all__ = [
    "BadResponse", "RawClient", "RawResponse", "complete", "connect_raw", "parse_responses", "post_bytes",
    "still_serving",
    "raw_exchange", "request_bytes",
]


def request_bytes(method: bytes, target: bytes, headers: Sequence[tuple[bytes, bytes]] = (),
                  body: bytes = b"", close: bool = True) -> bytes:
    """A raw HTTP/1.1 request: ``Host`` first, then ``headers`` as given, then
    ``Connection: close`` (when ``close``), then ``body`` (no framing header is added)."""
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: crossbar.test"]
    lines += [n + b": " + v for n, v in headers]
    if close:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def post_bytes(target: bytes, body: bytes, extra: Sequence[tuple[bytes, bytes]] = (), close: bool = True) -> bytes:
    """A POST of the JSON ``body`` with its ``Content-Type`` and ``Content-Length``,
    then the ``extra`` headers."""
    headers = [(b"Content-Type", b"application/json"), (b"Content-Length", b"%d" % len(body)), *extra]
    return request_bytes(b"POST", target, headers, body, close=close)


class BadResponse(Exception):
    """The bytes crossbar sent are not a well-formed HTTP/1.1 response."""


@dataclass
class RawResponse:
    """One parsed response: status, headers in wire order (names lower-cased), body
    (de-chunked), whether the body was sent chunked, and whether it ended properly
    (the ``0`` chunk, or ``Content-Length`` bytes; False only for a cut-off answer
    read by :meth:`RawClient.response`)."""

    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    chunked: bool = False
    complete: bool = True

    def get(self, name: bytes) -> list[bytes]:
        """Every value of header ``name`` (case-insensitive), in order."""
        name = name.lower()
        return [v for n, v in self.headers if n == name]

    def one(self, name: bytes) -> bytes | None:
        """The first value of header ``name``, or None."""
        values = self.get(name)
        return values[0] if values else None


def _cut(response: RawResponse, body: bytes, problem: str, cut_ok: bool) -> tuple[RawResponse, bytes]:
    if not cut_ok:
        raise BadResponse(problem)
    response.body = body
    response.complete = False
    return response, b""


def _parse_one(data: bytes, head: bool, at_eof: bool, cut_ok: bool = False) -> tuple[RawResponse, bytes]:
    end = data.find(b"\r\n\r\n")
    if end < 0:
        raise BadResponse(f"no end of headers in {data[:200]!r}")
    lines = data[:end].split(b"\r\n")
    rest = data[end + 4:]
    version, _, tail = lines[0].partition(b" ")
    code, _, reason = tail.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise BadResponse(f"bad status line {lines[0]!r}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise BadResponse(f"bad header line {line!r}")
        headers.append((name.lower(), value.strip()))
    response = RawResponse(int(code), reason, headers, b"")
    status = response.status
    te = response.get(b"transfer-encoding")
    lengths = response.get(b"content-length")
    if head or status in (204, 304) or 100 <= status < 200:
        return response, rest
    if te:
        if te != [b"chunked"] or lengths:
            raise BadResponse(f"bad framing te={te} cl={lengths}")
        response.chunked = True
        # Offsets into ``rest`` and one bytearray: linear in the body (a 50 MB answer is
        # parsed in well under a second; slicing ``rest`` per chunk was quadratic).
        body = bytearray()
        at = 0
        while True:
            size_end = rest.find(b"\r\n", at)
            if size_end < 0:
                return _cut(response, bytes(body), "truncated chunked body (no size line)", cut_ok)
            size = int(rest[at:size_end].split(b";")[0], 16)
            chunk_end = size_end + 2 + size
            if len(rest) < chunk_end + 2:
                body += rest[size_end + 2:chunk_end]
                return _cut(response, bytes(body), "truncated chunked body", cut_ok)
            if rest[chunk_end:chunk_end + 2] != b"\r\n":
                raise BadResponse("chunk not followed by CRLF")
            body += rest[size_end + 2:chunk_end]
            at = chunk_end + 2
            if size == 0:
                break
        response.body = bytes(body)
        return response, rest[at:]
    if lengths:
        if len(set(lengths)) != 1:
            raise BadResponse(f"conflicting Content-Length {lengths}")
        n = int(lengths[0])
        if len(rest) < n:
            return _cut(response, rest, f"body shorter than Content-Length: {len(rest)} < {n}", cut_ok)
        response.body = rest[:n]
        return response, rest[n:]
    if not at_eof:
        raise BadResponse("body delimited by close on an open connection")
    response.body = rest
    return response, b""


def parse_responses(data: bytes, head: bool = False, at_eof: bool = True) -> list[RawResponse]:
    """Every response in ``data``, in order (interim ``1xx`` ones included).

    :raises BadResponse: when the bytes are not well-formed, complete HTTP/1.1 responses.
    """
    out: list[RawResponse] = []
    while data:
        response, data = _parse_one(data, head, at_eof)
        out.append(response)
    return out


def complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole, well-formed response (for ``until=``)."""
    try:
        return bool(parse_responses(data, at_eof=False))
    except (BadResponse, ValueError):
        return False


@implementer(IHalfCloseableProtocol)
class RawClient(Protocol):
    """Writes ``chunks`` on connect, then records what arrives.

    :ivar reads: each read as ``(time.time(), data)`` (unless ``keep_reads`` is False).
    :ivar received: bytes received so far (a count; :attr:`data` holds them).
    :ivar after_read: called with the client after each read (e.g. to pause the
        transport: a slow client).
    :ivar ended: fires with how the exchange ended: ``"until"`` (``until(data)`` held),
        ``"half-close"`` (the peer closed its side; not an end with ``wait_close``) or
        ``"close"``.
    :ivar closed: fires (with None) once the connection is gone.

    ``rcvbuf``, when given, is set as the socket's ``SO_RCVBUF`` (bytes) on connect.
    Unless ``wait_close``, the client closes its side too once the peer has closed.
    """

    def __init__(
        self,
        chunks: Sequence[bytes],
        rcvbuf: int | None = None,
        keep_reads: bool = True,
        until: Callable[[bytes], bool] | None = None,
        wait_close: bool = False,
    ) -> None:
        self.chunks = list(chunks)
        self.rcvbuf = rcvbuf
        self.keep_reads = keep_reads
        self.until = until
        self.wait_close = wait_close
        self.after_read: Callable[[RawClient], object] | None = None
        self.reads: list[tuple[float, bytes]] = []
        self.received = 0
        self.ended: Deferred[str] = Deferred()
        self.closed: Deferred[None] = Deferred()
        self._waiters: list[tuple[bytes, Deferred[None]]] = []
        self._buffer = bytearray()

    @property
    def data(self) -> bytes:
        """Every byte received so far."""
        return bytes(self._buffer)

    def connectionMade(self) -> None:
        if self.rcvbuf is not None:
            self.transport.getHandle().setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)  # type: ignore[union-attr]
        for chunk in self.chunks:
            self.transport.write(chunk)  # type: ignore[union-attr]

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
        if self.until is not None and self.until(self.data):
            self._end("until")
        if self.after_read is not None:
            self.after_read(self)

    def readConnectionLost(self) -> None:
        if not self.wait_close:
            self.transport.loseConnection()  # type: ignore[union-attr]
            self._end("half-close")

    def writeConnectionLost(self) -> None:
        pass

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self._end("close")
        self.closed.callback(None)
        for _, d in self._waiters:
            d.errback(reason)
        self._waiters = []

    def _end(self, how: str) -> None:
        if not self.ended.called:
            self.ended.callback(how)

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

    def response(self) -> RawResponse | None:
        """The (first) response received, possibly cut off (``complete`` False); None
        before the end of its head.

        :raises BadResponse: what arrived is not well-formed HTTP/1.1.
        """
        data = self.data
        if b"\r\n\r\n" not in data:
            return None
        return _parse_one(data, head=False, at_eof=True, cut_ok=True)[0]


async def _connect(port: int, client: RawClient) -> RawClient:
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)
    return client


async def connect_raw(
    case: TestCase, base_url: str, *chunks: bytes, rcvbuf: int | None = None, keep_reads: bool = True
) -> RawClient:
    """Connect a :class:`RawClient` that sends ``chunks`` to ``base_url``
    (``http://127.0.0.1:PORT``); the connection is aborted at cleanup if still open."""
    client = await _connect(port_of(base_url), RawClient(chunks, rcvbuf, keep_reads))

    async def close() -> None:
        if not client.closed.called:
            client.transport.abortConnection()  # type: ignore[union-attr]
            await client.closed

    case.addCleanup(lambda: Deferred.fromCoroutine(close()))
    return client


async def raw_exchange(
    port: int,
    *chunks: bytes,
    timeout: float = 10.0,
    until: Callable[[bytes], bool] | None = None,
    wait_close: bool = False,
    trickle: bytes = b"",
) -> tuple[bytes, str]:
    """Send ``chunks`` on a new loopback connection to ``port`` and collect every byte
    until crossbar closes or half-closes it (or ``until(received)`` holds).

    Returns ``(received, how)``, ``how`` being ``"close"``, ``"half-close"`` or
    ``"until"``; with ``wait_close`` a half-close is not an end (only a full close,
    ``until`` or the timeout are). The connection is closed and its end awaited before
    returning. ``trickle``, when given, is written again every 0.1 s until the
    connection ends (a client that keeps sending; a reset is only noticed on a write).

    :raises AssertionError: nothing ended within ``timeout`` seconds.
    """
    client = await _connect(port, RawClient(chunks, keep_reads=False, until=until, wait_close=wait_close))
    timer = reactor.callLater(timeout, client._end, "timeout")
    sender = LoopingCall(client.transport.write, trickle)  # type: ignore[union-attr]
    if trickle:
        sender.start(0.1)
    how = await client.ended
    if sender.running:
        sender.stop()
    if timer.active():
        timer.cancel()
    client.transport.abortConnection()  # type: ignore[union-attr]
    await client.closed
    received = client.data
    assert how != "timeout", f"no end within {timeout}s; got {received[:300]!r}"
    return received, how


async def still_serving(case: TestCase, hosts: TwoHosts, watch: LogCapture) -> None:
    """After an attack: a normal request to route ``r`` is answered 200 by host ``a``,
    both hosts are still healthy (nothing was marked down), nothing was logged as an
    error, and no request is left in flight."""
    body = b'{"model": "model-a", "messages": []}'
    data, _ = await raw_exchange(hosts.port, post_bytes(b"/r/v1/chat/completions", body))
    [answer] = parse_responses(data)
    case.assertEqual((answer.status, answer.one(b"x-crossbar-host")), (200, b"a"))
    for name in ("a", "b"):
        status = hosts.service.table.get(name)
        assert status is not None
        case.assertTrue(status.healthy, (name, status.last_err))
    case.assertEqual(watch.errors(), [])
    await wait_for(lambda: not hosts.service.runtime.active, 2.0)
