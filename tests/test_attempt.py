"""Socket-free unit tests of :class:`crossbar.proxy.attempt.Attempt` (docs/design.md §The proxy,
rules 6-7): one upstream request to one host, classified as an :class:`Answer` or an
:class:`UpstreamFailed` of one :class:`FailureKind`.

:class:`FakeRuleTests` drives it with a fake ``UpstreamPools`` whose agents return
Deferreds the test fires, and a :class:`Clock`: one rule per test.
:class:`RealAgentTests` uses the real ``UpstreamPools`` (crossbar's HTTP/1.1 client and
its pool) over a ``MemoryReactorClock``, the host's side written
into a ``StringTransport``: the real HTTP parser, the real pool reuse and the real
cancellation. The loopback versions of these rules are in tests/test_failures.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.error import ConnectionDone, ConnectionLost, ConnectionRefusedError
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import (  # type: ignore[attr-defined]
    RequestNotSent,
    RequestTransmissionFailed,
    ResponseDone,
    ResponseFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers

from crossbar.upstream.h1client import KEEP_ALIVE_MARGIN
from crossbar.proxy.attempt import Answer, Attempt, BytesProducer, FailureKind, UpstreamFailed
from crossbar.upstream.pools import MAX_RESPONSE_HEAD, UpstreamPools

URL = b"http://127.0.0.1:8080/v1/chat/completions"
TIMEOUT = 300.0


# -- fakes ------------------------------------------------------------------------------


@dataclass
class FakeTracker:
    """What :class:`~crossbar.upstream.pools.ConnectTracker` tells an attempt."""

    connects: int = 0
    connect_failure: Failure | None = None
    connected_at: float | None = None


class FakeResponse:
    """An ``IResponse`` whose body is never read: ``deliverBody`` hands over
    :attr:`transport` (a ``StringTransport``, to see ``stopProducing``)."""

    code = 200

    def __init__(self) -> None:
        self.transport = StringTransport()
        self.delivered_to: list[Any] = []

    def deliverBody(self, protocol: Any) -> None:
        self.delivered_to.append(protocol)
        protocol.makeConnection(self.transport)


@dataclass
class SentRequest:
    """One ``agent.request`` call."""

    method: bytes
    url: bytes
    headers: Headers | None
    body: Any
    deferred: Deferred[Any]
    cancelled: list[bool] = field(default_factory=list)


class FakeAgent:
    """An ``IAgent`` whose requests stay pending until the test fires them.

    :param on_cancel: called with the request when its Deferred is cancelled; if it
        does not fire the Deferred, Twisted errbacks it with ``CancelledError``.
    """

    def __init__(self, on_cancel: Any = None) -> None:
        self.sent: list[SentRequest] = []
        self.on_cancel = on_cancel

    def request(self, method: bytes, uri: bytes, headers: Headers | None = None, bodyProducer: Any = None) -> Deferred[Any]:
        sent: SentRequest

        def cancel(d: Deferred[Any]) -> None:
            sent.cancelled.append(True)
            if self.on_cancel is not None:
                self.on_cancel(sent)

        sent = SentRequest(method, uri, headers, bodyProducer, Deferred(cancel))
        self.sent.append(sent)
        return sent.deferred


class FakePools:
    """``UpstreamPools``-compatible: ``agent(fresh)`` returns a new fake agent and
    tracker each time, remembered in :attr:`agents` as ``(fresh, agent, tracker)``."""

    def __init__(self, on_cancel: Any = None) -> None:
        self.agents: list[tuple[bool, FakeAgent, FakeTracker]] = []
        self.on_cancel = on_cancel

    def agent(self, fresh: bool = False) -> tuple[FakeAgent, FakeTracker]:
        agent, tracker = FakeAgent(self.on_cancel), FakeTracker()
        self.agents.append((fresh, agent, tracker))
        return agent, tracker

    def request(self, i: int) -> SentRequest:
        """The only request sent through the ``i``-th agent."""
        sent = self.agents[i][1].sent
        assert len(sent) == 1, sent
        return sent[0]


def stale(kind: type[Exception]) -> Failure:
    """The failure Twisted gives for a request on a connection that died."""
    if kind is RequestNotSent:
        return Failure(RequestNotSent())
    return Failure(kind([Failure(ConnectionDone())]))


# -- the rules, one at a time --------------------------------------------------------------


class FakeRuleTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1000.0)  # so "0" is never mistaken for a time
        self.pools = FakePools()

    def start(self, body: bytes | None = None, pools: Any = None) -> Deferred[Answer]:
        headers = Headers({b"host": [b"127.0.0.1:8080"]})
        attempt = Attempt(pools or self.pools, self.clock, b"POST", URL, headers, body, TIMEOUT)
        return attempt.start()

    def failure(self, d: Deferred[Answer], kind: FailureKind) -> UpstreamFailed:
        error = self.failureResultOf(d, UpstreamFailed).value
        assert isinstance(error, UpstreamFailed)
        self.assertIs(error.kind, kind)
        return error

    # -- an answer

    def test_sends_the_request(self) -> None:
        self.start(body=b'{"a": 1}')
        [(fresh, agent, _)] = self.pools.agents
        self.assertFalse(fresh)
        [sent] = agent.sent
        self.assertEqual((sent.method, sent.url), (b"POST", URL))
        self.assertEqual(sent.headers.getRawHeaders(b"host"), [b"127.0.0.1:8080"])  # type: ignore[union-attr]
        self.assertIsInstance(sent.body, BytesProducer)
        self.assertEqual(sent.body.length, 8)
        consumer = StringTransport()
        self.successResultOf(sent.body.startProducing(consumer))
        self.assertEqual(consumer.value(), b'{"a": 1}')

    def test_no_body_no_producer(self) -> None:
        self.start(body=None)
        self.assertIsNone(self.pools.request(0).body)

    def test_answer_on_a_reused_connection_counts_from_the_request(self) -> None:
        d = self.start()
        requested = self.clock.seconds()
        self.clock.advance(2.5)
        response = FakeResponse()
        self.pools.request(0).deferred.callback(response)
        answer = self.successResultOf(d)
        self.assertIs(answer.response, response)
        self.assertEqual(answer.sent_at, requested)

    def test_answer_on_a_new_connection_counts_from_the_connection(self) -> None:
        """Time to first byte counts from when the request was written: on a new
        connection, once it was open (connecting is not the host's thinking time)."""
        d = self.start()
        self.clock.advance(0.75)
        tracker = self.pools.agents[0][2]
        tracker.connects, tracker.connected_at = 1, self.clock.seconds()
        self.clock.advance(3.0)
        self.pools.request(0).deferred.callback(FakeResponse())
        self.assertEqual(self.successResultOf(d).sent_at, 1000.75)

    def test_answer_cancels_the_first_byte_timer(self) -> None:
        d = self.start()
        self.pools.request(0).deferred.callback(FakeResponse())
        self.successResultOf(d)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    # -- connect failures

    def test_connect_failure(self) -> None:
        d = self.start()
        refused = Failure(ConnectionRefusedError())
        self.pools.agents[0][2].connect_failure = refused
        self.pools.agents[0][2].connects = 1
        self.pools.request(0).deferred.errback(refused)
        error = self.failure(d, FailureKind.CONNECT)
        self.assertTrue(error.reason.startswith("connect: Connection was refused"), error.reason)
        self.assertEqual(len(self.pools.agents), 1)  # no retry: choosing again is the exchange's
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_connect_failure_wins_over_a_stale_looking_failure(self) -> None:
        d = self.start()
        self.pools.agents[0][2].connect_failure = Failure(ConnectionRefusedError())
        self.pools.request(0).deferred.errback(stale(ResponseNeverReceived))
        self.failure(d, FailureKind.CONNECT)
        self.assertEqual(len(self.pools.agents), 1)

    # -- a stale pooled connection (rule 7: retried once, fresh, same host, nothing marked down)

    def retried_on(self, kind: type[Exception], after: float = 0.5) -> None:
        d = self.start(body=b"a POST the host dropped with its idle connection")
        self.clock.advance(after)
        self.pools.request(0).deferred.errback(stale(kind))
        self.assertNoResult(d)
        self.assertEqual([fresh for fresh, _, _ in self.pools.agents], [False, True])
        retry = self.pools.request(1)
        self.assertEqual((retry.method, retry.url), (b"POST", URL))
        response = FakeResponse()
        retry.deferred.callback(response)
        self.assertIs(self.successResultOf(d).response, response)

    def test_request_not_sent_is_retried_fresh(self) -> None:
        self.retried_on(RequestNotSent)

    def test_request_transmission_failed_is_retried_fresh(self) -> None:
        """Issue 29 item 1: the host closed the reused connection while the body went out."""
        self.retried_on(RequestTransmissionFailed)

    def test_response_never_received_is_retried_fresh(self) -> None:
        """Issue 29 item 1: the request was written, the reused connection closed with no
        byte of the answer (the host dropped it as idle; llama-server cancels that work)."""
        self.retried_on(ResponseNeverReceived)

    def test_retried_however_long_after_sending(self) -> None:
        """No time window: what tells a stale connection is no byte of the answer."""
        self.retried_on(ResponseNeverReceived, after=TIMEOUT / 2)

    def test_part_of_an_answer_is_not_retried(self) -> None:
        """A connection that sent bytes of an answer and died is the host failing (502)."""
        d = self.start(body=b"a POST the host read")
        self.pools.request(0).deferred.errback(stale(ResponseFailed))
        error = self.failure(d, FailureKind.REQUEST)
        self.assertTrue(error.reason.startswith("request failed: "), error.reason)
        self.assertEqual(len(self.pools.agents), 1)

    def test_retry_sends_the_body_again(self) -> None:
        self.start(body=b"hello")
        self.pools.request(0).deferred.errback(stale(RequestNotSent))
        consumer = StringTransport()
        self.pools.request(1).body.startProducing(consumer)
        self.assertEqual(consumer.value(), b"hello")

    def test_retried_once_only(self) -> None:
        d = self.start()
        self.pools.request(0).deferred.errback(stale(ResponseNeverReceived))
        self.pools.agents[1][2].connects = 1
        self.pools.request(1).deferred.errback(stale(ResponseNeverReceived))
        error = self.failure(d, FailureKind.REQUEST)
        self.assertEqual(error.reason, "request failed: Connection was closed cleanly."
                                       " (on a fresh connection, after a stale one)")
        self.assertEqual(len(self.pools.agents), 2)

    def test_retry_failing_to_connect_is_a_request_failure(self) -> None:
        """The host may have read the request on the stale connection: a retry that
        cannot connect is a 502 (mark down), never a failover to another host (rule 7)."""
        d = self.start()
        self.pools.request(0).deferred.errback(stale(ResponseNeverReceived))
        refused = Failure(ConnectionRefusedError())
        self.pools.agents[1][2].connect_failure = refused
        self.pools.request(1).deferred.errback(refused)
        error = self.failure(d, FailureKind.REQUEST)
        self.assertIn("Connection was refused", error.reason)

    def test_not_retried_when_a_new_connection_was_opened(self) -> None:
        """The connection was new: the host itself failed, no pooled connection to blame."""
        d = self.start()
        self.pools.agents[0][2].connects = 1
        self.pools.request(0).deferred.errback(stale(ResponseNeverReceived))
        error = self.failure(d, FailureKind.REQUEST)
        self.assertEqual(error.reason, "request failed: Connection was closed cleanly.")
        self.assertEqual(len(self.pools.agents), 1)

    def test_retry_gets_a_whole_first_byte_timeout(self) -> None:
        d = self.start()
        self.clock.advance(0.5)
        self.pools.request(0).deferred.errback(stale(RequestNotSent))
        self.clock.advance(TIMEOUT - 0.1)
        self.assertNoResult(d)
        self.clock.advance(0.1)
        self.failure(d, FailureKind.FIRST_BYTE_TIMEOUT)
        self.assertEqual(self.pools.request(1).cancelled, [True])

    # -- other failures

    def test_other_failures_are_request_failures(self) -> None:
        for failure in (
            Failure(ResponseFailed([Failure(ConnectionLost("gone mid-head"))])),
            Failure(ValueError("something else")),
        ):
            pools = FakePools()
            d = self.start(pools=pools)
            pools.request(0).deferred.errback(failure)
            error = self.failure(d, FailureKind.REQUEST)
            self.assertTrue(error.reason.startswith("request failed: "), error.reason)
            self.assertEqual(len(pools.agents), 1)

    def test_reason_is_one_line(self) -> None:
        d = self.start()
        self.pools.request(0).deferred.errback(Failure(ValueError("two\nlines")))
        self.assertEqual(self.failure(d, FailureKind.REQUEST).reason, "request failed: two lines")

    # -- first-byte timeout

    def test_first_byte_timeout(self) -> None:
        d = self.start()
        self.clock.advance(TIMEOUT - 0.001)
        self.assertNoResult(d)
        self.assertEqual(self.pools.request(0).cancelled, [])
        self.clock.advance(0.001)
        error = self.failure(d, FailureKind.FIRST_BYTE_TIMEOUT)
        self.assertEqual(error.reason, "no response headers within 300s")
        self.assertEqual(self.pools.request(0).cancelled, [True])
        self.assertEqual(len(self.pools.agents), 1)  # never retried

    def test_first_byte_timeout_is_not_a_connect_failure(self) -> None:
        """The agent's cancelled request may report a connect failure (cancelled while
        connecting): it is still the timeout that is reported."""

        def cancelled_while_connecting(sent: SentRequest) -> None:
            failure = Failure(CancelledError())
            self.pools.agents[0][2].connect_failure = failure
            sent.deferred.errback(failure)

        self.pools.on_cancel = cancelled_while_connecting
        d = self.start()
        self.clock.advance(TIMEOUT)
        self.failure(d, FailureKind.FIRST_BYTE_TIMEOUT)

    def test_response_racing_the_first_byte_timeout_is_discarded(self) -> None:
        """The agent's cancel hands over a response instead of failing (the head won
        the race): it is still a timeout, and nobody reads that body, so its
        connection is closed rather than left open."""
        response = FakeResponse()
        self.pools.on_cancel = lambda sent: sent.deferred.callback(response)
        d = self.start()
        self.clock.advance(TIMEOUT)
        self.failure(d, FailureKind.FIRST_BYTE_TIMEOUT)
        self.assertEqual(response.transport.producerState, "stopped")

    # -- cancelled by the exchange (the client left)

    def test_cancel_cancels_the_agent_request(self) -> None:
        d = self.start()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.pools.request(0).cancelled, [True])
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(len(self.pools.agents), 1)

    def test_cancel_classifies_nothing(self) -> None:
        """Whatever the cancelled request fails with says nothing about the host: the
        result is a bare CancelledError, never an UpstreamFailed, and no retry."""
        for failure in (stale(ResponseNeverReceived), Failure(ConnectionRefusedError())):
            pools = FakePools(on_cancel=lambda sent, f=failure: sent.deferred.errback(f))
            d = self.start(pools=pools)
            pools.agents[0][2].connect_failure = failure
            d.cancel()
            self.failureResultOf(d, CancelledError)
            self.assertEqual(len(pools.agents), 1)

    def test_cancel_during_the_retry_cancels_the_retry(self) -> None:
        d = self.start()
        self.pools.request(0).deferred.errback(stale(RequestNotSent))
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(self.pools.request(1).cancelled, [True])
        self.assertEqual(len(self.pools.agents), 2)

    def test_response_after_cancel_is_discarded(self) -> None:
        response = FakeResponse()
        self.pools.on_cancel = lambda sent: sent.deferred.callback(response)
        d = self.start()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertEqual(response.transport.producerState, "stopped")

    def test_cancel_after_the_answer_does_nothing(self) -> None:
        d = self.start()
        response = FakeResponse()
        self.pools.request(0).deferred.callback(response)
        d.cancel()
        self.assertIs(self.successResultOf(d).response, response)
        self.assertEqual(self.pools.request(0).cancelled, [])
        self.assertEqual(response.transport.producerState, "producing")


# -- the real Agent, pool and parser over a memory reactor ---------------------------------


class _Collect(Protocol):
    def __init__(self) -> None:
        self.data = b""
        self.reason: Failure | None = None

    def dataReceived(self, data: bytes) -> None:
        self.data += data

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:
        self.reason = reason


class RealAgentTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.reactor = MemoryReactorClock()
        self.reactor.advance(50.0)
        self.pools = UpstreamPools(self.reactor, connect_timeout=5.0)

    def start(self, body: bytes | None = b"{}", timeout: float = TIMEOUT) -> Deferred[Answer]:
        headers = Headers({b"host": [b"127.0.0.1:8080"]})
        return Attempt(self.pools, self.reactor, b"POST", URL, headers, body, timeout).start()

    def connect(self, index: int = -1) -> tuple[Protocol, StringTransport]:
        """Complete the ``index``-th connection the agent asked the reactor for."""
        host, port, factory, timeout, _ = self.reactor.tcpClients[index]
        self.assertEqual((host, port, timeout), ("127.0.0.1", 8080, 5.0))
        address = IPv4Address("TCP", host, port)
        protocol = factory.buildProtocol(address)
        transport = StringTransport(peerAddress=address)
        protocol.makeConnection(transport)
        return protocol, transport

    def failure(self, d: Deferred[Answer], kind: FailureKind) -> UpstreamFailed:
        error = self.failureResultOf(d, UpstreamFailed).value
        assert isinstance(error, UpstreamFailed)
        self.assertIs(error.kind, kind)
        return error

    def answer(self, protocol: Protocol, d: Deferred[Answer], head: bytes, body: bytes = b"") -> Answer:
        protocol.dataReceived(head + body)
        return self.successResultOf(d)

    def test_head_parsed_from_the_wire(self) -> None:
        d = self.start(body=b'{"x": 1}')
        self.reactor.advance(0.25)  # connecting takes a while
        protocol, transport = self.connect()
        sent = transport.value()
        self.assertTrue(sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n"), sent)
        self.assertIn(b"Content-Length: 8\r\n", sent)
        self.assertTrue(sent.endswith(b'\r\n\r\n{"x": 1}'), sent)
        self.reactor.advance(1.0)
        answer = self.answer(
            protocol, d,
            b"HTTP/1.1 201 Created\r\nConnection: keep-alive, X-Private\r\nX-Private: 1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n",
        )
        self.assertEqual(answer.response.code, 201)
        self.assertEqual(answer.response.headers.getRawHeaders(b"content-type"), [b"application/json"])
        self.assertEqual(answer.response.upstream_connection, (b"keep-alive, X-Private",))  # type: ignore[attr-defined]
        self.assertEqual(answer.sent_at, 50.25)  # when the new connection was open
        self.assertEqual(self.reactor.getDelayedCalls(), [])  # first-byte timer gone

    def test_connect_refused(self) -> None:
        d = self.start()
        _, _, factory, _, _ = self.reactor.tcpClients[0]
        factory.clientConnectionFailed(None, Failure(ConnectionRefusedError()))
        error = self.failure(d, FailureKind.CONNECT)
        self.assertTrue(error.reason.startswith("connect: Connection was refused"), error.reason)

    def reuse(self) -> tuple[Protocol, StringTransport]:
        """One whole exchange, leaving its connection in the persistent pool."""
        d = self.start()
        protocol, transport = self.connect()
        answer = self.answer(protocol, d, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
        body = _Collect()
        answer.response.deliverBody(body)
        protocol.dataReceived(b"ok")
        assert body.reason is not None
        self.assertEqual(body.data, b"ok")
        body.reason.trap(ResponseDone)
        transport.clear()
        return protocol, transport

    def test_reused_pooled_connection(self) -> None:
        protocol, transport = self.reuse()
        self.reactor.advance(7.0)
        d = self.start()
        self.assertEqual(len(self.reactor.tcpClients), 1)  # no new connection
        self.assertTrue(transport.value().startswith(b"POST /v1/chat/completions"))
        self.reactor.advance(2.0)
        answer = self.answer(protocol, d, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(answer.sent_at, 57.0)  # the request time: nothing was opened

    def test_pooled_connection_closed_after_the_request_is_retried_fresh(self) -> None:
        """Issue 29 item 1, rule 7: the host closed the reused connection once the request
        was written, with no byte of the answer (it dropped the idle connection as the
        request reached it): sent again once, on a new connection to the same host."""
        protocol, transport = self.reuse()
        d = self.start()
        self.assertTrue(transport.value().startswith(b"POST /v1/chat/completions"))
        self.reactor.advance(0.1)
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertNoResult(d)
        self.assertEqual(len(self.reactor.tcpClients), 2)  # a new connection, same host
        self.assertEqual(self.reactor.tcpClients[1][:2], self.reactor.tcpClients[0][:2])
        fresh, fresh_transport = self.connect(1)
        self.assertTrue(fresh_transport.value().startswith(b"POST /v1/chat/completions"))
        self.answer(fresh, d, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    def test_pooled_connection_cut_mid_head_is_not_retried(self) -> None:
        """A byte of the answer came: the host was working on it (rule 7: 502)."""
        protocol, _ = self.reuse()
        d = self.start()
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\n")
        protocol.connectionLost(Failure(ConnectionLost()))
        self.failure(d, FailureKind.REQUEST)
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_pooled_connection_past_the_keep_alive_timeout_is_not_reused(self) -> None:
        """Rule 7: a host that says ``Keep-Alive: timeout=5`` closes an idle connection
        at 5 s; crossbar stops reusing it before (a new connection instead)."""
        d = self.start()
        protocol, transport = self.connect()
        answer = self.answer(protocol, d, b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\nContent-Length: 0\r\n\r\n")
        answer.response.deliverBody(_Collect())
        self.reactor.advance(5 - KEEP_ALIVE_MARGIN - 0.01)
        self.start()
        self.assertEqual(len(self.reactor.tcpClients), 1)  # reused just before
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nContent-Length: 0\r\n\r\n")
        self.reactor.advance(5 - KEEP_ALIVE_MARGIN)
        self.assertTrue(transport.disconnecting)  # retired by the pool's timer
        self.start()
        self.assertEqual(len(self.reactor.tcpClients), 2)  # a new connection

    def test_pooled_connection_and_its_retry_dying_is_a_request_failure(self) -> None:
        protocol, _ = self.reuse()
        d = self.start()
        self.reactor.advance(2.0)
        protocol.connectionLost(Failure(ConnectionLost()))
        fresh, _ = self.connect(1)
        fresh.connectionLost(Failure(ConnectionLost()))
        error = self.failure(d, FailureKind.REQUEST)
        self.assertIn("Connection to the other side was lost", error.reason)
        self.assertEqual(len(self.reactor.tcpClients), 2)

    def test_new_connection_dying_before_the_head_is_a_request_failure(self) -> None:
        d = self.start()
        protocol, _ = self.connect()
        protocol.connectionLost(Failure(ConnectionDone()))
        self.failure(d, FailureKind.REQUEST)
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_first_byte_timeout_aborts_the_connection(self) -> None:
        d = self.start(timeout=30.0)
        protocol, transport = self.connect()
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\n")  # a head begun is not a head
        self.reactor.advance(30.0)
        self.assertEqual(self.failure(d, FailureKind.FIRST_BYTE_TIMEOUT).reason, "no response headers within 30s")
        self.assertTrue(transport.disconnected)  # aborted, not waiting to flush

    def test_first_byte_timeout_while_connecting(self) -> None:
        d = self.start(timeout=2.0)
        self.reactor.advance(2.0)
        self.failure(d, FailureKind.FIRST_BYTE_TIMEOUT)
        _, _, _, _, _ = self.reactor.tcpClients[0]
        self.assertTrue(self.reactor.connectors[0].stoppedConnecting)

    def test_refused_status_is_a_request_failure(self) -> None:
        for status in (b"101 Switching Protocols", b"600 Nope", b"099 Low"):
            self.reactor = MemoryReactorClock()
            self.pools = UpstreamPools(self.reactor, connect_timeout=5.0)
            d = self.start()
            protocol, _ = self.connect()
            protocol.dataReceived(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
            error = self.failure(d, FailureKind.REQUEST)
            self.assertIn("status code crossbar cannot relay", error.reason)

    def test_endless_head_is_a_request_failure(self) -> None:
        d = self.start()
        protocol, transport = self.connect()
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\n")
        line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
        for _ in range(MAX_RESPONSE_HEAD // len(line) + 1):
            protocol.dataReceived(line)
        error = self.failure(d, FailureKind.REQUEST)
        self.assertIn(f"response head over {MAX_RESPONSE_HEAD} bytes", error.reason)
        self.assertTrue(transport.disconnected)

    def test_cancel_aborts_the_connection(self) -> None:
        d = self.start()
        protocol, transport = self.connect()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertTrue(transport.disconnected)
        self.assertEqual(len(self.reactor.tcpClients), 1)

    def test_cancel_while_connecting_stops_connecting(self) -> None:
        d = self.start()
        d.cancel()
        self.failureResultOf(d, CancelledError)
        self.assertTrue(self.reactor.connectors[0].stoppedConnecting)
