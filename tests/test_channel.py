"""The request-head deadline (crossbar/proxy/channel.py): slowloris is cut, keep-alive and
long answers are not."""

from __future__ import annotations

import json

from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from twisted.logger import formatEvent

from crossbar.proxy.channel import HEAD_DEADLINE, HeadDeadlineChannel
from tests.logs import LogCapture


class _Slow(Resource):
    """Answers only when the test says so (a long stream stands in)."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[Request] = []

    def render(self, request: Request) -> object:
        self.pending.append(request)
        return NOT_DONE_YET


def _channel(resource: Resource) -> tuple[HeadDeadlineChannel, StringTransport, Clock]:
    clock = Clock()
    site = Site(resource, reactor=clock)
    site.protocol = HeadDeadlineChannel  # type: ignore[assignment]
    channel = site.buildProtocol(None)
    assert isinstance(channel, HeadDeadlineChannel)
    transport = StringTransport()
    channel.makeConnection(transport)
    return channel, transport, clock


class HeadDeadlineTests(TestCase):
    def test_trickled_head_is_cut_at_the_deadline(self) -> None:
        """One header byte every 10 s never completes a head: aborted at the deadline,
        although Twisted's idle timeout alone would never fire."""
        channel, transport, clock = _channel(_Slow())
        channel.dataReceived(b"GET /r/v1/models HTTP/1.1\r\n")
        waited = 0.0
        while waited + 10 < HEAD_DEADLINE:
            clock.advance(10)
            waited += 10
            channel.dataReceived(b"X")
            self.assertFalse(transport.disconnecting)
        clock.advance(HEAD_DEADLINE - waited)
        self.assertTrue(transport.disconnecting)

    def test_long_answer_is_not_cut(self) -> None:
        """Once the head is in, the deadline does not run while the answer is made."""
        slow = _Slow()
        channel, transport, clock = _channel(slow)
        channel.dataReceived(b"GET /r/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(len(slow.pending), 1)
        for _ in range(10):
            clock.advance(HEAD_DEADLINE / 2)
            slow.pending[0].write(b"chunk")
        self.assertFalse(transport.disconnecting)
        slow.pending[0].finish()
        self.assertFalse(transport.disconnecting)  # keep-alive: open for the next head

    def test_keep_alive_gets_a_fresh_deadline_per_request(self) -> None:
        slow = _Slow()
        channel, transport, clock = _channel(slow)
        for i in range(3):
            clock.advance(HEAD_DEADLINE - 1)
            channel.dataReceived(b"GET /r/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            slow.pending[i].finish()
        self.assertFalse(transport.disconnecting)
        clock.advance(HEAD_DEADLINE)  # idle keep-alive: closed after the same time
        self.assertTrue(transport.disconnecting)

    def test_idle_keep_alive_closed_is_not_a_slow_request(self) -> None:
        """Issue 20 item 10: an idle keep-alive connection closed after the deadline is
        no request: not logged as ``request head or body too slow``; a trickled head
        still is."""
        watch = LogCapture(self)
        slow = _Slow()
        channel, transport, clock = _channel(slow)
        channel.dataReceived(b"GET /r/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        slow.pending[0].finish()
        clock.advance(HEAD_DEADLINE)
        self.assertTrue(transport.disconnecting)
        texts = [formatEvent(e) or "" for e in watch.events]
        self.assertFalse([t for t in texts if "too slow" in t], texts)
        self.assertTrue([t for t in texts if "idle connection" in t], texts)

        channel, transport, clock = _channel(slow)
        clock.advance(HEAD_DEADLINE)  # opened, never sent a byte: idle too
        self.assertTrue(transport.disconnecting)
        self.assertFalse([e for e in watch.events if "too slow" in (formatEvent(e) or "")])

        channel, transport, clock = _channel(slow)
        channel.dataReceived(b"GET /r/v1/mod")
        clock.advance(HEAD_DEADLINE)
        self.assertTrue(transport.disconnecting)
        self.assertTrue([e for e in watch.events if "too slow" in (formatEvent(e) or "")])

    def test_pipelined_request_is_not_cut(self) -> None:
        """A second request already buffered behind the first is parsed as the first
        ends; the deadline armed for it is disarmed by its complete head."""
        slow = _Slow()
        channel, transport, clock = _channel(slow)
        get = b"GET /r/v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        channel.dataReceived(get + get)
        slow.pending[0].finish()
        self.assertEqual(len(slow.pending), 2)
        clock.advance(HEAD_DEADLINE * 3)
        self.assertFalse(transport.disconnecting)
        slow.pending[1].finish()


class _NoDelayTransport(StringTransport):
    """A StringTransport that records TCP_NODELAY, as a TCP transport would take it."""

    no_delay: bool | None = None

    def setTcpNoDelay(self, enabled: bool) -> None:
        self.no_delay = enabled


class NoDelayTests(TestCase):
    """Nagle's algorithm is off on both sides of the proxy: otherwise a small write
    waits for the peer's delayed ACK (up to 40 ms), stalling requests and coalescing
    stream events (crossbar/upstream/tcp.py)."""

    def test_client_connections(self) -> None:
        site = Site(_Slow(), reactor=Clock())
        site.protocol = HeadDeadlineChannel  # type: ignore[assignment]
        channel = site.buildProtocol(None)
        transport = _NoDelayTransport()
        channel.makeConnection(transport)
        self.assertIs(transport.no_delay, True)
        channel.connectionLost(Failure(ConnectionDone()))

    def test_upstream_connections(self) -> None:
        from crossbar.upstream.h1client import H1Connection

        protocol = H1Connection(None, (b"http", b"upstream", 80), True)
        transport = _NoDelayTransport()
        protocol.makeConnection(transport)
        self.assertIs(transport.no_delay, True)

    def test_other_transports_are_left_alone(self) -> None:
        from crossbar.upstream.tcp import no_delay

        no_delay(StringTransport())  # no setTcpNoDelay: nothing to do, no error


class BadRequestTests(TestCase):
    """What Twisted cannot parse is answered ``400 {"error": {"code": 400, "message": "bad request", "type": "invalid_request_error"}}`` in JSON
    (docs/design.md §The proxy, rule 9), and the connection closed."""

    def answer(self, data: bytes) -> bytes:
        channel, transport, _ = _channel(_Slow())
        channel.dataReceived(data)
        self.assertTrue(transport.disconnecting)
        return transport.value()

    def assertJSON400(self, raw: bytes) -> None:
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.assertEqual(lines[0], b"HTTP/1.1 400 Bad Request")
        self.assertIn(b"Content-Type: application/json", lines)
        self.assertIn(b"Content-Length: %d" % len(body), lines)
        self.assertEqual(json.loads(body), {"error": {"code": 400, "message": "bad request", "type": "invalid_request_error"}})

    def test_bad_request_line(self) -> None:
        self.assertJSON400(self.answer(b"NOT-HTTP\r\n\r\n"))

    def test_bad_header(self) -> None:
        self.assertJSON400(self.answer(b"GET /r/v1/models HTTP/1.1\r\nno colon here\r\n\r\n"))

    def test_conflicting_framing(self) -> None:
        self.assertJSON400(self.answer(
            b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc"
        ))

    def test_line_over_16_kib(self) -> None:
        """Twisted closes such a connection without a word; crossbar answers 400."""
        self.assertJSON400(self.answer(b"GET /r/v1/models HTTP/1.1\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n"))
        self.assertJSON400(self.answer(b"GET /r/v1/" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"))

    def test_head_gets_no_body(self) -> None:
        raw = self.answer(b"HEAD /r/v1/\x00 HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 400 Bad Request"))
        self.assertEqual(body, b"")


class BodyDeadlineTests(TestCase):
    """A request body must average MIN_BODY_RATE after a HEAD_DEADLINE head start."""

    def test_trickled_body_is_cut(self) -> None:
        from crossbar.proxy.channel import body_deadline

        slow = _Slow()
        channel, transport, clock = _channel(slow)
        channel.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        deadline = body_deadline(1000)
        waited = 0.0
        while waited + 10 < deadline:
            clock.advance(10)
            waited += 10
            channel.dataReceived(b"x")  # one byte every 10 s: Twisted's idle timeout never fires
            self.assertFalse(transport.disconnecting)
        clock.advance(deadline - waited)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(slow.pending, [])  # never reached a resource

    def test_body_in_time_then_long_answer(self) -> None:
        slow = _Slow()
        channel, transport, clock = _channel(slow)
        channel.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        clock.advance(HEAD_DEADLINE / 2)  # over HEAD_DEADLINE in all: the 16 MiB allowance
        channel.dataReceived(b"3\r\nabc\r\n")  # applies to a chunked body
        clock.advance(HEAD_DEADLINE / 2 + 10)
        channel.dataReceived(b"0\r\n\r\n")
        self.assertEqual(len(slow.pending), 1)
        clock.advance(HEAD_DEADLINE * 10)  # the answer takes long: no deadline runs
        self.assertFalse(transport.disconnecting)
        slow.pending[0].finish()

    def test_deadline_grows_with_the_body(self) -> None:
        from crossbar.proxy.channel import MIN_BODY_RATE, body_deadline
        from crossbar.proxy.request import MAX_BODY

        self.assertEqual(body_deadline(0), HEAD_DEADLINE)
        self.assertEqual(body_deadline(MIN_BODY_RATE * 10), HEAD_DEADLINE + 10)
        self.assertEqual(body_deadline(None), body_deadline(MAX_BODY))
