"""Pins every private Twisted touchpoint listed in crossbar/upstream/twisted_private.py.

Each touchpoint has two kinds of test: the private names exist with the expected kind
and do what crossbar relies on (these fail with a message naming the Twisted internal
that moved), and a behaviour check through crossbar's public function. A failure here
after a Twisted upgrade means: read crossbar/upstream/twisted_private.py, adapt the touchpoint,
then refresh the pin in .ci/constraints.txt.
"""

from __future__ import annotations

import inspect
from typing import Any

import twisted
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web import _newclient
from twisted.web._newclient import HTTP11ClientProtocol, HTTPClientParser, ParseError
from twisted.web._newclient import Request as ClientRequest
from twisted.web.client import HTTPConnectionPool, ResponseFailed
from twisted.web.http import HTTPChannel
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site
from twisted.web.test.requesthelper import DummyChannel, DummyRequest

from crossbar.upstream.twisted_private import (
    MAX_RESPONSE_HEAD,
    BadRequestHook,
    ClientProtocol,
    ResponseHeadTooLarge,
    client_is_paused,
    quiet_pool,
)


def moved(name: str, touchpoint: int, what: str) -> str:
    return (
        f"Twisted {twisted.__version__} changed {name} ({what}): crossbar/upstream/twisted_private.py "
        f"touchpoint {touchpoint} relies on it; adapt it before taking this Twisted"
    )


class _Private(SynchronousTestCase):
    def require_attribute(self, owner: Any, name: str, touchpoint: int, kind: str = "method") -> Any:
        """``owner.name`` exists (and is callable when ``kind`` is "method")."""
        label = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', type(owner).__name__)}.{name}"
        if not hasattr(owner, name):
            self.fail(moved(label, touchpoint, "it is gone"))
        value = getattr(owner, name)
        if kind == "method" and not callable(value):
            self.fail(moved(label, touchpoint, f"no longer a method: {value!r}"))
        return value


def _client_request() -> ClientRequest:
    return ClientRequest(b"GET", b"/v1/models", Headers({b"host": [b"upstream"]}), None, persistent=True)


def _client(cls: type[HTTP11ClientProtocol] = ClientProtocol) -> tuple[HTTP11ClientProtocol, StringTransport]:
    protocol = cls()
    transport = StringTransport()
    protocol.makeConnection(transport)
    return protocol, transport


# -- touchpoint 1: HTTP11ClientProtocol's parser ---------------------------------------------


class ParserTouchpointTests(_Private):
    """Twisted internals :class:`ClientProtocol` reads."""

    def test_names_exist(self) -> None:
        self.require_attribute(HTTP11ClientProtocol, "_giveUp", 1)
        self.require_attribute(HTTP11ClientProtocol, "request", 1)
        self.require_attribute(HTTP11ClientProtocol, "dataReceived", 1)
        self.require_attribute(HTTPClientParser, "statusReceived", 1)
        for name in ("STATUS", "HEADER"):
            value = self.require_attribute(_newclient, name, 1, kind="constant")
            if not isinstance(value, str):
                self.fail(moved(f"twisted.web._newclient.{name}", 1, f"now {value!r}"))
        self.assertNotEqual(_newclient.STATUS, _newclient.HEADER, moved("twisted.web._newclient.STATUS/HEADER", 1, "equal"))

    def test_give_up_takes_a_failure(self) -> None:
        params = list(inspect.signature(HTTP11ClientProtocol._giveUp).parameters)
        self.assertEqual(params, ["self", "reason"], moved("HTTP11ClientProtocol._giveUp", 1, f"signature {params}"))

    def test_request_sets_the_parser(self) -> None:
        protocol, _ = _client(HTTP11ClientProtocol)
        self.assertIsNone(getattr(protocol, "_parser", "missing"), moved("HTTP11ClientProtocol._parser", 1, "not None before a request"))
        protocol.request(_client_request())
        parser = getattr(protocol, "_parser", None)
        self.assertIsInstance(parser, HTTPClientParser, moved("HTTP11ClientProtocol._parser", 1, f"request() set {parser!r}"))

    def test_parser_states_and_fields(self) -> None:
        protocol, _ = _client(HTTP11ClientProtocol)
        d = protocol.request(_client_request())
        parser: Any = protocol._parser
        self.assertEqual(parser.state, _newclient.STATUS, moved("HTTPClientParser.state", 1, "not STATUS before the status line"))
        protocol.dataReceived(b"HTTP/1.1 207 Multi\r\n")
        self.assertEqual(parser.state, _newclient.HEADER, moved("HTTPClientParser.state", 1, "not HEADER after the status line"))
        self.assertEqual(getattr(getattr(parser, "response", None), "code", None), 207,
                         moved("HTTPClientParser.response", 1, "not set by statusReceived"))
        protocol.dataReceived(b"Connection: keep-alive, X-Secret\r\nX-Secret: 1\r\nContent-Length: 0\r\n\r\n")
        conn_headers = getattr(parser, "connHeaders", None)
        self.assertIsInstance(conn_headers, Headers, moved("HTTPClientParser.connHeaders", 1, "gone"))
        self.assertEqual(conn_headers.getRawHeaders(b"connection"), [b"keep-alive, X-Secret"],  # type: ignore[union-attr]
                         moved("HTTPClientParser.connHeaders", 1, "no longer holds the Connection header"))
        response = self.successResultOf(d)
        self.assertIsNone(response.headers.getRawHeaders(b"connection"),
                          "Twisted now passes Connection in IResponse.headers: touchpoint 1 may be dropped")

    def test_status_received_is_looked_up_on_the_instance(self) -> None:
        """ClientProtocol wraps the parser's ``statusReceived`` by assigning to the
        instance: the parser must call it through ``self``."""
        protocol, _ = _client(HTTP11ClientProtocol)
        protocol.request(_client_request())
        parser: Any = protocol._parser
        seen: list[bytes] = []
        original = parser.statusReceived
        parser.statusReceived = lambda line: (seen.append(line), original(line))
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\n")
        self.assertEqual(seen, [b"HTTP/1.1 200 OK"], moved("HTTPClientParser.statusReceived", 1, "not called through the instance"))

    def test_give_up_fails_the_request(self) -> None:
        protocol, _ = _client(HTTP11ClientProtocol)
        d = protocol.request(_client_request())
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\n")
        protocol._giveUp(Failure(ValueError("given up")))
        failure = self.failureResultOf(d, ResponseFailed)
        self.assertTrue(failure.value.reasons[0].check(ValueError), moved("HTTP11ClientProtocol._giveUp", 1, "does not fail the request"))


class ClientProtocolTests(SynchronousTestCase):
    """Behaviour through :class:`ClientProtocol` (touchpoint 1)."""

    def answer(self, data: bytes) -> tuple[Deferred[Any], StringTransport]:
        protocol, transport = _client()
        d = protocol.request(_client_request())
        protocol.dataReceived(data)
        return d, transport

    def test_records_upstream_connection(self) -> None:
        d, _ = self.answer(b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nConnection: X-A, X-B\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(self.successResultOf(d).upstream_connection, (b"keep-alive", b"X-A, X-B"))

    def test_no_connection_header(self) -> None:
        d, _ = self.answer(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        self.assertEqual(self.successResultOf(d).upstream_connection, ())

    def refused(self, status: bytes) -> None:
        d, _ = self.answer(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\n\r\n")
        failure = self.failureResultOf(d, ResponseFailed)
        self.assertTrue(failure.value.reasons[0].check(ParseError), failure.value.reasons)
        self.assertIn("status code crossbar cannot relay", str(failure.value.reasons[0].value))

    def test_refuses_101(self) -> None:
        self.refused(b"101 Switching Protocols")

    def test_refuses_status_600(self) -> None:
        self.refused(b"600 Beyond")

    def test_refuses_status_below_100(self) -> None:
        self.refused(b"099 Below")

    def test_relays_every_status_in_range(self) -> None:
        for code in (100, 200, 204, 418, 599):
            head = b"HTTP/1.1 %d X\r\nContent-Length: 0\r\n\r\n" % code
            if code == 100:  # interim: skipped, the next head is the answer
                head += b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
            d, _ = self.answer(head)
            self.assertEqual(self.successResultOf(d).code, 200 if code == 100 else code)

    def test_gives_up_on_a_head_over_the_limit(self) -> None:
        protocol, transport = _client()
        d = protocol.request(_client_request())
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\n")
        sent = len(b"HTTP/1.1 200 OK\r\n")
        line = b"X-Filler: " + b"a" * 500 + b"\r\n"
        while not d.called:
            protocol.dataReceived(line)
            sent += len(line)
        failure = self.failureResultOf(d, ResponseFailed)
        self.assertTrue(failure.value.reasons[0].check(ResponseHeadTooLarge))
        self.assertTrue(transport.disconnected)  # aborted, not a polite close
        self.assertGreater(sent, MAX_RESPONSE_HEAD)
        self.assertLessEqual(sent, MAX_RESPONSE_HEAD + len(line))  # at the first chunk over

    def test_head_under_the_limit_is_fine(self) -> None:
        line = b"X-Filler: " + b"a" * 500 + b"\r\n"
        head = b"HTTP/1.1 200 OK\r\n" + line * ((MAX_RESPONSE_HEAD - 200) // len(line)) + b"Content-Length: 0\r\n\r\n"
        self.assertLess(len(head), MAX_RESPONSE_HEAD)
        d, transport = self.answer(head)
        self.assertEqual(self.successResultOf(d).code, 200)
        self.assertFalse(transport.disconnected)

    def test_head_count_restarts_per_request(self) -> None:
        """On a persistent connection each answer's head gets the whole limit."""
        protocol, transport = _client()
        line = b"X-Filler: " + b"a" * 500 + b"\r\n"
        head = b"HTTP/1.1 200 OK\r\n" + line * (MAX_RESPONSE_HEAD // len(line) - 4) + b"Content-Length: 0\r\n\r\n"
        for _ in range(3):
            d = protocol.request(_client_request())
            protocol.dataReceived(head)
            self.assertEqual(self.successResultOf(d).code, 200)
        self.assertFalse(transport.disconnected)

    def test_body_bytes_are_not_head(self) -> None:
        protocol, transport = _client()
        d = protocol.request(_client_request())
        size = 2 * MAX_RESPONSE_HEAD
        protocol.dataReceived(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        response = self.successResultOf(d)
        got: list[bytes] = []

        class _Body:
            def makeConnection(self, t: Any) -> None: ...
            def dataReceived(self, data: bytes) -> None: got.append(data)
            def connectionLost(self, reason: Failure) -> None: got.append(b"<end>")

        response.deliverBody(_Body())
        protocol.dataReceived(b"a" * size)
        self.assertEqual(b"".join(got), b"a" * size + b"<end>")
        self.assertFalse(transport.disconnected)


# -- touchpoint 2: HTTPConnectionPool._factory -------------------------------------------------


class _RecordingEndpoint:
    """An endpoint that records the factory it is asked to connect with."""

    def __init__(self) -> None:
        self.factories: list[Any] = []

    def connect(self, factory: Any) -> Deferred[Any]:
        self.factories.append(factory)
        return Deferred()


class PoolFactoryTests(_Private):
    def test_factory_attribute_exists(self) -> None:
        factory = self.require_attribute(HTTPConnectionPool, "_factory", 2, kind="class")
        self.assertTrue(inspect.isclass(factory), moved("HTTPConnectionPool._factory", 2, f"not a class: {factory!r}"))
        self.require_attribute(HTTPConnectionPool, "_newConnection", 2)

    def test_new_connection_uses_the_factory(self) -> None:
        built: list[tuple[Any, ...]] = []

        class Recording:
            def __init__(self, *args: Any) -> None:
                built.append(args)

        pool = HTTPConnectionPool(Clock(), persistent=False)
        pool._factory = Recording  # type: ignore[assignment]
        endpoint = _RecordingEndpoint()
        pool.getConnection(("http", b"upstream", 80), endpoint)
        self.assertEqual(len(built), 1, moved("HTTPConnectionPool._newConnection", 2, "no longer builds self._factory"))
        self.assertIsInstance(endpoint.factories[0], Recording)
        self.assertTrue(callable(built[0][0]), moved("HTTPConnectionPool._factory", 2, f"called with {built[0]!r}"))

    def test_quiet_pool_builds_client_protocols(self) -> None:
        """Behaviour through :func:`quiet_pool`: its connections are ClientProtocol, and
        their factory does not log."""
        for persistent in (True, False):
            pool = quiet_pool(Clock(), persistent=persistent)
            self.assertEqual(pool.persistent, persistent)
            endpoint = _RecordingEndpoint()
            pool.getConnection(("http", b"upstream", 80), endpoint)
            [factory] = endpoint.factories
            self.assertFalse(factory.noisy)
            self.assertIsInstance(factory.buildProtocol(None), ClientProtocol)


# -- touchpoint 3: HTTPChannel._respondToBadRequestAndDisconnect ----------------------------


class _Hold(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []

    def render(self, request: Request) -> Any:
        self.requests.append(request)
        return NOT_DONE_YET


def _serve(protocol: type[HTTPChannel]) -> tuple[HTTPChannel, StringTransport, _Hold]:
    resource = _Hold()
    site = Site(resource, reactor=Clock())
    site.protocol = protocol  # type: ignore[assignment]
    channel = site.buildProtocol(None)
    assert isinstance(channel, HTTPChannel)
    transport = StringTransport()
    channel.makeConnection(transport)
    return channel, transport, resource


class _Counting(HTTPChannel):
    bad = 0

    def _respondToBadRequestAndDisconnect(self) -> None:
        self.bad += 1
        assert self.transport is not None
        self.transport.loseConnection()


class _Hooked(BadRequestHook, HTTPChannel):
    bad = 0

    def respond_to_bad_request(self) -> None:
        self.bad += 1
        assert self.transport is not None
        self.transport.write(b"HOOKED")
        self.transport.loseConnection()


class BadRequestTouchpointTests(_Private):
    def test_name_exists(self) -> None:
        self.require_attribute(HTTPChannel, "_respondToBadRequestAndDisconnect", 3)
        params = list(inspect.signature(HTTPChannel._respondToBadRequestAndDisconnect).parameters)
        self.assertEqual(params, ["self"], moved("HTTPChannel._respondToBadRequestAndDisconnect", 3, f"signature {params}"))

    def test_called_for_unparsable_requests(self) -> None:
        for data in (
            b"NOT-HTTP\r\n\r\n",
            b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        ):
            channel, transport, resource = _serve(_Counting)
            channel.dataReceived(data)
            self.assertEqual(
                channel.bad, 1,  # type: ignore[attr-defined]
                moved("HTTPChannel._respondToBadRequestAndDisconnect", 3, f"not called for {data!r}"),
            )
            self.assertEqual(resource.requests, [])
            self.assertEqual(transport.value(), b"")  # nothing but the override answered

    def test_bad_request_hook(self) -> None:
        """Behaviour through :class:`BadRequestHook`: its ``respond_to_bad_request``
        answers instead of Twisted's bare 400."""
        channel, transport, _ = _serve(_Hooked)
        channel.dataReceived(b"NOT-HTTP\r\n\r\n")
        self.assertEqual(channel.bad, 1)  # type: ignore[attr-defined]
        self.assertEqual(transport.value(), b"HOOKED")
        self.assertTrue(transport.disconnecting)

    def test_good_request_does_not_call_it(self) -> None:
        channel, _, resource = _serve(_Hooked)
        channel.dataReceived(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(channel.bad, 0)  # type: ignore[attr-defined]
        self.assertEqual(len(resource.requests), 1)

    def test_hook_must_be_defined(self) -> None:
        self.assertRaises(NotImplementedError, BadRequestHook().respond_to_bad_request)


# -- touchpoint 4: HTTPChannel._waitingForTransport ----------------------------------------------


class WaitingForTransportTests(_Private):
    def test_flips_with_the_transport(self) -> None:
        channel, _, _ = _serve(HTTPChannel)
        name = "HTTPChannel._waitingForTransport"
        self.assertIs(getattr(channel, "_waitingForTransport", None), False, moved(name, 4, "not False at first"))
        channel.pauseProducing()  # what the TCP transport does when its buffer fills
        self.assertIs(channel._waitingForTransport, True, moved(name, 4, "not set by pauseProducing"))
        channel.resumeProducing()
        self.assertIs(channel._waitingForTransport, False, moved(name, 4, "not cleared by resumeProducing"))

    def test_late_producer_is_not_told(self) -> None:
        """Why the touchpoint exists: a producer registered while the channel is paused
        is not told to pause (if Twisted starts telling it, client_is_paused may go)."""
        channel, _, resource = _serve(HTTPChannel)
        channel.dataReceived(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        channel.pauseProducing()
        paused: list[bool] = []

        class _Producer:
            def pauseProducing(self) -> None: paused.append(True)
            def resumeProducing(self) -> None: paused.append(False)
            def stopProducing(self) -> None: ...

        resource.requests[0].registerProducer(_Producer(), True)
        self.assertEqual(paused, [], "Twisted now pauses a producer registered on a paused channel: "
                                     "crossbar/upstream/twisted_private.py touchpoint 4 may be dropped")

    def test_client_is_paused(self) -> None:
        """Behaviour through :func:`client_is_paused`."""
        channel, _, resource = _serve(HTTPChannel)
        channel.dataReceived(b"GET /r HTTP/1.1\r\nHost: x\r\n\r\n")
        [request] = resource.requests
        self.assertFalse(client_is_paused(request))
        channel.pauseProducing()
        self.assertTrue(client_is_paused(request))
        channel.resumeProducing()
        self.assertFalse(client_is_paused(request))
        channel.connectionLost(Failure(ConnectionDone()))

    def test_client_is_paused_without_the_attribute(self) -> None:
        """A request whose channel is no HTTPChannel (a test double) reads as not paused."""
        request = DummyRequest([b""])
        request.channel = DummyChannel()
        self.assertFalse(client_is_paused(request))  # type: ignore[arg-type]


class VersionTests(SynchronousTestCase):
    def test_checked_range_covers_this_twisted(self) -> None:
        """The module's docstring names the Twisted versions it was checked against; the
        one installed must be among them (raise the range after checking a new one)."""
        import crossbar.upstream.twisted_private as module

        doc = module.__doc__ or ""
        version = twisted.version
        self.assertIn("checked", doc)
        self.assertIn(f"{version.major}.{version.minor}", doc,
                      f"Twisted {twisted.__version__} is not named in crossbar/upstream/twisted_private.py's docstring")
