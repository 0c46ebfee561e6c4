"""Misbehaving upstreams for the streaming and failure tests.

Each handler plugs into :attr:`tests.harness.FakeLlama.handlers` (``path -> f(request,
body)``); :class:`RawFirehose` is a raw-socket upstream. :func:`host_status` reads
crossbar's view of its hosts.
"""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from tests.harness import http_client, sse_event

__all__ = [
    "Die", "Firehose", "Hang", "KillReused", "RawFirehose", "host_status",
]


async def host_status(case: TestCase, base: str) -> dict[str, Any]:
    """``/_crossbar/status``'s ``hosts`` document."""
    response = await http_client(case).get(base + "/_crossbar/status")
    doc = await treq.json_content(response)
    return doc["hosts"]  # type: ignore[no-any-return]


@implementer(IPushProducer)
class Firehose:
    """An upstream answer of ``total`` bytes written as fast as the connection takes them
    (a push producer on the upstream's request: it writes while not paused).

    :ivar written: body bytes handed to the upstream's transport so far.
    :ivar pauses: how often the upstream's connection paused this producer.
    """

    def __init__(self, total: int, chunk: int = 64 * 1024) -> None:
        self.total = total
        self.chunk = b"x" * chunk
        self.written = 0
        self.pauses = 0
        self.paused = False
        self.request: Request | None = None
        self.closed: Deferred[None] = Deferred()

    def __call__(self, request: Request, body: bytes) -> Any:
        self.request = request
        request.setHeader(b"content-type", b"application/octet-stream")
        request.notifyFinish().addBoth(lambda _: self.closed.called or self.closed.callback(None))
        request.registerProducer(self, True)
        reactor.callLater(0, self.resumeProducing)  # type: ignore[attr-defined]
        return NOT_DONE_YET

    def pauseProducing(self) -> None:
        if not self.paused:
            self.pauses += 1
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        request = self.request
        assert request is not None
        while not self.paused and self.written < self.total and not request.finished:
            if request._disconnected:  # type: ignore[attr-defined]
                return
            self.written += len(self.chunk)
            request.write(self.chunk)
        if self.written >= self.total and not request.finished and not request._disconnected:  # type: ignore[attr-defined]
            request.unregisterProducer()
            request.finish()

    def stopProducing(self) -> None:
        self.paused = True


class Hang:
    """An upstream that takes the request and never answers (or, with ``events``,
    sends the headers and that many events and then goes silent).

    :ivar requests: requests received.
    :ivar closed: fires when crossbar closes the connection of the last request.
    """

    def __init__(self, events: int = 0) -> None:
        self.events = events
        self.requests = 0
        self.closed: Deferred[None] = Deferred()

    def __call__(self, request: Request, body: bytes) -> Any:
        self.requests += 1
        self.closed = Deferred()
        closed = self.closed
        request.notifyFinish().addBoth(lambda _: closed.called or closed.callback(None))
        if self.events:
            request.setHeader(b"content-type", b"text/event-stream")
            for i in range(self.events):
                request.write(sse_event(i))
        return NOT_DONE_YET


class Die:
    """An upstream whose connection dies: before any answer (``events=None``), or after
    the headers and ``events`` events of a chunked answer.

    :ivar requests: requests received.
    """

    def __init__(self, events: int | None = None, delay: float = 0.05) -> None:
        self.events = events
        self.delay = delay
        self.requests = 0

    def __call__(self, request: Request, body: bytes) -> Any:
        self.requests += 1
        transport = request.channel.transport
        if self.events is not None:
            request.setHeader(b"content-type", b"text/event-stream")
            for i in range(self.events):
                request.write(sse_event(i))
        reactor.callLater(self.delay, transport.abortConnection)  # type: ignore[attr-defined]
        return NOT_DONE_YET


class KillReused:
    """An upstream completion handler that answers the first request on a connection and
    kills the connection when a second request arrives on it (an upstream closing an
    idle keep-alive connection just as crossbar reuses it), or ``delay`` seconds later
    (a host that dies while working on it).

    :ivar requests: requests received; :ivar connections: distinct connections seen.
    """

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.requests = 0
        self.killed = 0
        self._served: set[int] = set()
        self.connections: set[int] = set()

    def __call__(self, request: Request, body: bytes) -> Any:
        self.requests += 1
        channel = id(request.channel)
        self.connections.add(channel)
        if channel in self._served:
            self.killed += 1
            reactor.callLater(self.delay, request.channel.transport.abortConnection)  # type: ignore[attr-defined]
            return NOT_DONE_YET
        self._served.add(channel)
        request.setHeader(b"content-type", b"application/json")
        return b'{"object": "chat.completion", "body": ' + str(len(body)).encode() + b"}"


@implementer(IPushProducer)
class _RawFirehoseProtocol(Protocol):
    def __init__(self, owner: RawFirehose) -> None:
        self.owner = owner
        self.paused = False
        self.started = False

    def dataReceived(self, data: bytes) -> None:
        if self.started or b"\r\n\r\n" not in data:
            return
        line = data.split(b"\r\n", 1)[0]
        if b" /health " in line or b" /v1/models " in line:
            body = b'{"status": "ok"}' if b"/health" in line else b'{"data": [{"id": "tiny-a"}]}'
            self.transport.write(  # type: ignore[union-attr]
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            self.transport.loseConnection()  # type: ignore[union-attr]
            return
        self.started = True
        self.owner.started = True
        self.transport.registerProducer(self, True)  # type: ignore[union-attr]
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        first = 65536 - len(head) - 16
        self._send(head + b"%x\r\n" % first + b"y" * first + b"\r\n", first)
        self.resumeProducing()

    def _send(self, data: bytes, body: int) -> None:
        self.owner.written += body
        self.transport.write(data)  # type: ignore[union-attr]

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        chunk = self.owner.chunk
        while not self.paused and self.owner.written < self.owner.total:
            self._send(b"%x\r\n" % len(chunk) + chunk + b"\r\n", len(chunk))

    def stopProducing(self) -> None:
        self.paused = True

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        if self.started and not self.owner.closed.called:
            self.owner.closed.callback(None)


class RawFirehose(Factory):
    """A raw-socket upstream whose first write is the head and a body chunk together,
    exactly 64 KiB (so crossbar reads head and body in one read), and which then writes
    ``total`` body bytes as fast as the connection takes them. ``/health`` and
    ``/v1/models`` get minimal good answers (one per connection).

    :ivar written: body bytes written; :ivar closed: fires when the answering
        connection closes.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.chunk = b"z" * 65536
        self.written = 0
        self.started = False
        self.closed: Deferred[None] = Deferred()

    def buildProtocol(self, addr: Any) -> Protocol:
        return _RawFirehoseProtocol(self)
