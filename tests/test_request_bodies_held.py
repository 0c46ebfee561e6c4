"""Request bodies held in memory (issue 20 items 1 and 2; docs/design.md §The proxy, rule 9):
a body costs at most 1.25 times its size whatever its framing, framing that is mostly
overhead is refused early, a body is released the moment its request ends or its client
leaves, and all held bodies together stay under a budget (503 with ``Retry-After``).

Memory is measured, not timed: ``sys.getsizeof`` of what the request holds, and the
number of chunks the reactor parsed. Twisted's real ``HTTPChannel`` (crossbar's
:class:`~crossbar.proxy.channel.HeadDeadlineChannel`) parses the bytes, on a
``StringTransport``; one test runs crossbar end to end on loopback.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from crossbar.proxy import request as request_module
from crossbar.proxy.channel import HeadDeadlineChannel
from crossbar.proxy.request import CappedRequest
from tests.fakes import HoldResource


class _Counting(CappedRequest):
    made: list["_Counting"] = []
    chunks_parsed = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Counting.made.append(self)

    def handleContentChunk(self, data: bytes) -> None:
        _Counting.chunks_parsed += 1
        super().handleContentChunk(data)


def _channel(resource: Resource, clock: Clock | None = None) -> tuple[HeadDeadlineChannel, StringTransport]:
    site = Site(resource, requestFactory=_Counting, reactor=clock or Clock())
    site.protocol = HeadDeadlineChannel  # type: ignore[assignment]
    channel = site.buildProtocol(None)
    assert isinstance(channel, HeadDeadlineChannel)
    transport = StringTransport()
    channel.makeConnection(transport)
    return channel, transport


def reactor_turn(channel: HeadDeadlineChannel) -> None:
    """Run the channel's next slice as the reactor would on its next turn (a Clock's
    ``advance(0)`` would run every slice scheduled meanwhile in one go)."""
    call = channel._slice_call
    assert call is not None
    call.cancel()
    channel._next_slice()


def held_bytes(request: CappedRequest) -> int:
    """The memory the request's body takes, in bytes (objects and the list)."""
    return sys.getsizeof(request.body_chunks) + sum(sys.getsizeof(c) for c in request.body_chunks) + sys.getsizeof(
        getattr(request, "_tail", b""))


class _NoBudget:
    held = 0
    limit = 0


class _Case(TestCase):
    def setUp(self) -> None:
        _Counting.made = []
        _Counting.chunks_parsed = 0
        budget_class = getattr(request_module, "BodyBudget", None)  # (before issue 20: none)
        self.budget = budget_class(limit=4 * 1024 * 1024) if budget_class else _NoBudget()
        if budget_class:
            self.patch(CappedRequest, "budget", self.budget)


class FramingTests(_Case):
    def test_tiny_reads_cost_at_most_one_and_a_quarter_the_body(self) -> None:
        """Item 2: a body that arrives a byte at a time (here 200 KB of Content-Length
        body in 1-byte reads) was held as 200,000 ``bytes`` objects, ~40 times its size."""
        hold = HoldResource()
        channel, _ = _channel(hold)
        size = 200_000
        channel.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
        body = b'{"model": "m", "prompt": "' + b"x" * (size - 29) + b'"}\n'
        assert len(body) == size
        for i in range(size):
            channel.dataReceived(body[i:i + 1])
        [request] = hold.requests
        assert isinstance(request, CappedRequest)
        self.assertEqual(b"".join(request.body_chunks), body)
        self.assertLessEqual(held_bytes(request), 1.25 * size)
        self.assertEqual(request.peeked.model, "m")  # the peek saw it all

    def test_chunks_of_honest_sizes_cost_at_most_one_and_a_quarter(self) -> None:
        hold = HoldResource()
        channel, _ = _channel(hold)
        channel.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"y" * 300
        wire = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(3000)) + b"0\r\n\r\n"
        for i in range(0, len(wire), 1400):
            channel.dataReceived(wire[i:i + 1400])
        [request] = hold.requests
        assert isinstance(request, CappedRequest)
        self.assertEqual(b"".join(request.body_chunks), piece * 3000)
        self.assertLessEqual(held_bytes(request), 1.25 * len(piece) * 3000)

    def test_one_byte_chunks_are_refused_early(self) -> None:
        """Item 2: 16 million 1-byte chunks (92 MiB on the wire, 15 MiB decoded) were
        all parsed and held. Framing that is mostly overhead is a 400 after a bounded
        number of chunks, and what follows is dropped unparsed."""
        hold = HoldResource()
        clock = Clock()
        channel, transport = _channel(hold, clock)
        channel.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        block = b"1\r\nx\r\n" * 10_000  # 60 KB on the wire, 10 KB decoded
        per_turn = []
        for _ in range(50):  # each read, then the reactor turns that follow it
            before = _Counting.chunks_parsed
            channel.dataReceived(block)
            per_turn.append(_Counting.chunks_parsed - before)
            while channel._slice_call is not None:
                before = _Counting.chunks_parsed
                reactor_turn(channel)
                per_turn.append(_Counting.chunks_parsed - before)
        # No reactor turn parsed more than one 2 KiB slice of framing (~340 chunks of
        # 6 bytes): 10,000 chunks in one turn held the reactor for 50-100 ms.
        self.assertLessEqual(max(per_turn), 2048 // 6 + 1)
        head, _, body = transport.value().partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 400 "), head)
        self.assertEqual(json.loads(body), {"error": {"code": 400, "message": "chunk framing too small", "type": "invalid_request_error"}})
        self.assertEqual(hold.requests, [])
        # The reactor parsed at most a slice past the limit, not 500,000 chunks.
        self.assertLessEqual(_Counting.chunks_parsed, 1024 + 2048 // 6 + 1)
        [request] = _Counting.made
        self.assertEqual(request.body_chunks, [])
        self.assertEqual(self.budget.held, 0)

    def test_dense_framing_is_parsed_whole_over_several_turns(self) -> None:
        """Chunks of 100 bytes (under the refusal bound's average, dense with framing)
        are fed in slices, one per reactor turn, and the body arrives whole, in order,
        with a pipelined request after it served too."""
        hold = HoldResource()
        clock = Clock()
        channel, _ = _channel(hold, clock)
        pieces = [bytes([65 + i % 26]) * 100 for i in range(2000)]
        wire = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        head = b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        data = head + wire + b"GET /r/v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
        for i in range(0, len(data), 65536):
            channel.dataReceived(data[i:i + 65536])
        turns = 0
        while channel._slice_call is not None and not hold.requests:
            reactor_turn(channel)
            turns += 1
        self.assertGreater(turns, 10)
        [request] = hold.requests
        assert isinstance(request, CappedRequest)
        self.assertEqual(b"".join(request.body_chunks), b"".join(pieces))
        request.write(b"ok")
        request.finish()
        self.assertEqual(len(hold.requests), 2)
        self.assertEqual(hold.requests[1].uri, b"/r/v1/models")


class ReleaseTests(_Case):
    def test_client_leaving_mid_body_releases_it_at_once(self) -> None:
        """Item 1: a client that sent most of a body and left kept it held for minutes
        (the request and its channel form a cycle only the garbage collector frees)."""
        channel, _ = _channel(HoldResource())
        channel.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n")
        for _ in range(40):
            channel.dataReceived(b"z" * 65536)
        [request] = _Counting.made
        self.assertGreater(sum(map(len, request.body_chunks)), 2_000_000)
        self.assertGreater(self.budget.held, 2_000_000)
        channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(request.body_chunks, [])
        self.assertEqual(self.budget.held, 0)

    def test_finished_request_releases_its_body(self) -> None:
        hold = HoldResource()
        channel, _ = _channel(hold)
        channel.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n" + b"q" * 200000)
        [request] = hold.requests
        assert isinstance(request, CappedRequest)
        kept = request.body_chunks  # what an exchange holds for a failover
        self.assertEqual(self.budget.held, 200000)
        request.write(b"ok")
        request.finish()
        self.assertEqual((kept, self.budget.held), ([], 0))

    def test_bodies_together_stay_under_the_budget(self) -> None:
        """Item 1: all held bodies together are bounded; beyond it a 503 JSON with
        ``Retry-After``, on ``Content-Length`` before the body or as a chunked body
        grows; the budget comes back as requests end."""
        hold = HoldResource()
        first, _ = _channel(hold)
        first.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n" + b"a" * 3000000)
        self.assertEqual(self.budget.held, 3000000)
        second, transport = _channel(hold)
        second.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n")
        third, chunked = _channel(hold)
        third.dataReceived(b"POST /r/v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(40):
            third.dataReceived(b"10000\r\n" + b"c" * 65536 + b"\r\n")
        for answer in (transport.value(), chunked.value()):
            head, _, body = answer.partition(b"\r\n\r\n")
            self.assertTrue(head.startswith(b"HTTP/1.1 503 "), head)
            self.assertIn(b"Retry-After: 1", head.split(b"\r\n"))
            self.assertEqual(json.loads(body), {"error": {"code": 503, "message": "too many request bodies held", "type": "unavailable_error"}})
        self.assertLessEqual(self.budget.held, self.budget.limit)
        self.assertEqual(self.budget.held, 3000000)
        first.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.budget.held, 0)


class EndToEndTests(TestCase):
    """Item 1 through a real crossbar on loopback, raw sockets as clients."""

    async def test_aborted_upload_is_released_and_the_budget_holds(self) -> None:
        from tests.harness import FakeLlama, listen, port_of, start_crossbar, upstream_requests, wait_for
        from tests.logs import LogCapture
        from tests.raw import connect_raw, parse_responses, post_bytes, raw_exchange

        budget = request_module.BodyBudget(limit=20 << 20)
        self.patch(CappedRequest, "budget", budget)
        watch = LogCapture(self)
        host = FakeLlama(["m"])
        url = await listen(self, host)
        service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 5}}
hosts: {{a: {url}}}
routes: {{r: {{hosts: [a], default_model: m}}}}
""")
        await service.poller.when_first_round_done()
        port = port_of(base)
        # Most of a 15 MiB body (the budget: 20 MiB), the client still there...
        big = await connect_raw(
            self, base, b"POST /r/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (15 << 20),
            b"x" * (12 << 20))
        await wait_for(lambda: budget.held == 12 << 20, what="12 MiB held")
        # ...so another 9 MiB body would go over the budget: 503 + Retry-After at once.
        body = b'{"model": "m", "messages": [], "pad": "' + b"p" * (9 << 20) + b'"}'
        data, _ = await raw_exchange(port, post_bytes(b"/r/v1/chat/completions", body), timeout=10)
        [answer] = parse_responses(data)
        self.assertEqual((answer.status, json.loads(answer.body)), (503, {"error": {"code": 503, "message": "too many request bodies held", "type": "unavailable_error"}}))
        self.assertEqual(answer.one(b"retry-after"), b"1")
        # The client leaves: its body is released at once, not when a GC finds it.
        big.transport.abortConnection()  # type: ignore[union-attr]
        await wait_for(lambda: budget.held == 0, what="the aborted body released")
        data, _ = await raw_exchange(port, post_bytes(b"/r/v1/chat/completions", body), timeout=10)
        self.assertEqual(parse_responses(data)[0].status, 200)
        self.assertEqual(budget.held, 0)  # released when the answer finished
        self.assertEqual(len(upstream_requests(host)), 1)
        self.assertIn(503, [e["status"] for e in watch.proxied()])
