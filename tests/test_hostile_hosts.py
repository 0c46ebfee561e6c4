"""Hostile hosts (docs/design.md §The proxy, rules 6, 7 and 9): a host that answers with
malformed or abusive HTTP must never crash crossbar, make it send a malformed answer,
make it buffer without bound, or leave it serving less.

Each test runs crossbar in front of a raw-socket host (:class:`RawHost`: good answers
to the health polls, a scripted answer to everything else) and a well-behaved
:class:`~tests.harness.FakeLlama`, on loopback. The client side uses the strict parser
of :mod:`tests.raw`, so an answer crossbar relays must be well-formed HTTP/1.1. After
each hostile exchange a normal request through crossbar still succeeds and nothing
was logged as an error.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from twisted.internet import reactor, tcp
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import deferLater
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from zope.interface import implementer

from crossbar.process.service import CrossbarService
from tests.harness import FakeLlama, listen, port_of, start_crossbar, start_routes
from tests.logs import LogCapture
from tests.raw import RawResponse, complete, parse_responses, raw_exchange, request_bytes
from tests.upstreams import RawHost, RawHostProtocol, Script, serve_raw

_BODY = json.dumps({"model": "tiny-a", "messages": []}).encode()


def _send(data: bytes, close: bool = False) -> Script:
    """A script that writes ``data`` (and then closes, with ``close``)."""

    def script(proto: RawHostProtocol) -> None:
        proto.write(data)
        if close:
            proto.transport.loseConnection()  # type: ignore[union-attr]

    return script


class _Setup:
    def __init__(self, service: CrossbarService, base: str, port: int, host: RawHost, watch: LogCapture) -> None:
        self.service = service
        self.base = base
        self.port = port
        self.host = host
        self.watch = watch


async def _setup(case: TestCase, script: Script, timeouts: str = "{first_byte: 20, idle: 20}") -> _Setup:
    """crossbar with route ``r`` -> the raw host ``evil`` and route ``ok`` -> a good
    FakeLlama ``good``, both healthy."""
    watch = LogCapture(case)
    host = RawHost(script)
    evil = await serve_raw(case, host)
    good = await listen(case, FakeLlama())
    service, base = await start_routes(case, {"evil": evil, "good": good}, {"r": ["evil"], "ok": ["good"]},
                                       timeouts=timeouts)
    return _Setup(service, base, port_of(base), host, watch)


async def _ask(setup: _Setup, route: bytes = b"r", method: bytes = b"POST", timeout: float = 10.0) -> RawResponse:
    body = _BODY if method != b"GET" else b""
    headers = [(b"Content-Type", b"application/json"), (b"Content-Length", b"%d" % len(body))] if body else []
    data, how = await raw_exchange(setup.port, request_bytes(method, b"/" + route + b"/v1/chat/completions",
                                                             headers, body), timeout=timeout)
    responses = parse_responses(data, head=method == b"HEAD", at_eof=True)
    final = [r for r in responses if r.status >= 200]
    assert len(final) == 1, responses
    return final[0]


async def _still_serving(case: TestCase, setup: _Setup) -> None:
    """A normal request through crossbar succeeds; nothing was logged as an error."""
    answer = await _ask(setup, b"ok")
    case.assertEqual((answer.status, answer.one(b"x-crossbar-host")), (200, b"good"))
    case.assertEqual(json.loads(answer.body)["object"], "chat.completion")
    case.assertEqual(setup.watch.errors(), [])
    case.assertEqual(setup.service.runtime.inflight.host("evil"), 0)
    case.assertEqual(setup.service.runtime.active, set())


async def _assert_cut_off(case: TestCase, setup: _Setup, data: bytes, how: str) -> None:
    """The host died mid-answer (rule 7): the client's connection is aborted, so it sees
    a cut-off answer or none (what had not reached it is dropped), never a clean end;
    the host is marked down; crossbar still serves."""
    case.assertEqual(how, "close")
    case.assertFalse(complete(data), data)
    status = setup.service.table.get("evil")
    assert status is not None
    case.assertFalse(status.healthy)
    case.assertIn("mid-answer", status.last_err)
    await _still_serving(case, setup)


def _assert_502(case: TestCase, setup: _Setup, answer: RawResponse, reason: str = "") -> None:
    case.assertEqual(answer.status, 502, answer)
    case.assertEqual(answer.one(b"content-type"), b"application/json")
    case.assertEqual(json.loads(answer.body), {"error": {"code": 502, "message": "upstream failed", "type": "server_error", "host": "evil"}})
    status = setup.service.table.get("evil")
    assert status is not None
    case.assertFalse(status.healthy)
    case.assertIn(reason, status.last_err)


def _hostile(script: Script, check: Callable[[TestCase, _Setup, RawResponse], None],
             method: bytes = b"POST", timeouts: str = "{first_byte: 20, idle: 20}") -> Callable[[TestCase], object]:
    def test(self: TestCase) -> object:
        async def go() -> None:
            setup = await _setup(self, script, timeouts)
            answer = await _ask(setup, method=method)
            check(self, setup, answer)
            await _still_serving(self, setup)

        return ensureDeferred(go())

    return test


def _is_502(reason: str = "") -> Callable[[TestCase, _Setup, RawResponse], None]:
    def check(case: TestCase, setup: _Setup, answer: RawResponse) -> None:
        _assert_502(case, setup, answer, reason)

    return check


class MalformedHeadTests(TestCase):
    """Answers whose head is not HTTP: 502, the host marked down."""

    test_garbage_status_line = _hostile(_send(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"), _is_502())
    test_non_numeric_status = _hostile(_send(b"HTTP/1.1 2OO OK\r\nContent-Length: 0\r\n\r\n"), _is_502())
    test_status_too_big = _hostile(_send(b"HTTP/1.1 1000 Big\r\nContent-Length: 2\r\n\r\nhi"), _is_502("status"))
    test_status_negative = _hostile(_send(b"HTTP/1.1 -1 Neg\r\nContent-Length: 2\r\n\r\nhi"), _is_502("status"))
    test_status_zero = _hostile(_send(b"HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\nhi"), _is_502("status"))
    test_status_600 = _hostile(_send(b"HTTP/1.1 600 Six\r\nContent-Length: 2\r\n\r\nhi"), _is_502("status"))
    test_header_without_colon = _hostile(_send(b"HTTP/1.1 200 OK\r\nNoColonHere\r\n\r\n"), _is_502())
    test_invalid_header_name = _hostile(_send(b"HTTP/1.1 200 OK\r\nBad Name: x\r\nContent-Length: 0\r\n\r\n"),
                                        _is_502())
    test_unknown_transfer_encoding = _hostile(
        _send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"), _is_502())
    test_conflicting_content_lengths = _hostile(
        _send(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi"), _is_502())
    test_close_right_after_status_line = _hostile(_send(b"HTTP/1.1 200 OK\r\n", close=True), _is_502())
    test_header_line_that_never_ends = _hostile(_send(b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 200_000), _is_502())

    def test_reason_phrase_with_bare_cr_not_relayed(self) -> object:
        """A reason phrase is relayed only when it is valid (RFC 9112 §4): a bare CR in
        it could split the client's view of the head (a sender MUST NOT generate one)."""

        def check(case: TestCase, setup: _Setup, answer: RawResponse) -> None:
            case.assertEqual(answer.status, 200)
            case.assertNotIn(b"\r", answer.reason)
            case.assertEqual(answer.get(b"x-injected"), [])
            case.assertEqual(answer.body, b"hi")

        return _hostile(_send(b"HTTP/1.1 200 OK\rX-Injected: 1\r\nContent-Length: 2\r\n\r\nhi"), check)(self)


@implementer(IPushProducer)
class _EndlessHead:
    """Writes header lines as fast as the connection takes them, never ending the head."""

    def __init__(self, proto: RawHostProtocol) -> None:
        self.proto = proto
        self.paused = False
        proto.transport.registerProducer(self, True)  # type: ignore[union-attr]
        proto.write(b"HTTP/1.1 200 OK\r\n")
        self.resumeProducing()

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        line = b"X-Filler: " + b"f" * 100 + b"\r\n"
        while not self.paused and not self.proto.closed.called:
            self.proto.write(line * 64)

    def stopProducing(self) -> None:
        self.paused = True


class AbusiveHeadTests(TestCase):
    def test_endless_header_section(self) -> object:
        """A host that sends header lines forever (each one short and valid): crossbar
        stops reading it after a bounded head (not at the first-byte timeout, 20 s here),
        answers 502 and closes the host's connection, so memory stays bounded."""

        async def go() -> None:
            setup = await _setup(self, lambda proto: reactor.callLater(0, _EndlessHead, proto))
            start = time.monotonic()
            answer = await _ask(setup, timeout=5.0)
            _assert_502(self, setup, answer, "head")
            self.assertLess(time.monotonic() - start, 5.0)
            [proto] = setup.host.requests
            await proto.closed
            # Socket buffers on loopback hold a few MiB; crossbar itself stops early.
            self.assertLess(proto.written, 32 * 1024 * 1024)
            await _still_serving(self, setup)

        return ensureDeferred(go())

    def test_endless_interim_responses(self) -> object:
        """A host that sends ``100 Continue`` forever (each interim answer is dropped by
        the HTTP client) is cut off the same way: 502, well before the timeout."""

        @implementer(IPushProducer)
        class Interims(_EndlessHead):
            def resumeProducing(self) -> None:
                self.paused = False
                while not self.paused and not self.proto.closed.called:
                    self.proto.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 256)

        async def go() -> None:
            setup = await _setup(self, lambda proto: reactor.callLater(0, Interims, proto))
            answer = await _ask(setup, timeout=5.0)
            _assert_502(self, setup, answer)
            await _still_serving(self, setup)

        return ensureDeferred(go())


class OddAnswerTests(TestCase):
    """Answers that are odd but valid HTTP, relayed well-formed."""

    def test_interim_responses_before_the_answer(self) -> object:
        """``100 Continue`` and ``103 Early Hints`` before the real answer: the client
        gets the final answer only, well-formed, and the host stays healthy."""

        def check(case: TestCase, setup: _Setup, answer: RawResponse) -> None:
            case.assertEqual((answer.status, answer.body), (200, b"hello"))
            status = setup.service.table.get("evil")
            assert status is not None
            case.assertTrue(status.healthy)

        return _hostile(_send(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload"
                              b"\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"), check)(self)

    def test_switching_protocols_is_not_relayed(self) -> object:
        """A host that answers ``101 Switching Protocols`` (crossbar never forwards
        ``Upgrade``): the client never sees a 101 (crossbar cannot relay a protocol
        switch), it gets a well-formed error."""

        def check(case: TestCase, setup: _Setup, answer: RawResponse) -> None:
            _assert_502(case, setup, answer)

        return _hostile(_send(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade"
                              b"\r\n\r\n\x81\x05hello"), check)(self)

    def test_content_length_and_chunked_together(self) -> object:
        """``Content-Length`` and ``Transfer-Encoding: chunked`` both: the chunked
        framing wins (RFC 9112 §6.3) and the client gets one consistent framing."""

        def check(case: TestCase, setup: _Setup, answer: RawResponse) -> None:
            case.assertEqual((answer.status, answer.body), (200, b"hello world"))
            case.assertEqual(answer.get(b"content-length"), [])

        return _hostile(_send(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                              b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), check)(self)

    def test_body_shorter_than_content_length(self) -> object:
        """A host that closes before its ``Content-Length`` is complete: the client's
        answer is cut off (never a clean end) and the host marked down."""

        async def go() -> None:
            setup = await _setup(self, _send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly-some", close=True))
            data, how = await raw_exchange(setup.port, request_bytes(
                b"POST", b"/r/v1/chat/completions", [(b"Content-Length", b"%d" % len(_BODY))], _BODY))
            await _assert_cut_off(self, setup, data, how)

        return ensureDeferred(go())

    def test_answer_without_length_ended_by_close(self) -> object:
        """A host that frames by closing (no length, not chunked) right after its
        headers: an empty body, relayed with a clean end; nothing marked down."""

        def check(case: TestCase, setup: _Setup, answer: RawResponse) -> None:
            case.assertEqual((answer.status, answer.body), (200, b""))
            status = setup.service.table.get("evil")
            assert status is not None
            case.assertTrue(status.healthy)

        return _hostile(_send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n", close=True), check)(self)

    def test_answer_without_length_ended_by_a_reset(self) -> object:
        """The same framing ended by a reset, not a close: a host that died. The
        client's answer is cut off and the host marked down (rule 7)."""

        def script(proto: RawHostProtocol) -> None:
            proto.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart of it")
            reactor.callLater(0.2, proto.transport.abortConnection)  # type: ignore[union-attr]

        async def go() -> None:
            setup = await _setup(self, script)
            data, how = await raw_exchange(setup.port, request_bytes(
                b"POST", b"/r/v1/chat/completions", [(b"Content-Length", b"%d" % len(_BODY))], _BODY))
            await _assert_cut_off(self, setup, data, how)

        return ensureDeferred(go())

    def test_answer_before_reading_a_large_body(self) -> object:
        """A host that answers ``413`` at once, without reading a 4 MiB request body, and
        closes: the client gets a well-formed answer (the 413 relayed, or a 502), and
        crossbar keeps serving."""

        async def go() -> None:
            setup = await _setup(self, _send(b"HTTP/1.1 413 Too Large\r\nContent-Length: 2\r\nConnection: close"
                                             b"\r\n\r\nno", close=True))
            body = b'{"model": "tiny-a", "pad": "' + b"p" * (4 * 1024 * 1024) + b'"}'
            data, _ = await raw_exchange(setup.port, request_bytes(
                b"POST", b"/r/v1/chat/completions", [(b"Content-Length", b"%d" % len(body))], body), timeout=10)
            [answer] = parse_responses(data)
            self.assertIn(answer.status, (413, 502), answer)
            await _still_serving(self, setup)

        return ensureDeferred(go())


class StrayBytesAndEarlyAnswerTests(TestCase):
    """Found by attacking the client with hostile hosts: bytes after a complete answer
    reached the next, queued request's answer; an answer before the request body was
    all sent left the upstream socket open for as long as the host kept it."""

    async def test_bytes_after_an_answer_never_reach_a_waiting_request(self) -> None:
        watch = LogCapture(self)
        calls: list[RawHostProtocol] = []

        def script(proto: RawHostProtocol) -> None:
            calls.append(proto)
            if len(calls) == 1:  # held, then its answer with a second one glued behind
                reactor.callLater(0.3, proto.write, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
                                  b"HTTP/1.1 299 INJECTED\r\nContent-Length: 4\r\n\r\nevil")
            else:
                proto.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok2")

        evil = await serve_raw(self, RawHost(script))
        service, base = await start_crossbar(self, (
            "health: {interval: 60, timeout: 5}\n"
            f"hosts:\n  evil: {{url: {evil}, max_inflight: 1}}\n"
            "routes:\n  r:\n    hosts: [evil]\n    affinity: {key: none}\n"))
        await service.poller.when_first_round_done()
        port = port_of(base)
        ask = request_bytes(b"POST", b"/r/v1/chat/completions",
                            [(b"Content-Type", b"application/json"), (b"Content-Length", b"%d" % len(_BODY))], _BODY)
        first = ensureDeferred(raw_exchange(port, ask, timeout=10))
        while not calls:
            await deferLater(reactor, 0.01)
        second = ensureDeferred(raw_exchange(port, ask, timeout=10))
        while service.runtime.queued("r") == 0:
            await deferLater(reactor, 0.01)
        answers = []
        for d in (first, second):
            data, _ = await d
            [answer] = parse_responses(data, at_eof=True)
            answers.append((answer.status, answer.reason, answer.body))
        self.assertEqual(answers, [(200, b"OK", b"hello"), (200, b"OK", b"ok2")])
        status = service.table.get("evil")
        assert status is not None
        self.assertTrue(status.healthy)
        self.assertEqual(watch.errors(), [])
        self.assertEqual(service.runtime.inflight.host("evil"), 0)

    async def test_answer_before_the_upload_ended_closes_the_upstream_connection(self) -> None:
        def script(proto: RawHostProtocol) -> None:
            proto.transport.pauseProducing()  # type: ignore[union-attr]  # never reads the body
            # answers once crossbar's sending is blocked (socket buffers full), and keeps
            # the socket open
            reactor.callLater(0.5, proto.write, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")

        host = RawHost(script)
        setup_host = await serve_raw(self, host)
        service, base = await start_routes(self, {"evil": setup_host}, {"r": ["evil"]})
        body = b'{"model": "tiny-a", "pad": "' + b"p" * (15 * 1024 * 1024) + b'"}'
        data, _ = await raw_exchange(port_of(base), request_bytes(
            b"POST", b"/r/v1/chat/completions", [(b"Content-Length", b"%d" % len(body))], body), timeout=10)
        [answer] = parse_responses(data, at_eof=True)
        self.assertEqual((answer.status, answer.body), (200, b"hello"))
        host_port = port_of(setup_host)

        def upstream_sockets() -> list[Any]:
            """crossbar's sockets to the host still watched by the reactor."""
            watched = set(reactor.getReaders()) | set(reactor.getWriters())  # type: ignore[attr-defined]
            return [s for s in watched if isinstance(s, tcp.Client) and s.getPeer().port == host_port]

        deadline = time.monotonic() + 5
        while upstream_sockets() and time.monotonic() < deadline:
            await deferLater(reactor, 0.05)
        # was: kept open, waiting to send the rest of the body, for as long as the host
        # kept the connection without reading
        self.assertEqual(upstream_sockets(), [])
        self.assertEqual(service.runtime.inflight.host("evil"), 0)
