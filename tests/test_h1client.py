"""Socket-free tests of crossbar's HTTP/1.1 upstream client (crossbar/upstream/h1client.py,
issue 14; docs/design.md §The proxy, rules 6-7 and 9): the real parser and pool over a
``MemoryReactorClock``, the host's side written into a ``StringTransport``. The
loopback versions of these rules (through the whole proxy) are in
tests/test_failures.py, tests/test_hostile_hosts.py and tests/test_streaming.py.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectingCancelledError, ConnectionDone, ConnectionLost
from twisted.internet.protocol import Protocol
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import (
    RequestNotSent, RequestTransmissionFailed, ResponseDone, ResponseFailed, ResponseNeverReceived,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse

from crossbar.proxy.attempt import BytesProducer
from crossbar.upstream.h1answer import (
    MAX_RESPONSE_HEAD, BodyTruncated, H1Response, ResponseHeadTooLarge, UnrelayableStatus,
)
from crossbar.upstream.h1client import H1Agent, H1Connection, H1Pool, request_head
from crossbar.upstream.pools import ConnectTracker, PollAgent, UpstreamEndpoints

URL = b"http://127.0.0.1:8080/v1/chat/completions"


class _Body(Protocol):
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.reason: Failure | None = None
        self.body_transport: Any = None

    def makeConnection(self, transport: Any) -> None:
        self.body_transport = transport

    def dataReceived(self, data: bytes) -> None:
        self.chunks.append(data)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:
        self.reason = reason


class _Transport(StringTransport):
    """A ``StringTransport`` that also records ``abortConnection``."""

    aborted = False
    full = False  # pause a registered producer at its first write (a slow host)

    def write(self, data: bytes) -> None:
        super().write(data)
        if self.full and self.producer is not None:
            self.producer.pauseProducing()

    def abortConnection(self) -> None:
        self.aborted = True
        self.loseConnection()


class _ClientCase(SynchronousTestCase):
    """The client over a memory reactor; the host's side is what a test feeds in."""

    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.pool = H1Pool(self.reactor, max_per_host=2, idle_seconds=30.0)
        self.trackers: list[ConnectTracker] = []

    def request(self, method: bytes = b"POST", body: bytes | None = b"{}", fresh: bool = False,
                headers: Headers | None = None) -> Deferred[IResponse]:
        tracker = ConnectTracker(UpstreamEndpoints(self.reactor, 5.0), self.reactor)
        self.trackers.append(tracker)
        agent = H1Agent(tracker, None if fresh else self.pool)
        producer = None if body is None else BytesProducer(body)
        if headers is None:
            headers = Headers({b"host": [b"127.0.0.1:8080"]})
        return agent.request(method, URL, headers, producer)

    def connect(self, index: int = -1, full: bool = False) -> tuple[H1Connection, _Transport]:
        host, port, factory, _, _ = self.reactor.tcpClients[index]
        address = IPv4Address("TCP", host, port)
        protocol = factory.buildProtocol(address)
        assert protocol is not None
        transport = _Transport(peerAddress=address)
        transport.full = full
        protocol.makeConnection(transport)
        connection = getattr(protocol, "_wrappedProtocol", protocol)  # the endpoint's wrapper
        assert isinstance(connection, H1Connection)
        return connection, transport

    def exchange(self, head: bytes, body: bytes = b"", method: bytes = b"POST") -> tuple[H1Response, _Body]:
        d = self.request(method)
        if len(self.reactor.tcpClients) > len(getattr(self, "_connected", [])):
            self._connected = getattr(self, "_connected", []) + [self.connect()]
        connection, _ = self._connected[-1]
        connection.dataReceived(head + body)
        response = self.successResultOf(d)
        assert isinstance(response, H1Response)
        collected = _Body()
        response.deliverBody(collected)
        return response, collected



class H1ClientTests(_ClientCase):
    # -- what is sent ----------------------------------------------------------------

    def test_request_written(self) -> None:
        d = self.request(headers=Headers({b"host": [b"h"], b"x-a": [b"1", b"2"]}), body=b'{"x": 1}')
        _, transport = self.connect()
        sent = transport.value()
        self.assertTrue(sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 8\r\n"), sent)
        self.assertIn(b"X-A: 1\r\nX-A: 2\r\n", sent)
        self.assertTrue(sent.endswith(b"\r\n\r\n{\"x\": 1}"), sent)
        self.assertNoResult(d)

    def test_host_added_and_fresh_connection_asks_close(self) -> None:
        self.request(body=None, fresh=True, headers=Headers())
        _, transport = self.connect()
        sent = transport.value()
        self.assertIn(b"Connection: close\r\n", sent)
        self.assertIn(b"Content-Length: 0\r\n", sent)  # POST without a body
        self.assertIn(b"Host: 127.0.0.1:8080\r\n", sent)

    def test_long_body_written_in_slices_then_reused(self) -> None:
        body = b"a" * (BytesProducer.SLICE * 2 + 5)
        d = self.request(body=body)
        connection, transport = self.connect()
        self.assertTrue(transport.value().endswith(body))
        self.assertIsNone(transport.producer)  # unregistered once all was written
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.successResultOf(d)
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 1)

    # -- the answer ------------------------------------------------------------------

    def test_head_headers_and_body(self) -> None:
        response, body = self.exchange(
            b"HTTP/1.1 201 Created\r\nConnection: keep-alive, X-Private\r\nX-Private: 1\r\nSet-Cookie: a\r\n"
            b"Set-Cookie: b\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\n", b"ok")
        self.assertEqual((response.code, response.phrase, response.length), (201, b"Created", 2))
        self.assertEqual(response.headers.getRawHeaders(b"set-cookie"), [b"a", b"b"])
        self.assertEqual(response.headers.getRawHeaders(b"x-private"), [b"1"])
        for name in (b"connection", b"content-length", b"keep-alive"):
            self.assertFalse(response.headers.hasHeader(name), name)
        self.assertEqual(response.upstream_connection, (b"keep-alive, X-Private",))
        self.assertEqual(body.chunks, [b"ok"])
        assert body.reason is not None
        body.reason.trap(ResponseDone)

    def test_interim_answers_skipped(self) -> None:
        response, body = self.exchange(
            b"HTTP/1.1 100 Continue\r\nX-Interim: 1\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n", b"x")
        self.assertEqual((response.code, response.phrase), (200, b"OK"))
        self.assertFalse(response.headers.hasHeader(b"x-interim"))
        self.assertEqual(body.chunks, [b"x"])

    def test_chunked_body_delivered_as_chunks(self) -> None:
        response, body = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.assertIs(response.length, UNKNOWN_LENGTH)
        connection, _ = self._connected[-1]
        connection.dataReceived(b"5\r\nhello\r\n")
        connection.dataReceived(b"6\r\n world\r\n")
        self.assertEqual(body.chunks, [b"hello", b" world"])
        self.assertIsNone(body.reason)
        connection.dataReceived(b"0\r\n\r\n")
        assert body.reason is not None
        body.reason.trap(ResponseDone)

    def test_head_answer_has_no_body_and_keeps_content_length(self) -> None:
        response, body = self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", method=b"HEAD")
        self.assertEqual(response.length, 0)
        self.assertEqual(response.headers.getRawHeaders(b"content-length"), [b"5"])
        assert body.reason is not None
        body.reason.trap(ResponseDone)
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 1)  # reused

    def test_no_body_codes(self) -> None:
        for code in (b"204 No Content", b"304 Not Modified"):
            response, body = self.exchange(b"HTTP/1.1 " + code + b"\r\n\r\n")
            self.assertEqual(response.length, 0)
            assert body.reason is not None
            body.reason.trap(ResponseDone)
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_body_buffered_until_delivered(self) -> None:
        d = self.request()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nab")
        response = self.successResultOf(d)
        connection.dataReceived(b"cd")
        body = _Body()
        response.deliverBody(body)
        self.assertEqual(b"".join(body.chunks), b"abcd")
        assert body.reason is not None
        body.reason.trap(ResponseDone)

    # -- truncation (rule 7) ---------------------------------------------------------

    def lost_mid_body(self, head: bytes, part: bytes) -> Failure:
        _, body = self.exchange(head, part)
        connection, _ = self._connected[-1]
        connection.connectionLost(Failure(ConnectionLost("reset")))
        assert body.reason is not None
        return body.reason

    def test_content_length_cut_short_is_a_failure(self) -> None:
        reason = self.lost_mid_body(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n", b"abc")
        reason.trap(ResponseFailed)
        error = reason.value
        assert isinstance(error, ResponseFailed)
        self.assertTrue(error.reasons[0].check(ConnectionLost))
        self.assertTrue(error.reasons[1].check(BodyTruncated))

    def test_chunked_cut_short_is_a_failure(self) -> None:
        reason = self.lost_mid_body(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n")
        reason.trap(ResponseFailed)

    def test_close_delimited_body_ends_with_potential_data_loss(self) -> None:
        _, body = self.exchange(b"HTTP/1.1 200 OK\r\n\r\n", b"all of it")
        connection, _ = self._connected[-1]
        connection.connectionLost(Failure(ConnectionDone()))
        assert body.reason is not None
        body.reason.trap(PotentialDataLoss)

    def test_close_delimited_body_ended_by_a_reset_is_cut_short(self) -> None:
        """A clean close is the end of such a body; a reset is a host that died."""
        reason = self.lost_mid_body(b"HTTP/1.1 200 OK\r\n\r\n", b"part of it")
        reason.trap(ResponseFailed)

    # -- connection reuse ------------------------------------------------------------

    def test_reused_after_a_complete_answer(self) -> None:
        self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(len(self.reactor.tcpClients), 1)
        self.assertEqual([t.connects for t in self.trackers], [1, 0])

    def test_not_reused_while_the_body_is_open(self) -> None:
        self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"ab")
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 2)

    def test_connection_close_answer_not_pooled(self) -> None:
        for head in (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
                     b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"):
            self.exchange(head)
            _, transport = self._connected[-1]
            self.assertTrue(transport.disconnecting)
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 3)

    def test_stopped_body_aborts_and_is_not_pooled(self) -> None:
        _, body = self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"ab")
        body.body_transport.stopProducing()
        _, transport = self._connected[-1]
        self.assertTrue(transport.aborted)
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 2)

    def test_pause_and_resume_reach_the_connection(self) -> None:
        _, body = self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", b"ab")
        _, transport = self._connected[-1]
        body.body_transport.pauseProducing()
        self.assertEqual(transport.producerState, "paused")
        body.body_transport.resumeProducing()
        self.assertEqual(transport.producerState, "producing")

    def test_idle_connection_expires(self) -> None:
        self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        _, transport = self._connected[-1]
        self.reactor.advance(29.0)
        self.assertFalse(transport.disconnecting)
        self.reactor.advance(1.0)
        self.assertTrue(transport.disconnecting)
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 2)

    def test_bytes_on_an_idle_connection_drop_it(self) -> None:
        self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        connection, transport = self._connected[-1]
        connection.dataReceived(b"HTTP/1.1 200 OK\r\n\r\n")
        self.assertTrue(transport.aborted)
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 2)

    def test_pool_keeps_at_most_max_per_host(self) -> None:
        ds = [self.request() for _ in range(3)]
        connections = [self.connect(i) for i in range(3)]
        for d, (connection, _) in zip(ds, connections):
            connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            self.successResultOf(d).deliverBody(_Body())
        self.assertEqual([t.disconnecting for _, t in connections], [False, False, True])

    # -- failures before an answer (the stale-connection retry's input) -------------

    def test_reused_connection_lost_before_any_byte(self) -> None:
        self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        d = self.request()
        connection, _ = self._connected[-1]
        connection.connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(d, ResponseNeverReceived)

    def test_lost_mid_head_is_response_failed(self) -> None:
        d = self.request()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-")
        connection.connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(d, ResponseFailed)

    def test_lost_while_writing_the_body(self) -> None:
        d = self.request(body=b"a" * (BytesProducer.SLICE * 2))
        connection, transport = self.connect(full=True)
        self.assertEqual(len(transport.value()) < BytesProducer.SLICE * 2, True)  # paused mid-body
        connection.connectionLost(Failure(ConnectionLost()))
        self.failureResultOf(d, RequestTransmissionFailed)

    def test_cancel_aborts(self) -> None:
        d = self.request()
        _, transport = self.connect()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertTrue(transport.aborted)
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 2)

    def test_paused_when_the_body_ended_resumed_before_reuse(self) -> None:
        """The reader paused the connection with the last bytes of the body: pooled,
        it must read again, or the next answer would never be read."""
        _, body = self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n", b"ab")
        connection, transport = self._connected[-1]
        body.body_transport.pauseProducing()
        connection.dataReceived(b"cd")
        assert body.reason is not None
        body.reason.trap(ResponseDone)
        self.assertEqual(transport.producerState, "producing")
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_cancelled_while_connecting(self) -> None:
        d = self.request()
        d.cancel()
        self.failureResultOf(d, ConnectingCancelledError)
        self.assertTrue(self.reactor.connectors[0].stoppedConnecting)

    def test_idle_connections_expire_each_after_its_own_wait(self) -> None:
        ds = [self.request() for _ in range(2)]
        connections = [self.connect(i) for i in range(2)]
        connections[0][0].dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.reactor.advance(10.0)
        connections[1][0].dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        for d in ds:
            self.successResultOf(d)
        self.reactor.advance(20.0)
        self.assertEqual([t.disconnecting for _, t in connections], [True, False])
        self.reactor.advance(9.0)
        self.assertFalse(connections[1][1].disconnecting)
        self.reactor.advance(1.0)
        self.assertTrue(connections[1][1].disconnecting)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_pool_close_fires_once_closed(self) -> None:
        self.exchange(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        connection, transport = self._connected[-1]
        closed = self.pool.close()
        self.assertTrue(transport.disconnecting)
        self.assertNoResult(closed)
        connection.connectionLost(Failure(ConnectionDone()))
        self.successResultOf(closed)
        self.assertEqual(self.reactor.getDelayedCalls(), [])

    def test_stopped_while_taking_buffered_chunks(self) -> None:
        """A reader that stops at the first buffered chunk gets nothing after its end."""
        d = self.request()
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nab")
        response = self.successResultOf(d)
        connection.dataReceived(b"cd")

        class StopAtFirst(_Body):
            def dataReceived(self, data: bytes) -> None:
                super().dataReceived(data)
                self.body_transport.stopProducing()

        body = StopAtFirst()
        response.deliverBody(body)
        self.assertEqual(body.chunks, [b"ab"])
        assert body.reason is not None
        body.reason.trap(ResponseFailed)


class HostileAnswerTests(_ClientCase):
    """Answers found by attacking the client with hostile hosts (the loopback versions
    run through the whole proxy in tests/test_hostile_hosts.py)."""

    def test_trailers_dropped_and_connection_reused(self) -> None:
        response, body = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                                       b"5\r\nhello\r\n0\r\nX-Trailer: 1\r\nConnection: close\r\n\r\n")
        self.assertEqual(body.chunks, [b"hello"])
        assert body.reason is not None
        body.reason.trap(ResponseDone)
        self.assertFalse(response.headers.hasHeader(b"x-trailer"))
        self.assertEqual(response.upstream_connection, ())
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 1)  # reused: a trailer is not a head

    def test_endless_trailers_are_a_broken_answer(self) -> None:
        """Trailer fields were kept without limit (1 GB in 6 s): now more than 64 KiB
        of framing or trailers with no body byte between them ends the answer."""
        _, body = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"5\r\nhello\r\n0\r\n")
        connection, transport = self._connected[-1]
        line = b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 100) for i in range(100))  # ~11 KiB
        for _ in range(6):
            connection.dataReceived(line)
        self.assertIsNone(body.reason)  # 66 KiB: still under the limit... until the next read
        connection.dataReceived(line)
        assert body.reason is not None
        body.reason.trap(ResponseFailed)
        self.assertIn("trailers over 65536 bytes", str(body.reason.value.reasons[0].value))
        self.assertTrue(transport.aborted)
        self.assertEqual(body.chunks, [b"hello"])

    def test_one_endless_trailer_line_is_a_broken_answer(self) -> None:
        _, body = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"1\r\nx\r\n0\r\nX-T: ")
        connection, transport = self._connected[-1]
        for _ in range(20):
            connection.dataReceived(b"v" * 4096)
        assert body.reason is not None
        body.reason.trap(ResponseFailed)
        self.assertTrue(transport.aborted)

    def test_long_chunked_stream_is_not_framing(self) -> None:
        """A stream's framing adds up over its life; only framing with no body between
        counts against the limit."""
        _, body = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        connection, _ = self._connected[-1]
        for _ in range(20_000):
            connection.dataReceived(b"3\r\nabc\r\n")
        connection.dataReceived(b"0\r\n\r\n")
        assert body.reason is not None
        body.reason.trap(ResponseDone)

    def test_bytes_after_an_answer_never_answer_the_next_request(self) -> None:
        """The body's end dispatches a waiting request at once (a queue): the connection
        must not be taken while the rest of the read is still being parsed, or the
        stray bytes become the next request's answer (a 502, or another client's
        bytes in its status line)."""
        d = self.request()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        response = self.successResultOf(d)
        taken: list[Deferred[IResponse]] = []

        class DispatchOnEnd(_Body):
            def connectionLost(inner, reason: Failure = Failure(ConnectionDone())) -> None:
                super().connectionLost(reason)
                taken.append(self.request())  # the queued request, dispatched in the end's call

        body = DispatchOnEnd()
        response.deliverBody(body)
        connection.dataReceived(b"hello" + b"HTTP/1.1 299 INJECTED\r\nContent-Length: 4\r\n\r\nevil")
        self.assertEqual(b"".join(body.chunks), b"hello")
        assert body.reason is not None
        body.reason.trap(ResponseDone)
        self.assertTrue(transport.aborted)  # the stray answer dropped the connection
        self.assertEqual(len(self.reactor.tcpClients), 2)  # the next request got a fresh one
        self.assertNoResult(taken[0])
        fresh, _ = self.connect()
        fresh.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        answer = self.successResultOf(taken[0])
        self.assertEqual((answer.code, answer.phrase), (200, b"OK"))

    def test_answer_before_the_upload_ended_aborts(self) -> None:
        """The host answered without reading the body: closing politely would wait
        forever to send the rest (a socket leaked per request)."""
        d = self.request(body=b"a" * (BytesProducer.SLICE * 4))
        connection, transport = self.connect(full=True)
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        response = self.successResultOf(d)
        body = _Body()
        response.deliverBody(body)
        self.assertEqual(body.chunks, [b"hello"])
        assert body.reason is not None
        body.reason.trap(ResponseDone)
        self.assertTrue(transport.aborted)
        self.assertIsNone(transport.producer)

    def test_http10_chunked_answer_is_not_pooled(self) -> None:
        self.exchange(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n",
                      b"5\r\nhello\r\n0\r\n\r\n")
        _, transport = self._connected[-1]
        self.assertTrue(transport.disconnecting)
        self.request()
        self.assertEqual(len(self.reactor.tcpClients), 2)

    def test_space_before_a_chunk_extension(self) -> None:
        _, body = self.exchange(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                                b"5 ;a=b\r\nhello\r\n0\r\n\r\n")
        self.assertEqual(body.chunks, [b"hello"])
        assert body.reason is not None
        body.reason.trap(ResponseDone)

    def test_not_http_1(self) -> None:
        for status_line in (b"RTSP/1.0 200 OK", b"ICE/1.0 200 OK", b"HTTP/2.0 200 OK", b"HTTP/0.9 200 OK"):
            d = self.request()
            connection, transport = self.connect()
            for byte in range(0, 3):  # the name split over reads
                connection.dataReceived(status_line[byte:byte + 1])
            connection.dataReceived(status_line[3:] + b"\r\nContent-Length: 2\r\n\r\nok")
            failure = self.failureResultOf(d, ResponseFailed)
            self.assertIn("HTTP", str(failure.value.reasons[0].value), status_line)
            self.assertTrue(transport.aborted, status_line)

    def test_pool_closed_by_the_answers_end_closes_its_connection(self) -> None:
        """The last answer's end can finish a drain, which closes the pool at once
        (inside the parser): the connection must not be pooled after that."""
        d = self.request()
        connection, transport = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
        response = self.successResultOf(d)
        pool = self.pool

        class CloseOnEnd(_Body):
            def connectionLost(inner, reason: Failure = Failure(ConnectionDone())) -> None:
                super().connectionLost(reason)
                pool.close()

        response.deliverBody(CloseOnEnd())
        connection.dataReceived(b"ok")
        self.assertTrue(transport.disconnecting)
        self.assertIsNone(self.pool.take(connection.key))
        self.assertEqual(self.reactor.getDelayedCalls(), [])


class HeadRuleTests(SynchronousTestCase):
    """The head rules polls and requests share (issue 17: they were Twisted's
    ``_newclient`` subclass's for polls): the ``Connection`` values kept, ``101`` and
    statuses outside 100-599 refused, the head bounded by :data:`MAX_RESPONSE_HEAD`
    per answer, body bytes never counted as head. One connection over a transport."""

    def setUp(self) -> None:
        self.pool = H1Pool(MemoryReactorClock())
        self.connection = H1Connection(self.pool, (b"http", b"upstream", 80), True)
        self.transport = _Transport()
        self.connection.makeConnection(self.transport)

    def send(self) -> Deferred[IResponse]:
        return self.connection.send(b"GET", b"/v1/models", Headers({b"host": [b"upstream"]}), None)

    def answer(self, data: bytes) -> Deferred[IResponse]:
        d = self.send()
        self.connection.dataReceived(data)
        return d

    def test_records_upstream_connection(self) -> None:
        d = self.answer(b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nConnection: X-A, X-B\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(self.successResultOf(d).upstream_connection, (b"keep-alive", b"X-A, X-B"))  # type: ignore[attr-defined]

    def refused(self, status: bytes) -> None:
        d = self.answer(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
        failure = self.failureResultOf(d, ResponseFailed)
        self.assertTrue(failure.value.reasons[0].check(UnrelayableStatus), failure.value.reasons)
        self.assertIn("status code crossbar cannot relay", str(failure.value.reasons[0].value))
        self.assertTrue(self.transport.aborted)

    def test_refuses_101(self) -> None:
        self.refused(b"101 Switching Protocols")

    def test_refuses_status_600(self) -> None:
        self.refused(b"600 Beyond")

    def test_refuses_status_below_100(self) -> None:
        self.refused(b"099 Below")

    def test_relays_every_status_in_range(self) -> None:
        for code in (100, 200, 204, 418, 599):
            self.setUp()
            head = b"HTTP/1.1 %d X\r\nContent-Length: 0\r\n\r\n" % code
            if code == 100:  # interim: skipped, the next head is the answer
                head += b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
            self.assertEqual(self.successResultOf(self.answer(head)).code, 200 if code == 100 else code)

    def test_gives_up_on_a_head_over_the_limit(self) -> None:
        d = self.send()
        self.connection.dataReceived(b"HTTP/1.1 200 OK\r\n")
        sent = len(b"HTTP/1.1 200 OK\r\n")
        line = b"X-Filler: " + b"a" * 500 + b"\r\n"
        while not d.called:
            self.connection.dataReceived(line)
            sent += len(line)
        failure = self.failureResultOf(d, ResponseFailed)
        self.assertTrue(failure.value.reasons[0].check(ResponseHeadTooLarge))
        self.assertTrue(self.transport.aborted)  # aborted, not a polite close
        self.assertGreater(sent, MAX_RESPONSE_HEAD)
        self.assertLessEqual(sent, MAX_RESPONSE_HEAD + len(line))  # at the first chunk over

    def test_head_count_restarts_per_request(self) -> None:
        """On a persistent connection each answer's head gets the whole limit."""
        line = b"X-Filler: " + b"a" * 500 + b"\r\n"
        head = b"HTTP/1.1 200 OK\r\n" + line * (MAX_RESPONSE_HEAD // len(line) - 4) + b"Content-Length: 0\r\n\r\n"
        for _ in range(3):
            self.assertEqual(self.successResultOf(self.answer(head)).code, 200)
        self.assertFalse(self.transport.disconnecting)

    def test_body_bytes_are_not_head(self) -> None:
        size = 2 * MAX_RESPONSE_HEAD
        response = self.successResultOf(self.answer(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size))
        body = _Body()
        response.deliverBody(body)
        self.connection.dataReceived(b"a" * size)
        self.assertEqual(b"".join(body.chunks), b"a" * size)
        self.assertTrue(body.reason is not None and body.reason.check(ResponseDone))
        self.assertFalse(self.transport.disconnecting)


class RequestHeadTests(SynchronousTestCase):
    """What :func:`request_head` writes, and a body of unknown length never sent."""

    def test_the_head_in_order(self) -> None:
        headers = Headers({b"X-A": [b"1", b"2"]})
        self.assertEqual(b"".join(request_head(b"POST", b"/v1/x", headers, b"h:1", False, 12)),
                         b"POST /v1/x HTTP/1.1\r\nHost: h:1\r\nConnection: close\r\nContent-Length: 12\r\n"
                         b"X-A: 1\r\nX-A: 2\r\n\r\n")

    def test_an_empty_post_or_put_says_length_0(self) -> None:
        for method, expected in ((b"PUT", b"Content-Length: 0\r\n"), (b"POST", b"Content-Length: 0\r\n"), (b"GET", b"")):
            self.assertEqual(b"".join(request_head(method, b"/", Headers(), None, True, None)),
                             method + b" / HTTP/1.1\r\n" + expected + b"\r\n")

    def test_a_body_of_unknown_length_is_not_sent(self) -> None:
        """``RequestNotSent``, nothing written, and the connection is as it was: a
        later request goes out, and its close fails only that one."""
        connection = H1Connection(None, (b"http", b"upstream", 80), True)
        transport = _Transport()
        connection.makeConnection(transport)
        producer = BytesProducer(b"x")
        producer.length = UNKNOWN_LENGTH
        self.failureResultOf(connection.send(b"POST", b"/", Headers(), producer), RequestNotSent)
        self.assertEqual(transport.value(), b"")
        d = connection.send(b"GET", b"/", Headers(), None)
        self.assertTrue(transport.value().startswith(b"GET / HTTP/1.1\r\n"))
        connection.connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(d, ResponseNeverReceived)


class PollAgentTests(_ClientCase):
    """The poller's agent (crossbar/upstream/pools.py): the same client, and a GET whose
    reused connection died before any answer sent once more on a new connection, as
    Twisted's ``Agent`` did for polls; anything else is never sent twice."""

    def poll(self, method: bytes = b"GET") -> Deferred[IResponse]:
        agent = PollAgent(UpstreamEndpoints(self.reactor, 5.0), self.pool)
        return agent.request(method, URL, Headers({b"host": [b"127.0.0.1:8080"]}), None)

    def reused_and_lost(self, method: bytes) -> Deferred[IResponse]:
        first = self.poll(method)
        connection, _ = self.connect()
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.successResultOf(first)
        d = self.poll(method)
        self.assertEqual(len(self.reactor.tcpClients), 1)  # reused
        connection.connectionLost(Failure(ConnectionDone()))
        return d

    def test_get_on_a_dead_reused_connection_is_sent_again(self) -> None:
        d = self.reused_and_lost(b"GET")
        self.assertNoResult(d)
        self.assertEqual(len(self.reactor.tcpClients), 2)
        connection, transport = self.connect()
        self.assertTrue(transport.value().startswith(b"GET /v1/chat/completions HTTP/1.1\r\n"))
        connection.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(self.successResultOf(d).code, 200)

    def test_other_methods_are_not(self) -> None:
        self.failureResultOf(self.reused_and_lost(b"DELETE"), ResponseNeverReceived)
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_a_new_connection_dying_is_not_retried(self) -> None:
        d = self.poll()
        connection, _ = self.connect()
        connection.connectionLost(Failure(ConnectionDone()))
        self.failureResultOf(d, ResponseNeverReceived)
        self.assertEqual(len(self.reactor.tcpClients), 1)


class ClosedAfterStreamsTests(_ClientCase):
    """llama-server closes the connection after every streamed (chunked) answer, with
    no ``Connection: close``: a request written on it as the close arrives would have
    been read or not, nobody knows (rule 7). Once a host was seen doing it, crossbar
    closes such connections itself instead of pooling them."""

    CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    PLAIN = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    def answer(self, head: bytes) -> tuple[H1Connection, _Transport]:
        d = self.request()
        if len(self.reactor.tcpClients) > len(getattr(self, "_seen", [])):
            self._seen = getattr(self, "_seen", []) + [self.connect()]
        connection, transport = self._seen[-1]
        connection.dataReceived(head)
        self.successResultOf(d).deliverBody(_Body())
        return connection, transport

    def test_learned_from_a_close_right_after_a_stream(self) -> None:
        connection, transport = self.answer(self.CHUNKED)
        self.assertFalse(transport.disconnecting)  # pooled: nothing learned yet
        connection.connectionLost(Failure(ConnectionDone()))  # the host closes it at once
        _, second = self.answer(self.CHUNKED)
        self.assertTrue(second.disconnecting, "a stream's connection was pooled though the host closes them")
        self.assertEqual(len(self.reactor.tcpClients), 2)
        _, third = self.answer(self.PLAIN)
        self.assertEqual(len(self.reactor.tcpClients), 3)
        self.assertFalse(third.disconnecting)  # answers with a length are still pooled

    def test_not_learned_from_an_idle_close_much_later(self) -> None:
        connection, _ = self.answer(self.CHUNKED)
        self.reactor.advance(10.0)
        connection.connectionLost(Failure(ConnectionDone()))  # an idle timeout, not the stream
        _, second = self.answer(self.CHUNKED)
        self.assertFalse(second.disconnecting)
