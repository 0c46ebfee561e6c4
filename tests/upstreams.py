"""Misbehaving upstreams for the streaming and failure tests.

Each handler plugs into :attr:`tests.harness.FakeLlama.handlers` (``path -> f(request,
body)``). :class:`RawHost` is a raw-socket upstream that answers health polls well and
runs a script for anything else; :class:`RawFirehose` is one. :func:`host_status` reads
crossbar's view of its hosts.
"""

from __future__ import annotations

from typing import Any, Callable

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from tests.harness import http_client, sse_event

__all__ = [
    "Die", "Firehose", "Hang", "KillReused", "RawFirehose", "RawHost", "RawHostProtocol", "Script", "host_status",
    "serve_raw",
]

Script = Callable[["RawHostProtocol"], object]


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
    (a host that dies while working on it); with ``every``, it answers only the very
    first request and kills the connection of every later one.

    :ivar requests: requests received; :ivar connections: distinct connections seen.
    """

    def __init__(self, delay: float = 0.0, every: bool = False) -> None:
        self.delay = delay
        self.every = every
        self.requests = 0
        self.killed = 0
        # The channels themselves, not their id(): a closed connection's channel is freed,
        # and a fresh one may be made at the same address (the same id) at once.
        self._served: set[object] = set()
        self.connections: set[object] = set()

    def __call__(self, request: Request, body: bytes) -> Any:
        self.requests += 1
        channel = request.channel
        self.connections.add(channel)
        if channel in self._served or (self.every and self._served):
            self.killed += 1
            reactor.callLater(self.delay, request.channel.transport.abortConnection)  # type: ignore[attr-defined]
            return NOT_DONE_YET
        self._served.add(channel)
        request.setHeader(b"content-type", b"application/json")
        return b'{"object": "chat.completion", "body": ' + str(len(body)).encode() + b"}"


class RawHostProtocol(Protocol):
    """One connection to a :class:`RawHost`.

    :ivar buffer: the bytes received so far.
    :ivar written: bytes written through :meth:`write`.
    :ivar closed: fires once the connection is gone.
    """

    def __init__(self, owner: RawHost) -> None:
        self.owner = owner
        self.buffer = b""
        self.answered = False
        self.written = 0
        self.closed: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        if self.answered or b"\r\n\r\n" not in self.buffer:
            return
        line = self.buffer.split(b"\r\n", 1)[0]
        if b" /health " in line or b" /v1/models " in line:
            body = b'{"status": "ok"}' if b"/health" in line else b'{"data": [{"id": "tiny-a"}]}'
            self.transport.write(  # type: ignore[union-attr]
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            self.transport.loseConnection()  # type: ignore[union-attr]
            return
        self.answered = True
        self.owner.requests.append(self)
        self.owner.script(self)

    def write(self, data: bytes) -> None:
        self.written += len(data)
        self.transport.write(data)  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.closed.callback(None)


class RawHost(Factory):
    """A raw-socket host: minimal good answers to ``/health`` and ``/v1/models`` (one
    per connection), and ``script(protocol)`` for any other request once its head has
    arrived (the protocol's ``buffer`` holds what was received so far).

    :ivar requests: the protocols of the scripted requests, in order.
    """

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[RawHostProtocol] = []

    def buildProtocol(self, addr: Any) -> Protocol:
        return RawHostProtocol(self)


async def serve_raw(case: TestCase, host: RawHost) -> str:
    """Serve ``host`` on a free loopback port for the test (its scripted connections are
    aborted at the end); returns its base URL."""
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(host)

    async def stop() -> None:
        await port.stopListening()
        for proto in host.requests:
            if not proto.closed.called:
                proto.transport.abortConnection()  # type: ignore[union-attr]
                await proto.closed

    case.addCleanup(lambda: ensureDeferred(stop()))
    return f"http://127.0.0.1:{port.getHost().port}"


@implementer(IPushProducer)
class RawFirehose(RawHost):
    """A raw-socket upstream whose first write is the head and a body chunk together,
    exactly 64 KiB (so crossbar reads head and body in one read), and which then writes
    ``total`` body bytes as fast as the connection takes them. ``/health`` and
    ``/v1/models`` get minimal good answers (one per connection).

    :ivar written: body bytes written; :ivar closed: fires when the answering
        connection closes.
    """

    def __init__(self, total: int) -> None:
        super().__init__(self._answer)
        self.total = total
        self.chunk = b"z" * 65536
        self.written = 0
        self.started = False
        self.paused = False
        self.closed: Deferred[None] = Deferred()
        self._proto: RawHostProtocol | None = None

    def _answer(self, proto: RawHostProtocol) -> None:
        self.started = True
        self._proto = proto
        proto.closed.addCallback(lambda _: None if self.closed.called else self.closed.callback(None))
        proto.transport.registerProducer(self, True)  # type: ignore[union-attr]
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        first = 65536 - len(head) - 16
        self._send(head + b"%x\r\n" % first + b"y" * first + b"\r\n", first)
        self.resumeProducing()

    def _send(self, data: bytes, body: int) -> None:
        assert self._proto is not None
        self.written += body
        self._proto.write(data)

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        while not self.paused and self.written < self.total:
            self._send(b"%x\r\n" % len(self.chunk) + self.chunk + b"\r\n", len(self.chunk))

    def stopProducing(self) -> None:
        self.paused = True
