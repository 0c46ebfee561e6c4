"""A client that takes no byte of an answer crossbar holds for it is cut after
``timeouts.client_stall`` (docs/design.md §The proxy, rule 7; issue 20 item 3).

Unit tests: :class:`~crossbar.proxy.relay.Relay` on a :class:`Clock`, its client a real
Twisted ``Site``/``HTTPChannel``/``Request`` over a transport that buffers written bytes
the way Twisted's TCP transport does (``dataBuffer``/``offset``/``_tempDataLen``) and
pauses/resumes the channel past its buffer size / once drained; the test plays the
kernel taking bytes. Loopback: two raw sockets with a small ``SO_RCVBUF`` start streams
to a ``max_inflight: 2`` host and never read; after ``client_stall`` both slots are free
and another request is served, nothing marked down.
"""

from __future__ import annotations

import json
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import ensureDeferred
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH
from twisted.web.server import Request, Site

from crossbar.hosts.health import LifeSign
from crossbar.proxy.channel import HeadDeadlineChannel
from crossbar.proxy.relay import Relay, RelayEnd, RelayState
from tests.harness import FakeLlama, http_client, listen, start_crossbar, wait_for
from tests.logs import LogCapture
from tests.raw import connect_raw, post_bytes
from tests.upstreams import Firehose, host_status
from tests.fakes import HoldResource

IDLE = 120.0
STALL = 10.0




class BufferingTransport(StringTransport):
    """A client TCP connection as Twisted's ``FileDescriptor`` buffers it: written bytes
    wait (``_tempDataLen``) until the kernel takes them (:meth:`take`); past
    ``bufferSize`` waiting bytes it pauses the channel, drained it resumes it."""

    bufferSize = 1000

    def __init__(self) -> None:
        super().__init__()
        self.dataBuffer = b""
        self.offset = 0
        self._tempDataLen = 0
        self.protocol: Any = None
        self.paused = False

    def write(self, data: bytes) -> None:
        super().write(data)
        self._tempDataLen += len(data)
        if self._tempDataLen > self.bufferSize and not self.paused and self.protocol is not None:
            self.paused = True
            self.protocol.pauseProducing()

    def writeSequence(self, data: Any) -> None:
        self.write(b"".join(data))

    def take(self, n: int | None = None) -> None:
        """The client reads ``n`` bytes (None: all that wait)."""
        self._tempDataLen -= self._tempDataLen if n is None else min(n, self._tempDataLen)
        if self._tempDataLen == 0 and self.paused:
            self.paused = False
            self.protocol.resumeProducing()


class FakeResponse:
    """An upstream response whose body the test delivers."""

    length: Any = UNKNOWN_LENGTH

    def __init__(self) -> None:
        self.headers = Headers()
        self.transport = StringTransport()
        self.protocol: Any = None

    def deliverBody(self, protocol: Any) -> None:
        protocol.makeConnection(self.transport)
        self.protocol = protocol


class _RelayCase(SynchronousTestCase):
    """A client request on a :class:`BufferingTransport`, for a relay to answer."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.resource = HoldResource()
        site = Site(self.resource, reactor=Clock())
        site.protocol = HeadDeadlineChannel  # type: ignore[assignment]
        channel = site.buildProtocol(IPv4Address("TCP", "127.0.0.1", 5555))
        assert isinstance(channel, HeadDeadlineChannel)
        self.channel = channel
        self.client = BufferingTransport()
        self.client.protocol = channel
        channel.makeConnection(self.client)
        channel.dataReceived(b"GET /r/v1/x HTTP/1.1\r\nHost: crossbar\r\n\r\n")
        [self.request] = self.resource.requests
        self.client.take()  # nothing waits yet
        self.ends: list[RelayEnd] = []
        self.life = LifeSign()

    def tearDown(self) -> None:
        self.channel.connectionLost(Failure(ConnectionDone()))


class ClientStallTests(_RelayCase):
    def relay(self) -> tuple[Relay, FakeResponse]:
        relay = Relay(self.request, self.clock, IDLE, STALL, self.life, on_end=self.ends.append)
        response = FakeResponse()
        relay.start(response)  # type: ignore[arg-type]
        return relay, response

    def fill(self, response: FakeResponse) -> None:
        """The host sends more than the client's transport holds: the relay pauses."""
        response.protocol.dataReceived(b"x" * 2000)

    def test_a_client_that_never_reads_is_cut(self) -> None:
        relay, response = self.relay()
        self.fill(response)
        self.assertIs(relay.state, RelayState.PAUSED)
        self.clock.advance(STALL - 0.1)
        self.assertEqual(self.ends, [])
        self.clock.advance(0.1)
        self.assertEqual(self.ends, [RelayEnd.CLIENT_STALL])
        self.assertEqual(response.transport.producerState, "stopped")  # upstream cancelled
        self.assertIn("no byte within 10s", relay.reason)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_slow_client_that_keeps_reading_is_never_cut(self) -> None:
        """It takes a few bytes in every window (never enough for the transport to drain
        and resume us): not cut, however long; once it stops reading, cut."""
        relay, response = self.relay()
        self.fill(response)
        for _ in range(100):
            self.clock.advance(STALL / 2)
            self.client.take(5)
        self.assertEqual(self.ends, [])
        self.assertIs(relay.state, RelayState.PAUSED)
        self.clock.pump([1.0] * int(2 * STALL))  # it stopped reading: cut within two windows
        self.assertEqual(self.ends, [RelayEnd.CLIENT_STALL])

    def test_resume_starts_a_new_window(self) -> None:
        relay, response = self.relay()
        self.fill(response)
        self.clock.advance(STALL - 1)
        self.client.take()  # drained: Twisted resumes the producer
        self.assertIs(relay.state, RelayState.STREAMING)
        self.fill(response)  # full again at once
        self.clock.advance(STALL - 1)
        self.assertEqual(self.ends, [])
        self.clock.advance(1)
        self.assertEqual(self.ends, [RelayEnd.CLIENT_STALL])

    def test_bytes_held_without_a_pause_count_too(self) -> None:
        """A trickling host and a client that takes nothing: the bytes wait in the
        transport under its pause threshold; cut within two windows."""
        relay, response = self.relay()
        for _ in range(int(2 * STALL)):
            response.protocol.dataReceived(b"data: x\n\n")
            self.clock.advance(1)
        self.assertFalse(self.client.paused)  # never full: the bytes just wait
        self.assertEqual(self.ends, [RelayEnd.CLIENT_STALL])

    def test_a_client_that_takes_everything_is_never_cut(self) -> None:
        """A trickling host and a client that reads every byte: nothing is held."""
        relay, response = self.relay()
        for _ in range(int(20 * STALL)):
            response.protocol.dataReceived(b"data: x\n\n")
            self.client.take()
            self.clock.advance(1)
        self.assertEqual(self.ends, [])
        response.protocol.connectionLost(Failure(ConnectionDone()))

    def test_a_slow_host_is_no_client_stall(self) -> None:
        """No byte held for the client (the host is thinking): only the idle timeout runs."""
        relay, response = self.relay()
        self.clock.advance(IDLE - 1)
        self.assertEqual(self.ends, [])
        self.clock.advance(1)
        self.assertEqual(self.ends, [RelayEnd.IDLE_TIMEOUT])

    def test_a_transport_that_does_not_say_is_cut_after_a_whole_paused_window(self) -> None:
        """Without a buffer to read (another transport), a pause that lasts a whole window
        is a stall; a resume inside it is not."""
        relay, response = self.relay()
        del self.client.dataBuffer
        self.channel.pauseProducing()
        self.clock.advance(STALL - 1)
        self.channel.resumeProducing()
        self.channel.pauseProducing()
        self.clock.advance(STALL - 1)
        self.assertEqual(self.ends, [])
        self.clock.advance(1)
        self.assertEqual(self.ends, [RelayEnd.CLIENT_STALL])

    def test_body_chunks_are_signs_of_life(self) -> None:
        _, response = self.relay()
        self.clock.advance(3)
        response.protocol.dataReceived(b"data: x\n\n")
        self.assertEqual(self.life.at, 3.0)


def _config(host_url: str, stall: float) -> str:
    return (
        "health: {interval: 60, timeout: 5}\n"
        f"timeouts: {{client_stall: {stall}}}\n"
        "hosts:\n"
        f"  h: {{url: {host_url}, max_inflight: 2}}\n"
        "routes:\n"
        "  r:\n    hosts: [h]\n    queue: {max: 0}\n"
    )


class NeverReadingClientsTests(TestCase):
    def test_two_clients_that_never_read_free_their_slots(self) -> object:
        """Issue 20 item 3: two sockets that start streams and never read held a
        ``max_inflight: 2`` host full for ever; after ``client_stall`` both are cut, the
        host's slots are free, another request is served, nothing is marked down."""

        async def go() -> None:
            watch = LogCapture(self)
            upstream = FakeLlama(["m"])
            hoses: list[Firehose] = []

            def firehose(request: Request, body: bytes) -> Any:
                hose = Firehose(total=512 * 1024 * 1024)
                hoses.append(hose)
                return hose(request, body)

            upstream.handlers[b"/v1/embeddings"] = firehose
            service, base = await start_crossbar(self, _config(await listen(self, upstream), 2.0))
            await service.poller.when_first_round_done()
            body = json.dumps({"model": "m", "input": "x"}).encode()
            clients = [await connect_raw(self, base, post_bytes(b"/r/v1/embeddings", body, close=False), rcvbuf=4096)
                       for _ in range(2)]
            for c in clients:
                c.transport.pauseProducing()  # type: ignore[union-attr]  # never read
            await wait_for(lambda: len(hoses) == 2, 10, "both streams started")
            busy = await http_client(self).post(base + "/r/v1/chat/completions", json={"model": "m"})
            self.assertEqual(busy.code, 503)  # both slots held
            await treq.content(busy)
            await wait_for(lambda: all(h.pauses for h in hoses), 10, "both streams backed up to the host")
            await wait_for(lambda: all(h.closed.called for h in hoses), 10, "upstream requests cancelled")
            hosts = await host_status(self, base)
            self.assertEqual(hosts["h"]["inflight"], 0)
            self.assertTrue(hosts["h"]["healthy"])
            served = await http_client(self).post(base + "/r/v1/chat/completions", json={"model": "m"})
            self.assertEqual(served.code, 200)
            self.assertEqual((await treq.json_content(served))["object"], "chat.completion")
            lines = [e for e in watch.proxied() if e["path"] == "/v1/embeddings"]
            self.assertEqual(sorted(e["ended"] for e in lines), ["client_gone", "client_gone"])
            self.assertEqual(watch.errors(), [])
            await deferLater(reactor, 0)

        return ensureDeferred(go())


class DeliveredCompleteTests(_RelayCase):
    """What a client that leaves before the host's end has seen (rule 8): a complete
    answer (logged with its status) or not (499 client_gone)."""

    def complete(self, *chunks: bytes, length: Any = UNKNOWN_LENGTH) -> bool:
        """Whether a relay that wrote ``chunks`` of an answer of ``length`` says so."""
        relay = Relay(self.request, self.clock, IDLE, STALL)
        response = FakeResponse()
        response.length = length
        relay.start(response)  # type: ignore[arg-type]
        for chunk in chunks:
            response.protocol.dataReceived(chunk)
            self.client.take()
        try:
            return relay.delivered_complete()
        finally:
            relay.stop()
            self.request.unregisterProducer()

    def test_streams_ended_by_their_last_event(self) -> None:
        done = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
        anthropic = b'event: message_delta\ndata: {"type":"message_delta"}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n'
        responses = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
        for chunks in ((done,), (b"data: {}\n\n", b"data: [DONE]\n\n"), (anthropic,), (responses,)):
            self.assertTrue(self.complete(*chunks), chunks)

    def test_streams_cut_before_their_last_event(self) -> None:
        mid = b'data: {"choices": [{"delta": {"content": "event: message_stop"}}]}\n\n'
        for chunks in ((b"data: {}\n\n",), (mid,), (b'event: message_delta\ndata: {"type":"message_delta"}\n\n',), ()):
            self.assertFalse(self.complete(*chunks), chunks)

    def test_content_length(self) -> None:
        self.assertTrue(self.complete(b'{"a": 1}', length=8))
        self.assertFalse(self.complete(b'{"a": ', length=8))

    def test_figures_of_an_answer_seen_whole_survive_the_stop(self) -> None:
        """A client that left after ``[DONE]`` saw a complete answer: its tokens still count
        (the stop keeps the tail it would drop for a cut answer)."""
        usage = (b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, '
                 b'"total_tokens": 8}}\n\ndata: [DONE]\n\n')
        for chunks, counted in (((b"data: {}\n\n", usage), True), ((b"data: {}\n\n", usage[:40]), False)):
            relay = Relay(self.request, self.clock, IDLE, STALL, content_type=b"text/event-stream")
            response = FakeResponse()
            relay.start(response)  # type: ignore[arg-type]
            for chunk in chunks:
                response.protocol.dataReceived(chunk)
                self.client.take()
            relay.stop()
            figures = relay.figures(b"/v1/chat/completions")
            self.request.unregisterProducer()
            if counted:
                assert figures is not None
                self.assertEqual((figures.prompt + figures.cached, figures.generated), (5, 3))
            else:
                self.assertIsNone(figures)
