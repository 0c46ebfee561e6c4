"""The channel that parses request heads with llhttp (crossbar/proxy/h1server.py): the same
answers, bytes for bytes, as Twisted's channel (crossbar's HeadDeadlineChannel) for the
same input, whole or split in any way; most requests parsed by llhttp, the rest handed
to Twisted's parser; pipelining, pauses and the fallback as Twisted does them."""

from __future__ import annotations

import random
import re
from typing import Any

from hypothesis import HealthCheck, given, settings

from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

import crossbar.compat.twisted as twisted_fence
from crossbar.proxy.channel import HEAD_DEADLINE, HeadDeadlineChannel
from crossbar.proxy.h1server import ANSWERING, BODY, HEAD, TWISTED, H1ServerChannel
from crossbar.proxy.request import CappedRequest
from tests.test_channel import _Slow
from tests.test_fuzz import Case, cases


class _Echo(Resource):
    """Answers with what it was given: method, target, version, headers, body."""

    isLeaf = True

    def render(self, request: Request) -> bytes:
        headers = sorted((n, tuple(v)) for n, v in request.requestHeaders.getAllRawHeaders())
        body = request.content.read() if request.content is not None else b""
        request.setHeader(b"x-echo", b"1")
        return repr((request.method, request.uri, request.clientproto, headers, body)).encode()


def _connect(protocol: type, resource: Resource) -> tuple[Any, StringTransport, Clock]:
    clock = Clock()
    site = Site(resource, reactor=clock)
    site.protocol = protocol  # type: ignore[method-assign]
    channel = site.buildProtocol(None)
    assert isinstance(channel, HeadDeadlineChannel)
    transport = StringTransport()
    channel.makeConnection(transport)
    return channel, transport, clock


_DATE = re.compile(rb"Date: [^\r]*\r\n")


def _answer(protocol: type, pieces: list[bytes], capped: bool = False) -> tuple[bytes, bool]:
    channel, transport, _ = _connect(protocol, _Echo())
    if capped:  # crossbar's bodies: refused early (413, 503) with the rest dropped
        channel.requestFactory = CappedRequest
    for piece in pieces:
        if transport.disconnecting or "dataReceived" in vars(channel):
            break
        channel.dataReceived(piece)
    return _DATE.sub(b"", transport.value()), transport.disconnecting


_BODY = b'{"model": "m", "messages": []}'
INPUTS = {
    "GET": b"GET /r/v1/models?x=1 HTTP/1.1\r\nHost: h\r\nX-A: 1  \r\nX-A: two\r\nx-b:\t3\r\n\r\n",
    "POST": b"POST /r/v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY),
    "keep-alive": b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n" * 3,
    "pipelined with bodies": (b"POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\nabGET /b HTTP/1.1\r\n\r\n"
                              b"PUT /c HTTP/1.1\r\nContent-Length: 1\r\n\r\nz"),
    "HTTP/1.0": b"GET /a HTTP/1.0\r\nHost: h\r\n\r\nGET /dropped HTTP/1.0\r\n\r\n",
    "close": b"GET /a HTTP/1.1\r\nConnection: close\r\n\r\nGET /dropped HTTP/1.1\r\n\r\n",
    "HEAD": b"HEAD /a HTTP/1.1\r\nHost: h\r\n\r\n",
    "expect": b"POST /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok",
    "expect 1.0": b"POST /a HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok",
    "chunked": b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\nGET /b HTTP/1.1\r\n\r\n",
    "after chunked": b"GET /a HTTP/1.1\r\n\r\nPOST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    "lower-case method": b"get /a HTTP/1.1\r\n\r\n",
    "unknown method": b"GET /a HTTP/1.1\r\n\r\nBREW /pot HTTP/1.1\r\n\r\n",
    "two spaces": b"GET  /a HTTP/1.1\r\n\r\n",
    "HTTP/2.0": b"GET /a HTTP/2.0\r\n\r\n",
    "bare LF": b"GET /a HTTP/1.1\nHost: h\n\n",
    "empty line first": b"\r\nGET /a HTTP/1.1\r\n\r\n",
    "empty line after a body": b"POST /a HTTP/1.1\r\nContent-Length: 1\r\n\r\nx\r\nGET /b HTTP/1.1\r\n\r\n",
    "folded": b"GET /a HTTP/1.1\r\nX-A: 1\r\n 2\r\n\r\n",
    "control byte": b"GET /a HTTP/1.1\r\nX-A: 1\x01\r\n\r\n",
    "underscore framing": b"GET /a HTTP/1.1\r\nContent_Length: 1\r\n\r\n",
    "underscore other": b"GET /a HTTP/1.1\r\nX_Trace: 1\r\n\r\n",
    "two lengths": b"POST /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
    "length and chunked": b"POST /a HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "bad length": b"POST /a HTTP/1.1\r\nContent-Length: +1\r\n\r\nx",
    "bad name": b"GET /a HTTP/1.1\r\nX A: 1\r\n\r\n",
    "no colon": b"GET /a HTTP/1.1\r\nXA\r\n\r\n",
    "bad target": b"GET /a\x7f HTTP/1.1\r\n\r\n",
    "upgrade": b"GET /a HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\nGET /b HTTP/1.1\r\n\r\n",
    "long head": b"GET /a HTTP/1.1\r\n" + b"X-Long: %s\r\n" % (b"y" * 8000) * 2 + b"\r\n",
    "too long head": b"GET /a HTTP/1.1\r\n" + b"X-Long: %s\r\n" % (b"y" * 8000) * 3 + b"\r\n",
    "many headers": b"GET /a HTTP/1.1\r\n" + b"X: 1\r\n" * 501 + b"\r\n",
    "cookie": b"GET /a HTTP/1.1\r\nCookie: a=1; b=2\r\n\r\n",
    "absolute target": b"GET http://h/a?b HTTP/1.1\r\n\r\n",
}


class SameAnswersAsTwisted(TestCase):
    def test_whole(self) -> None:
        for what, data in INPUTS.items():
            self.assertEqual(_answer(H1ServerChannel, [data]), _answer(HeadDeadlineChannel, [data]), what)

    def test_byte_by_byte(self) -> None:
        for what, data in INPUTS.items():
            pieces = [data[i:i + 1] for i in range(len(data))]
            self.assertEqual(_answer(H1ServerChannel, pieces), _answer(HeadDeadlineChannel, [data]), what)

    def test_split_everywhere(self) -> None:
        for what in ("GET", "POST", "pipelined with bodies", "expect", "chunked", "unknown method", "folded"):
            data = INPUTS[what]
            expected = _answer(HeadDeadlineChannel, [data])
            for cut in range(1, len(data)):
                self.assertEqual(_answer(H1ServerChannel, [data[:cut], data[cut:]]), expected, (what, cut))

    def test_random_requests(self) -> None:
        """tests/test_fuzz.py's random requests (two on one connection), whole and cut
        in two at a random byte, with crossbar's capped requests."""
        cut_at = random.Random(7)

        @settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(cases)
        def same(case: Case) -> None:
            data = case.wire() * 2
            expected = _answer(HeadDeadlineChannel, [data], capped=True)
            cut = cut_at.randrange(1, len(data))
            self.assertEqual(_answer(H1ServerChannel, [data], capped=True), expected, data)
            self.assertEqual(_answer(H1ServerChannel, [data[:cut], data[cut:]], capped=True), expected, (data, cut))

        same()

    def test_the_answers_are_answers(self) -> None:
        """The comparison compares something: each input gets an answer or a 400/close."""
        answer, _ = _answer(H1ServerChannel, [INPUTS["pipelined with bodies"]])
        self.assertEqual(answer.count(b"HTTP/1.1 200 OK"), 3)
        self.assertIn(b"b'ab'", answer)
        answer, closed = _answer(H1ServerChannel, [INPUTS["folded"]])
        self.assertTrue(answer.startswith(b"HTTP/1.1 400"))
        self.assertTrue(closed)


class ParsedHere(TestCase):
    def test_plain_requests_are_parsed_by_llhttp(self) -> None:
        for what in ("GET", "POST", "keep-alive", "pipelined with bodies", "expect", "HEAD", "long head", "cookie"):
            channel, transport, _ = _connect(H1ServerChannel, _Echo())
            channel.dataReceived(INPUTS[what])
            self.assertIn(b"200 OK", transport.value(), what)
            self.assertEqual(channel.mode, HEAD, what)

    def test_others_are_handed_to_twisteds_parser(self) -> None:
        for what in ("chunked", "lower-case method", "folded", "too long head", "many headers", "empty line first"):
            channel, _, _ = _connect(H1ServerChannel, _Echo())
            channel.dataReceived(INPUTS[what])
            self.assertEqual(channel.mode, TWISTED, what)

    def test_fallback_leaves_every_byte_to_twisted(self) -> None:
        self.patch(twisted_fence, "FALLBACK", "an unchecked release (tests/test_h1server.py)")
        channel, transport, _ = _connect(H1ServerChannel, _Echo())
        self.assertEqual(channel.mode, TWISTED)
        channel.dataReceived(INPUTS["GET"])
        self.assertIn(b"200 OK", transport.value())

    def test_an_illegal_move_raises(self) -> None:
        channel, _, _ = _connect(H1ServerChannel, _Echo())
        with self.assertRaises(RuntimeError):
            channel._move(BODY)
            channel._move(HEAD)


class OneAtATime(TestCase):
    def test_pipelined_request_waits_for_the_answer_before_it(self) -> None:
        slow = _Slow()
        channel, transport, _ = _connect(H1ServerChannel, slow)
        channel.dataReceived(b"GET /1 HTTP/1.1\r\n\r\nGET /2 HTTP/1.1\r\n\r\n")
        self.assertEqual([r.uri for r in slow.pending], [b"/1"])
        self.assertEqual(channel.mode, ANSWERING)
        channel.dataReceived(b"GET /3 HTTP/1.1\r\n\r\n")
        slow.pending[0].write(b"one")
        slow.pending[0].finish()
        self.assertEqual([r.uri for r in slow.pending], [b"/1", b"/2"])
        slow.pending[1].finish()
        self.assertEqual([r.uri for r in slow.pending], [b"/1", b"/2", b"/3"])
        self.assertEqual(transport.value().count(b"HTTP/1.1 200 OK"), 2)

    def test_held_bytes_pause_the_client_beyond_16_kib(self) -> None:
        slow = _Slow()
        channel, transport, _ = _connect(H1ServerChannel, slow)
        channel.dataReceived(b"GET /1 HTTP/1.1\r\n\r\n")
        self.assertEqual(transport.producerState, "producing")
        channel.dataReceived(b"POST /2 HTTP/1.1\r\nContent-Length: 17000\r\n\r\n" + b"y" * 17000)
        self.assertEqual(transport.producerState, "paused")
        slow.pending[0].finish()
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(len(slow.pending), 2)

    def test_timeouts_are_off_while_answering(self) -> None:
        """Neither Twisted's idle timeout nor the head deadline cuts a long answer; the
        deadline runs again once it is done."""
        slow = _Slow()
        channel, transport, clock = _connect(H1ServerChannel, slow)
        channel.timeOut = 10
        channel.setTimeout(10)
        channel.dataReceived(b"GET /1 HTTP/1.1\r\n\r\n")
        clock.advance(HEAD_DEADLINE * 3)
        self.assertFalse(transport.disconnecting)
        slow.pending[0].finish()
        clock.advance(11)
        self.assertTrue(transport.disconnecting)

    def test_connection_lost_mid_answer_tells_the_request(self) -> None:
        slow = _Slow()
        channel, _, _ = _connect(H1ServerChannel, slow)
        channel.dataReceived(b"POST /1 HTTP/1.1\r\nContent-Length: 2\r\n\r\nab")
        gone = slow.pending[0].notifyFinish()
        failures: list[object] = []
        gone.addErrback(failures.append)
        channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(len(failures), 1)
