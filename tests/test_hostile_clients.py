"""Hostile clients (docs/design.md §The proxy, rule 9: no request can crash crossbar or
leave it serving less), on real loopback sockets against crossbar in front of two
:class:`~tests.harness.FakeLlama` hosts (:func:`tests.harness.two_hosts`).

What the random requests of ``test_fuzz`` do not reach: several requests in one write,
request smuggling (the upstream must never see a request boundary crossbar did not),
HTTP/1.0 framing, connections that trickle or never finish, clients that leave
mid-upload, and many idle connections at once. After each, crossbar still answers a
normal request, no host is marked down, and nothing is logged as an error.
"""

from __future__ import annotations

import json
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from tests.harness import TwoHosts, two_hosts, upstream_requests, wait_for
from tests.logs import LogCapture
from tests.raw import complete, parse_responses, post_bytes, raw_exchange, request_bytes, still_serving

_PLAIN = b'{"model": "model-a", "messages": []}'
_STREAM = b'{"model": "model-a", "stream": true, "messages": []}'
_PATH = b"/r/v1/chat/completions"


def _post(body: bytes, close: bool = True, extra: list[tuple[bytes, bytes]] | None = None) -> bytes:
    return post_bytes(_PATH, body, extra or (), close)


class _Conn(Protocol):
    """A loopback connection that records what it receives and when it closes."""

    def __init__(self) -> None:
        self.received = b""
        self.closed: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.closed.callback(None)


async def _open(case: TestCase, port: int) -> _Conn:
    conn = _Conn()
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), conn)

    async def close() -> None:
        if not conn.closed.called:
            conn.transport.abortConnection()  # type: ignore[union-attr]
            await conn.closed

    case.addCleanup(lambda: ensureDeferred(close()))
    return conn


class PipeliningTests(TestCase):
    def test_streaming_request_then_plain_in_one_write(self) -> object:
        """A streaming completion, a plain one and a GET in one write: three
        well-formed answers in order, each from the upstream, the stream complete."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            hosts.a.event_delay = 0.02
            data, _ = await raw_exchange(
                hosts.port,
                _post(_STREAM, close=False) + _post(_PLAIN, close=False)
                + request_bytes(b"GET", b"/r/v1/chat/completions?p=1", close=True),
            )
            answers = parse_responses(data)
            self.assertEqual([a.status for a in answers], [200, 200, 200])
            self.assertTrue(answers[0].body.endswith(b"data: [DONE]\n\n"), answers[0].body[-100:])
            self.assertEqual(answers[0].body.count(b"data: {"), hosts.a.events)
            self.assertEqual(json.loads(answers[1].body)["object"], "chat.completion")
            self.assertEqual(json.loads(answers[2].body)["object"], "chat.completion")
            self.assertEqual([s.uri for s in upstream_requests(hosts.a)][:2], [b"/v1/chat/completions"] * 2)
            self.assertEqual(len(upstream_requests(hosts.a) + upstream_requests(hosts.b)), 3)
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())


class SmugglingTests(TestCase):
    """Ambiguous request framing is refused before anything goes upstream; what goes
    upstream is always exactly the body crossbar read, with its own Content-Length."""

    async def _refused(self, wire: bytes) -> None:
        watch = LogCapture(self)
        hosts = await two_hosts(self)
        data, how = await raw_exchange(hosts.port, wire)
        if data:
            answers = parse_responses(data)
            self.assertEqual([a.status for a in answers], [400], answers)
        self.assertEqual(upstream_requests(hosts.a) + upstream_requests(hosts.b), [])
        await still_serving(self, hosts, watch)

    _SMUGGLED = b"GET /r/v1/models HTTP/1.1\r\nHost: x\r\n\r\n"

    def test_content_length_and_chunked(self) -> object:
        """``Content-Length`` and ``Transfer-Encoding: chunked`` together (CL.TE/TE.CL)."""
        body = b"0\r\n\r\n" + self._SMUGGLED
        return ensureDeferred(self._refused(
            b"POST " + _PATH + b" HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n"
            % len(body) + body))

    def test_chunked_then_content_length(self) -> object:
        body = b"0\r\n\r\n" + self._SMUGGLED
        return ensureDeferred(self._refused(
            b"POST " + _PATH + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
            + body))

    def test_two_content_lengths(self) -> object:
        return ensureDeferred(self._refused(
            b"POST " + _PATH + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}"
            + self._SMUGGLED))

    def test_content_length_list_and_sign(self) -> object:
        return ensureDeferred(self._refused(
            b"POST " + _PATH + b" HTTP/1.1\r\nHost: x\r\nContent-Length: +2\r\n\r\n{}" + self._SMUGGLED))

    def test_transfer_encoding_not_only_chunked(self) -> object:
        return ensureDeferred(self._refused(
            b"POST " + _PATH + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"))

    def test_obfuscated_transfer_encoding_name(self) -> object:
        """``Transfer-Encoding :`` (space before the colon) is not a header name."""
        return ensureDeferred(self._refused(
            b"POST " + _PATH + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\nContent-Length: 5\r\n\r\n"
            b"0\r\n\r\n"))

    def test_bad_chunk_sizes(self) -> object:
        async def go() -> None:
            # (A huge but valid chunk size just waits for its data: the idle timeout and
            # the 16 MiB cut-off bound it, see test_request_body.)
            for bad in (b"-1\r\n", b"0x5\r\nhello\r\n0\r\n\r\n", b"zz\r\n", b"5\r\nhelloXX0\r\n\r\n",
                        b"5 \r\nhello\r\n0\r\n\r\n"):
                await self._refused(b"POST " + _PATH + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                    + bad)

        return ensureDeferred(go())

    def test_pipelined_after_chunked_body_is_its_own_request(self) -> object:
        """A request pipelined right after a chunked body is a second request, answered
        by crossbar as such; the first one's body upstream is exactly its chunks."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            wire = (b"POST " + _PATH + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"%x\r\n%s\r\n0\r\n\r\n" % (len(_PLAIN), _PLAIN)
                    + request_bytes(b"GET", b"/r/v1/chat/completions?p=1"))
            data, _ = await raw_exchange(hosts.port, wire)
            self.assertEqual([a.status for a in parse_responses(data)], [200, 200])
            seen = upstream_requests(hosts.a) + upstream_requests(hosts.b)
            self.assertEqual(sorted((s.method, s.uri) for s in seen), [(b"GET", b"/v1/chat/completions?p=1"),
                                                                        (b"POST", b"/v1/chat/completions")])
            seen = [s for s in seen if s.method == b"POST"]
            self.assertEqual(seen[0].body, _PLAIN)
            self.assertEqual(seen[0].headers.getRawHeaders(b"content-length"), [b"%d" % len(_PLAIN)])
            self.assertIsNone(seen[0].headers.getRawHeaders(b"transfer-encoding"))
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())


class FramingTests(TestCase):
    def test_http10_streaming_answer_is_close_delimited(self) -> object:
        """An HTTP/1.0 client cannot read chunked framing: a streaming answer reaches it
        unchunked, ended by the close, complete."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            wire = _post(_STREAM, close=False).replace(b" HTTP/1.1\r\n", b" HTTP/1.0\r\n", 1)
            data, how = await raw_exchange(hosts.port, wire)
            self.assertIn(how, ("close", "half-close"))
            head, _, body = data.partition(b"\r\n\r\n")
            self.assertTrue(head.startswith(b"HTTP/1.0 200 ") or head.startswith(b"HTTP/1.1 200 "), head)
            self.assertNotIn(b"transfer-encoding", head.lower())
            self.assertTrue(body.startswith(b"data: {"), body[:50])
            self.assertTrue(body.endswith(b"data: [DONE]\n\n"), body[-50:])
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())

    def test_http10_keep_alive_gets_well_formed_answers(self) -> object:
        """HTTP/1.0 with ``Connection: keep-alive``: each answer is well-formed (length
        delimited, or the connection closed after it)."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            wire = (b"POST " + _PATH + b" HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: %d\r\n\r\n"
                    % len(_PLAIN) + _PLAIN)
            data, how = await raw_exchange(hosts.port, wire, wire, timeout=5)
            answers = parse_responses(data, at_eof=how != "until")
            self.assertIn(len(answers), (1, 2))
            for answer in answers:
                self.assertEqual(answer.status, 200)
                self.assertEqual(json.loads(answer.body)["object"], "chat.completion")
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())

    def test_absolute_form_target_goes_nowhere_else(self) -> object:
        """``POST http://other/r/v1/...``: absolute form is accepted (RFC 9112 §3.2.2) and
        routed by its path; crossbar is no forward proxy: never a request to ``other``."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            for target in (b"http://127.0.0.1:1/r/v1/chat/completions", b"http://x" + _PATH):
                data, _ = await raw_exchange(hosts.port, _post(_PLAIN).replace(_PATH, target, 1))
                [answer] = parse_responses(data)
                self.assertEqual(answer.status, 200)
                self.assertEqual(json.loads(answer.body)["object"], "chat.completion")
            for name in ("a", "b"):
                status = hosts.service.table.get(name)
                assert status is not None
                self.assertTrue(status.healthy)
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())

    def test_connect_and_odd_methods(self) -> object:
        """CONNECT (authority form), ``*`` targets and unknown methods: a well-formed
        answer, never a tunnel; the upstream never sees a CONNECT."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            for wire in (b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n",
                         b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                         b"CONNECT /r/v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                         b"BREW /r/v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"):
                data, _ = await raw_exchange(hosts.port, wire, until=complete, timeout=5)
                [answer] = parse_responses(data, at_eof=False)
                self.assertTrue(200 <= answer.status <= 599, answer)
            self.assertNotIn(b"CONNECT", [s.method for s in upstream_requests(hosts.a) + upstream_requests(hosts.b)])
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())

    def test_odd_expect_values(self) -> object:
        """``Expect`` other than ``100-continue``, and ``100-continue`` on a GET: a
        well-formed final answer; the upstream never sees ``Expect``."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            for wire in (_post(_PLAIN, extra=[(b"Expect", b"200-ok")]),
                         _post(_PLAIN, extra=[(b"Expect", b"100-continue, x")]),
                         request_bytes(b"GET", b"/r/v1/models", [(b"Expect", b"100-continue")])):
                data, _ = await raw_exchange(hosts.port, wire)
                final = [a for a in parse_responses(data) if a.status >= 200]
                self.assertEqual([a.status for a in final], [200])
            for seen in upstream_requests(hosts.a):
                self.assertIsNone(seen.headers.getRawHeaders(b"expect"))
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())

    def test_huge_header_line_and_too_many_headers(self) -> object:
        """A 64 KiB header line, 1000 headers: refused with a JSON 400 before anything
        goes upstream."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            for headers in ([(b"X-Big", b"b" * 65536)], [(b"X-H%d" % i, b"v") for i in range(1000)]):
                data, _ = await raw_exchange(hosts.port, _post(_PLAIN, extra=headers))
                self.assertEqual([a.status for a in parse_responses(data)], [400])
            self.assertEqual(upstream_requests(hosts.a), [])
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())


class SlowAndGoneTests(TestCase):
    def test_client_leaves_during_the_body(self) -> object:
        """A client that sends half its body and closes (or resets): nothing goes
        upstream, nothing is in flight, nothing logged as an error."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            for abort in (False, True):
                conn = await _open(self, hosts.port)
                conn.transport.write(_post(b"x" * 100_000)[:50_000])  # type: ignore[union-attr]
                await deferLater(reactor, 0.1)
                if abort:
                    conn.transport.abortConnection()  # type: ignore[union-attr]
                else:
                    conn.transport.loseConnection()  # type: ignore[union-attr]
                await conn.closed
            await deferLater(reactor, 0.2)
            self.assertEqual(upstream_requests(hosts.a) + upstream_requests(hosts.b), [])
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())

    def test_slow_body_forwarded_intact(self) -> object:
        """A body trickled in small pieces (a slow uploader) is forwarded whole, once."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            wire = _post(_PLAIN)
            head, body = wire[: wire.index(b"\r\n\r\n") + 4], wire[wire.index(b"\r\n\r\n") + 4:]
            conn = await _open(self, hosts.port)
            conn.transport.write(head)  # type: ignore[union-attr]
            for i in range(0, len(body), 4):
                await deferLater(reactor, 0.01)
                conn.transport.write(body[i:i + 4])  # type: ignore[union-attr]
            await conn.closed
            [answer] = parse_responses(conn.received)
            self.assertEqual(answer.status, 200)
            self.assertEqual([s.body for s in upstream_requests(hosts.a)], [_PLAIN])
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())

    def test_channel_idle_timeout_is_finite(self) -> object:
        """Connections that send nothing (or stall mid-head) are closed by the HTTP
        channel's idle timeout (Twisted's, reset by every byte received): it must be
        set, and not longer than a minute."""

        async def go() -> None:
            hosts = await two_hosts(self)
            timeout: Any = hosts.service.site.timeOut
            self.assertIsNotNone(timeout)
            self.assertLessEqual(timeout, 60)

        return ensureDeferred(go())

    def test_many_idle_and_trickling_connections(self) -> object:
        """500 connections at once (half silent, half trickling a header line a byte at
        a time, slowloris-style): crossbar still answers normal requests promptly, and
        once they go, nothing is left behind."""

        async def go() -> None:
            watch = LogCapture(self)
            hosts = await two_hosts(self)
            conns = await DeferredList([Deferred.fromCoroutine(_open(self, hosts.port)) for _ in range(500)],
                                       consumeErrors=True)
            opened = [c for ok, c in conns if ok]
            self.assertEqual(len(opened), 500)
            trickling = opened[::2]
            for conn in trickling:
                conn.transport.write(b"POST " + _PATH + b" HTTP/1.1\r\nX-Slow: ")  # type: ignore[union-attr]
            for _ in range(3):
                for conn in trickling:
                    conn.transport.write(b"a")  # type: ignore[union-attr]
                start = time.monotonic()
                await still_serving(self, hosts, watch)
                self.assertLess(time.monotonic() - start, 5.0)
            for conn in opened:
                self.assertFalse(conn.closed.called)
                self.assertEqual(conn.received, b"")
                conn.transport.abortConnection()  # type: ignore[union-attr]
            await DeferredList([c.closed for c in opened])
            await still_serving(self, hosts, watch)

        return ensureDeferred(go())
