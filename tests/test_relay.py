"""Socket-free unit tests of :class:`crossbar.proxy.relay.Relay`, the body pump (docs/design.md
§The proxy, rules 6-7; §Quality bar: memory per stream stays bounded).

The client side is real: Twisted's ``Site``/``HTTPChannel``/``Request`` over a
``StringTransport``; the test pauses and resumes the channel as its TCP transport would
when its send buffer fills and drains. The upstream side is a response whose
``deliverBody`` behaves like Twisted's (buffered chunks, then ``resumeProducing``) over
a ``StringTransport`` (``producerState`` shows pause/resume/stop), and one test uses
Twisted's own ``Response``. The idle timer runs on a :class:`Clock`. The loopback
versions are in tests/test_streaming.py and tests/test_hostile_hosts.py.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web._newclient import Response
from twisted.web.client import ResponseDone, ResponseFailed
from twisted.web.http import HTTPChannel, PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH
from twisted.web.server import Request, Site

from crossbar.proxy.channel import HeadDeadlineChannel
from crossbar.proxy.relay import Relay, RelayEnd, RelayState
from crossbar.upstream.h1client import H1Connection, H1Pool
from tests.fakes import HoldResource

IDLE = 120.0
STALL = 1e6
"""``timeouts.client_stall`` far off: these tests are about other matters (the client
stall's own are in tests/test_client_stall.py)."""




class _ClientTransport(StringTransport):
    """A client connection whose send buffer is "full" past ``limit`` written bytes:
    then it pauses the channel, as a TCP transport does."""

    limit: int | None = None

    def write(self, data: bytes) -> None:
        super().write(data)
        if self.limit is not None and len(self.value()) > self.limit and self.protocol is not None:
            self.limit = None
            self.protocol.pauseProducing()

    def writeSequence(self, data: Any) -> None:
        self.write(b"".join(data))

    protocol: Any = None


class FakeResponse:
    """An upstream response: ``deliverBody`` does what Twisted's ``Response`` does (hand
    over the transport, deliver buffered chunks, resume the transport)."""

    length: Any = UNKNOWN_LENGTH  # IResponse.length: a chunked answer

    def __init__(self, buffered: tuple[bytes, ...] = ()) -> None:
        self.transport = StringTransport()
        self.transport.pauseProducing()  # Twisted's parser pauses until deliverBody
        self.buffered = buffered
        self.protocol: Any = None

    def deliverBody(self, protocol: Any) -> None:
        protocol.makeConnection(self.transport)
        self.protocol = protocol
        for data in self.buffered:
            protocol.dataReceived(data)
        self.transport.resumeProducing()


class RelayTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.resource = HoldResource()
        site = Site(self.resource, reactor=Clock())  # the channel's own timers stay apart
        site.protocol = HeadDeadlineChannel  # type: ignore[assignment]  # crossbar's channel
        channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 5555))
        assert isinstance(channel, HeadDeadlineChannel)
        self.channel: HTTPChannel = channel
        self.client = _ClientTransport()
        self.client.protocol = self.channel
        self.channel.makeConnection(self.client)
        self.channel.dataReceived(b"GET /r/v1/x HTTP/1.1\r\nHost: crossbar\r\n\r\n")
        [self.request] = self.resource.requests
        self.ends: list[RelayEnd] = []

    def tearDown(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))

    def relay(self, response: Any | None = None) -> tuple[Relay, Any]:
        relay = Relay(self.request, self.clock, IDLE, STALL, on_end=self.ends.append)
        response = response if response is not None else FakeResponse()
        relay.start(response)
        return relay, response

    def idle_calls(self) -> list[Any]:
        """The relay's idle timer among the clock's delayed calls (the client stall's
        runs beside it)."""
        return [c for c in self.clock.getDelayedCalls() if getattr(c.func, "__name__", "") == "_idle_check"]

    def body(self) -> bytes:
        """What the client got after the head (chunked framing included)."""
        return self.client.value().partition(b"\r\n\r\n")[2]

    # -- streaming

    def test_chunks_written_in_order_and_counted(self) -> None:
        relay, response = self.relay()
        self.assertEqual(self.body(), b"")
        response.protocol.dataReceived(b"data: 1\n\n")
        self.assertEqual(self.body(), b"9\r\ndata: 1\n\n\r\n")  # at once, not buffered
        response.protocol.dataReceived(b"data: 22\n\n")
        self.assertEqual(self.body(), b"9\r\ndata: 1\n\n\r\na\r\ndata: 22\n\n\r\n")
        self.assertEqual(relay.bytes, 19)
        self.assertIs(relay.state, RelayState.STREAMING)
        self.assertEqual(self.ends, [])

    def test_buffered_chunks_delivered_first(self) -> None:
        relay, response = self.relay(FakeResponse(buffered=(b"ab", b"c")))
        response.protocol.dataReceived(b"de")
        self.assertEqual(self.body(), b"2\r\nab\r\n1\r\nc\r\n2\r\nde\r\n")
        self.assertEqual(relay.bytes, 5)
        self.assertEqual(response.transport.producerState, "producing")

    def test_registered_as_the_client_connection_producer(self) -> None:
        relay, _ = self.relay()
        self.assertIs(self.channel._requestProducer, relay)
        self.assertTrue(self.channel._requestProducerStreaming)

    # -- how it ends

    def test_clean_end(self) -> None:
        for reason in (ResponseDone(), PotentialDataLoss()):
            self.ends.clear()
            self.request = Request(self.channel)  # a fresh request on the same channel
            relay, response = self.relay()
            response.protocol.dataReceived(b"x")
            response.protocol.connectionLost(Failure(reason))
            self.assertEqual(self.ends, [RelayEnd.COMPLETE])
            self.assertEqual(relay.reason, "")
            self.assertIs(relay.state, RelayState.ENDED)
            self.assertEqual(self.clock.getDelayedCalls(), [])  # idle timer gone
            self.request.unregisterProducer()

    def test_death_mid_answer(self) -> None:
        relay, response = self.relay()
        response.protocol.dataReceived(b"partial")
        response.protocol.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost("reset by peer"))])))
        self.assertEqual(self.ends, [RelayEnd.MID_ANSWER])
        self.assertEqual(relay.reason, "failed mid-answer: Connection to the other side was lost in a non-clean fashion: reset by peer.")
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_idle_timeout(self) -> None:
        relay, response = self.relay()
        self.clock.advance(IDLE - 1)
        response.protocol.dataReceived(b"x")  # every byte restarts the wait
        self.clock.advance(IDLE - 1)
        self.assertEqual(self.ends, [])
        self.clock.advance(1)
        self.assertEqual(self.ends, [RelayEnd.IDLE_TIMEOUT])
        self.assertEqual(relay.reason, "no body byte within 120s")
        self.assertEqual(response.transport.producerState, "stopped")

    def test_idle_timeout_before_any_byte(self) -> None:
        _, response = self.relay()
        self.clock.advance(IDLE)
        self.assertEqual(self.ends, [RelayEnd.IDLE_TIMEOUT])
        self.assertEqual(response.transport.producerState, "stopped")

    def test_body_chunks_do_no_timer_work(self) -> None:
        """Issue 14: a chunk only records its time; the one timer stays as armed until it
        fires, then waits for what is left after the last byte."""
        _, response = self.relay()
        [timer] = self.idle_calls()
        for i in range(50):
            self.clock.advance(1)
            response.protocol.dataReceived(b"data: %d\n\n" % i)
        self.assertEqual(self.idle_calls(), [timer])
        self.assertEqual(timer.getTime(), IDLE)  # not pushed back by any chunk
        self.clock.advance(IDLE - 50)  # fires at IDLE, 70 s after the last byte
        [later] = self.idle_calls()
        self.assertEqual(later.getTime(), 50 + IDLE)
        self.assertEqual(self.ends, [])
        self.clock.advance(50)
        self.assertEqual(self.ends, [RelayEnd.IDLE_TIMEOUT])

    def test_stop(self) -> None:
        relay, response = self.relay()
        relay.stop()
        self.assertEqual(self.ends, [RelayEnd.STOPPED])
        self.assertEqual(response.transport.producerState, "stopped")
        self.assertEqual(self.clock.getDelayedCalls(), [])
        relay.stop()  # again: nothing fires twice
        response.protocol.connectionLost(Failure(ResponseFailed([Failure(ConnectionLost())])))
        self.assertEqual(self.ends, [RelayEnd.STOPPED])
        self.assertEqual(relay.reason, "")

    def test_client_connection_stopping_the_producer_stops(self) -> None:
        _, response = self.relay()
        self.channel.stopProducing()
        self.assertEqual(self.ends, [RelayEnd.STOPPED])
        self.assertEqual(response.transport.producerState, "stopped")

    def test_ended_fires_exactly_once(self) -> None:
        relay, response = self.relay()
        response.protocol.connectionLost(Failure(ResponseDone()))
        relay.stop()
        relay.timeoutConnection()
        response.protocol.connectionLost(Failure(ConnectionLost()))
        self.clock.advance(10 * IDLE)
        self.assertEqual(self.ends, [RelayEnd.COMPLETE])

    def test_nothing_written_after_the_end(self) -> None:
        relay, response = self.relay()
        relay.stop()
        before = self.client.value()
        response.protocol.dataReceived(b"late")
        self.assertEqual(self.client.value(), before)
        self.assertEqual(relay.bytes, 0)

    # -- backpressure

    def test_client_pause_pauses_the_upstream_and_the_idle_timer(self) -> None:
        relay, response = self.relay()
        self.channel.pauseProducing()  # the client's send buffer is full
        self.assertIs(relay.state, RelayState.PAUSED)
        self.assertEqual(response.transport.producerState, "paused")
        self.assertEqual(self.idle_calls(), [])
        self.clock.advance(100 * IDLE)  # a slow client is not a silent host
        self.assertEqual(self.ends, [])

    def test_resume_restarts_the_idle_timer(self) -> None:
        relay, response = self.relay()
        self.clock.advance(IDLE - 1)
        self.channel.pauseProducing()
        self.clock.advance(5 * IDLE)
        self.channel.resumeProducing()
        self.assertIs(relay.state, RelayState.STREAMING)
        self.assertEqual(response.transport.producerState, "producing")
        self.clock.advance(IDLE - 0.01)  # a whole new wait, not what was left
        self.assertEqual(self.ends, [])
        self.clock.advance(0.01)
        self.assertEqual(self.ends, [RelayEnd.IDLE_TIMEOUT])

    def test_client_already_full_at_start(self) -> None:
        """A pipelined answer before this one filled the connection: the channel will
        not tell a producer registered now, so the relay asks and starts paused; the
        resume Twisted's deliverBody does is undone."""
        self.channel.pauseProducing()
        relay, response = self.relay()
        self.assertIs(relay.state, RelayState.PAUSED)
        self.assertEqual(response.transport.producerState, "paused")
        self.assertEqual(self.idle_calls(), [])
        self.channel.resumeProducing()
        self.assertEqual(response.transport.producerState, "producing")
        self.assertEqual(len(self.idle_calls()), 1)

    def test_client_filling_up_during_the_hand_over(self) -> None:
        """A buffered chunk written during deliverBody fills the client: the upstream
        stays paused although deliverBody resumes it afterwards."""
        self.client.limit = len(self.client.value()) + 3
        relay, response = self.relay(FakeResponse(buffered=(b"0123456789",)))
        self.assertIs(relay.state, RelayState.PAUSED)
        self.assertEqual(response.transport.producerState, "paused")
        self.assertEqual(relay.bytes, 10)

    def test_pause_and_resume_after_the_end_do_nothing(self) -> None:
        relay, response = self.relay()
        response.protocol.connectionLost(Failure(ResponseDone()))
        relay.pauseProducing()
        self.assertEqual(response.transport.producerState, "producing")
        relay.resumeProducing()
        self.assertIs(relay.state, RelayState.ENDED)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_with_twisted_response(self) -> None:
        """Twisted's own ``Response``: body buffered before deliverBody, then the rest."""
        upstream = StringTransport()
        response = Response._construct(  # type: ignore[attr-defined]
            (b"HTTP", 1, 1), 200, b"OK", Headers(), upstream, None
        )
        response._bodyDataReceived(b"early")
        self.channel.pauseProducing()
        relay, _ = self.relay(response)
        self.assertEqual(upstream.producerState, "paused")  # resume undone
        self.channel.resumeProducing()
        self.assertEqual(upstream.producerState, "producing")
        response._bodyDataReceived(b"late")
        response._bodyDataFinished()
        self.assertEqual(self.ends, [RelayEnd.COMPLETE])
        self.assertEqual(relay.bytes, 9)
        self.assertEqual(self.body(), b"5\r\nearly\r\n4\r\nlate\r\n")


class RealUpstreamTests(SynchronousTestCase):
    """The upstream side is crossbar's real HTTP/1.1 client (a pooled ``H1Connection``)
    over a ``StringTransport``: what the relay does to the host's connection."""

    def setUp(self) -> None:
        self.clock = Clock()
        resource = HoldResource()
        site = Site(resource, reactor=Clock())
        site.protocol = HeadDeadlineChannel  # type: ignore[assignment]
        self.channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 5555))
        self.channel.makeConnection(StringTransport())
        self.channel.dataReceived(b"GET /r/v1/x HTTP/1.1\r\nHost: crossbar\r\n\r\n")
        [self.request] = resource.requests
        self.upstream = H1Connection(H1Pool(self.clock), (b"http", b"h", 80), True)
        self.wire = StringTransport()
        self.upstream.makeConnection(self.wire)
        self.ends: list[RelayEnd] = []

    def tearDown(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))

    def relay(self, head: bytes) -> Relay:
        d = self.upstream.send(b"GET", b"/x", Headers({b"host": [b"h"]}), None)
        self.upstream.dataReceived(head)
        relay = Relay(self.request, self.clock, IDLE, on_end=self.ends.append)
        relay.start(self.successResultOf(d))
        return relay

    def test_complete_then_stop_leaves_the_pooled_connection_alone(self) -> None:
        """stop() after a clean end (e.g. the client leaves right after) must not stop
        a connection that is back in the pool serving another request."""
        relay = self.relay(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n")
        self.upstream.dataReceived(b"done")
        self.assertEqual(self.ends, [RelayEnd.COMPLETE])
        relay.stop()
        self.assertEqual(self.ends, [RelayEnd.COMPLETE])
        self.assertEqual(self.wire.producerState, "producing")
        self.assertFalse(self.wire.disconnecting)

    def test_idle_timeout_closes_the_host_connection(self) -> None:
        relay = self.relay(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.upstream.dataReceived(b"2\r\nab\r\n")
        self.clock.advance(IDLE)
        self.assertEqual(self.ends, [RelayEnd.IDLE_TIMEOUT])
        self.assertTrue(self.wire.disconnecting or self.wire.producerState == "stopped")
        self.assertEqual(relay.bytes, 2)

    def test_host_dying_mid_answer(self) -> None:
        relay = self.relay(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
        self.upstream.dataReceived(b"abc")
        self.upstream.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.ends, [RelayEnd.MID_ANSWER])
        self.assertTrue(relay.reason.startswith("failed mid-answer: "), relay.reason)

    def test_client_pause_pauses_the_host_connection(self) -> None:
        self.relay(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.channel.pauseProducing()
        self.assertEqual(self.wire.producerState, "paused")
        self.channel.resumeProducing()
        self.assertEqual(self.wire.producerState, "producing")
