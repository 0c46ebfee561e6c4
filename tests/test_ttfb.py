"""Issue 11 item 7: time to first byte counts from when the request (body included) was
sent to the host, not from when the connection attempt began (docs/design.md
§Configuration, ``timeouts``; rule 8).

Unit level, on a :class:`~twisted.internet.task.Clock`: crossbar's real HTTP/1.1 client
(:class:`~crossbar.upstream.h1client.H1Agent`) and :class:`~crossbar.upstream.pools.ConnectTracker`,
over a fake endpoint whose connection opens 2 s after the request is started; the
host's head comes 1 s after that. The :class:`~crossbar.proxy.attempt.Answer` says the request
was sent at 2 s, and the exchange records a ttfb of 1 s.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IProtocolFactory, IStreamClientEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import URI
from twisted.web.http_headers import Headers
from twisted.web.test.requesthelper import DummyChannel
from zope.interface import implementer

from crossbar.proxy.attempt import Answer, Attempt
from crossbar.config import parse_config
from crossbar.ops.metrics import Metrics
from crossbar.proxy.resource import ProxyResource
from crossbar.proxy.head import RequestHead
from crossbar.proxy.peek import peek
from crossbar.proxy.web import CrossbarRequest
from crossbar.ops.record import RequestLog, RequestRecord
from crossbar.state.runtime import Runtime
from crossbar.upstream.h1client import H1Agent
from crossbar.upstream.pools import ConnectTracker

CONNECT_DELAY = 2.0
"""Seconds from the request started to its connection open."""
HEAD_DELAY = 1.0
"""Seconds from the connection open (the request written on it) to the host's head."""
BODY = b'{"model": "tiny-a", "messages": []}'
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@implementer(IStreamClientEndpoint)
class SlowEndpoint:
    """Connects :data:`CONNECT_DELAY` s (on ``clock``) after being asked, to a
    :class:`StringTransport`; :attr:`protocols` are the connected client protocols."""

    def __init__(self, clock: Clock, protocols: list[tuple[Any, StringTransport]]) -> None:
        self.clock = clock
        self.protocols = protocols

    def connect(self, factory: IProtocolFactory) -> Deferred[Any]:
        d: Deferred[Any] = Deferred()

        def opened() -> None:
            protocol = factory.buildProtocol(None)  # type: ignore[arg-type]
            assert protocol is not None
            transport = StringTransport()
            protocol.makeConnection(transport)
            self.protocols.append((protocol, transport))
            d.callback(protocol)

        self.clock.callLater(CONNECT_DELAY, opened)
        return d


class SlowEndpoints:
    """Stands in for :class:`~crossbar.upstream.pools.UpstreamEndpoints`: every URI gets a
    :class:`SlowEndpoint`."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.protocols: list[tuple[Any, StringTransport]] = []

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        return SlowEndpoint(self.clock, self.protocols)


class SlowPools:
    """Stands in for :class:`~crossbar.upstream.pools.UpstreamPools`: crossbar's real
    agent (:class:`~crossbar.upstream.h1client.H1Agent`, no pool: every request on a new
    connection) and a real :class:`ConnectTracker` over :class:`SlowEndpoints`."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.endpoints = SlowEndpoints(clock)

    def agent(self, fresh: bool = False) -> tuple[H1Agent, ConnectTracker]:
        tracker = ConnectTracker(self.endpoints, self.clock)  # type: ignore[arg-type]
        return H1Agent(tracker, None), tracker


class RecordingLog(RequestLog):
    """A :class:`RequestLog` that also keeps every record."""

    def __init__(self) -> None:
        super().__init__(Metrics())
        self.records: list[RequestRecord] = []

    def write(self, record: RequestRecord) -> None:
        self.records.append(record)
        super().write(record)


class AttemptTTFBTests(SynchronousTestCase):
    def test_sent_at_is_when_the_connection_opened(self) -> None:
        clock = Clock()
        pools = SlowPools(clock)
        attempt = Attempt(pools, clock, b"POST", b"http://127.0.0.1:9/v1/chat/completions",  # type: ignore[arg-type]
                          Headers(), BODY, first_byte_timeout=300.0)
        answers: list[Answer] = []
        attempt.start().addCallback(answers.append)
        clock.advance(CONNECT_DELAY - 0.5)
        self.assertEqual(pools.endpoints.protocols, [], "connected too early")
        clock.advance(0.5)
        [(protocol, transport)] = pools.endpoints.protocols
        self.assertTrue(transport.value().endswith(b"\r\n\r\n" + BODY), "the request, body included, was sent")
        clock.advance(HEAD_DELAY)
        protocol.dataReceived(HEAD)
        [answer] = answers
        self.assertEqual(answer.sent_at, CONNECT_DELAY)
        self.assertEqual(clock.seconds() - answer.sent_at, HEAD_DELAY)


class ExchangeTTFBTests(SynchronousTestCase):
    def test_recorded_ttfb_counts_from_the_request_sent(self) -> None:
        clock = Clock()
        config = parse_config("listen: \"tcp:0\"\nhosts:\n  a: http://127.0.0.1:9\nroutes:\n  r:\n    hosts: [a]\n", "test.yaml")
        runtime = Runtime(config, clock.seconds)
        runtime.table.record_success("a", ["tiny-a"])
        self.assertTrue(runtime.table.is_healthy("a"))
        pools = SlowPools(clock)
        log = RecordingLog()
        proxy = ProxyResource(runtime, pools, clock, log)  # type: ignore[arg-type]

        request = CrossbarRequest(DummyChannel())
        request.method = b"POST"
        request.uri = request.path = b"/r/v1/chat/completions"
        request.clientproto = b"HTTP/1.1"
        request.requestHeaders.setRawHeaders(b"Content-Type", [b"application/json"])
        request.head = RequestHead.parse(config, request.method, request.uri).with_body([BODY], peek(BODY))
        proxy.render(request)

        clock.advance(CONNECT_DELAY)
        [(protocol, transport)] = pools.endpoints.protocols
        self.assertTrue(transport.value().endswith(BODY))
        clock.advance(HEAD_DELAY)
        protocol.dataReceived(HEAD)
        [record] = log.records
        self.assertEqual((record.status, record.host), (200, "a"))
        self.assertEqual(record.ttfb, HEAD_DELAY)
        self.assertEqual(record.duration, CONNECT_DELAY + HEAD_DELAY)
