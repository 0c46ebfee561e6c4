"""Streaming through crossbar on real loopback sockets (docs/design.md §The proxy rule 6,
§Quality bar): each chunk reaches the client before the next is sent, no extra
coalescing against a direct connection, backpressure from a slow client bounds what
crossbar holds, and the idle timeout does not run while the client is the slow side.
"""

from __future__ import annotations

import json
import re
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.task import LoopingCall, deferLater
from twisted.trial.unittest import TestCase

from crossbar.proxy.relay import RelayState
from tests.harness import FakeLlama, listen, start_routes, wait_for
from tests.raw import RawClient, connect_raw, post_bytes, request_bytes
from tests.upstreams import Firehose, RawFirehose, host_status, serve_raw

_STREAM_BODY = json.dumps({"model": "tiny-a", "stream": True, "messages": []}).encode()
_INDEX = re.compile(rb'"i": (\d+)')


def _events(client: RawClient) -> list[dict[str, Any]]:
    """The SSE chunks of a raw response (parsed from the de-chunked body)."""
    response = client.response()
    assert response is not None
    out = []
    for line in response.body.split(b"\n\n"):
        if line.startswith(b"data: {"):
            out.append(json.loads(line[len(b"data: "):]))
    return out


def _arrivals(client: RawClient) -> dict[int, float]:
    """Event index -> the time the read that completed it arrived."""
    seen: dict[int, float] = {}
    buffer = b""
    for at, data in client.reads:
        buffer += data
        for match in _INDEX.finditer(buffer):
            seen.setdefault(int(match.group(1)), at)
    return seen


def _multi_event_reads(client: RawClient) -> int:
    """How many reads carried more than one event."""
    return sum(1 for _, data in client.reads if len(_INDEX.findall(data)) > 1)


def _userland_buffer(transport: Any) -> int:
    """Bytes a Twisted TCP transport holds in user space, waiting to be sent."""
    return len(transport.dataBuffer) - transport.offset + transport._tempDataLen  # type: ignore[no-any-return]


class StreamingTests(TestCase):
    def test_each_event_arrives_before_the_next_is_sent(self) -> object:
        """Events 200 ms apart: each reaches a raw socket client before the upstream
        sends the next; inflight is 1 during the stream and 0 after it."""

        async def go() -> None:
            upstream = FakeLlama()
            upstream.events = 5
            upstream.event_delay = 0.2
            service, base = await start_routes(self, {"a": await listen(self, upstream)})
            client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", _STREAM_BODY))
            await client.wait_for(b'"i": 0')
            self.assertEqual((await host_status(self, base))["a"]["inflight"], 1)
            await client.closed
            response = client.response()
            assert response is not None
            self.assertEqual(response.status, 200)
            self.assertTrue(response.complete)
            self.assertEqual(response.one(b"x-crossbar-host"), b"a")
            self.assertEqual(response.one(b"content-type"), b"text/event-stream")
            events = _events(client)
            self.assertEqual([e["i"] for e in events], list(range(5)))
            arrivals = _arrivals(client)
            for i in range(4):
                self.assertLess(arrivals[i], events[i + 1]["sent"], f"event {i} arrived after event {i + 1} was sent")
            self.assertEqual((await host_status(self, base))["a"]["inflight"], 0)

        return ensureDeferred(go())

    def test_no_coalescing_beyond_a_direct_connection(self) -> object:
        """200 events 5 ms apart, read side by side directly and through crossbar: the
        proxied stream has no more multi-event reads than the direct one, within a small
        tolerance (crossbar writes each chunk as it arrives)."""

        async def go() -> None:
            upstream = FakeLlama()
            upstream.events = 200
            upstream.event_delay = 0.005
            url = await listen(self, upstream)
            _, base = await start_routes(self, {"a": url})
            direct = await connect_raw(self, url, post_bytes(b"/v1/chat/completions", _STREAM_BODY))
            proxied = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", _STREAM_BODY))
            await direct.closed
            await proxied.closed
            self.assertEqual(len(_events(direct)), 200)
            self.assertEqual(len(_events(proxied)), 200)
            direct_multi, proxied_multi = _multi_event_reads(direct), _multi_event_reads(proxied)
            self.assertLessEqual(
                proxied_multi, direct_multi + 10,
                f"reads with >1 event: direct {direct_multi}, through crossbar {proxied_multi} (of 200 events)",
            )

        return ensureDeferred(go())

    def test_slow_client_backpressure_and_no_idle_timeout(self) -> object:
        """An upstream that can send 50 MB as fast as possible, a client with a small
        receive buffer that reads a little at a time and then stops reading for 3x
        ``timeouts.idle``: crossbar pauses its upstream reads, holds under 1 MiB, the
        idle timeout does not fire, and the whole answer arrives afterwards."""

        async def go() -> None:
            total = 50 * 1024 * 1024
            firehose = Firehose(total)
            upstream = FakeLlama()
            upstream.handlers[b"/v1/big"] = firehose
            service, base = await start_routes(self, {"a": await listen(self, upstream)}, timeouts="{idle: 0.5}")
            runtime = service.runtime
            samples = {"held": 0, "ahead": 0, "stream_paused": 0}

            def sample() -> None:
                for exchange in list(runtime.active):
                    channel = exchange.request.channel
                    if channel is None or channel.transport is None:
                        continue
                    samples["held"] = max(samples["held"], _userland_buffer(channel.transport))
                    if exchange.relay is not None and exchange.relay.state is RelayState.PAUSED:
                        samples["stream_paused"] += 1
                samples["ahead"] = max(samples["ahead"], firehose.written - client.received)

            client = await connect_raw(
                self, base, request_bytes(b"GET", b"/r/v1/big"), rcvbuf=16 * 1024, keep_reads=False
            )
            sampler = LoopingCall(sample)
            sampler.start(0.005)
            self.addCleanup(lambda: sampler.running and sampler.stop())

            mode = {"reading": "slow"}

            def nap_over() -> None:
                if mode["reading"] == "slow":
                    client.transport.resumeProducing()  # type: ignore[union-attr]

            def slow(c: RawClient) -> None:  # one small read, then a 20 ms nap
                c.transport.pauseProducing()  # type: ignore[union-attr]
                reactor.callLater(0.02, nap_over)  # type: ignore[attr-defined]

            client.after_read = slow
            await deferLater(reactor, 1.5)
            mode["reading"] = "stopped"
            client.after_read = None
            client.transport.pauseProducing()  # type: ignore[union-attr]
            before = client.received
            await deferLater(reactor, 1.5)  # 3x timeouts.idle without reading a byte
            self.assertEqual(client.received, before)
            self.assertEqual(len(runtime.active), 1, "the stream ended while the client was paused")
            self.assertLess(client.received, total // 2)
            client.transport.resumeProducing()  # type: ignore[union-attr]
            await client.closed
            sampler.stop()

            response = client.response()
            assert response is not None
            self.assertEqual(response.status, 200)
            self.assertTrue(response.complete, "the answer was cut off")
            self.assertEqual(len(response.body), total)
            self.assertGreater(firehose.pauses, 0, "the upstream never had to wait for crossbar")
            self.assertGreater(samples["stream_paused"], 0, "crossbar never paused its upstream reads")
            self.assertLess(samples["held"], 1024 * 1024, f"crossbar held {samples['held']} bytes for the client")
            # Kernel socket buffers on the way add to this, but it stays far below the answer.
            self.assertLess(samples["ahead"], 16 * 1024 * 1024, f"upstream got {samples['ahead']} bytes ahead")
            status = (await host_status(self, base))["a"]
            self.assertTrue(status["healthy"])
            self.assertEqual(status["last_err"], "")
            self.assertEqual(status["inflight"], 0)
            print(f"backpressure: held max {samples['held']} B, upstream ahead max {samples['ahead']} B, upstream pauses {firehose.pauses}")

        return ensureDeferred(go())

    def test_client_that_never_reads(self) -> object:
        """A client that reads nothing after its request, an upstream whose head and
        first 64 KiB of body arrive in one read and which then sends 50 MB as fast as
        it can: crossbar's first writes fill its buffer, its upstream reads pause and
        stay paused, it holds under 1 MiB; the client's leaving closes the upstream."""

        async def go() -> None:
            firehose = RawFirehose(50 * 1024 * 1024)
            url = await serve_raw(self, firehose)
            service, base = await start_routes(self, {"a": url})
            client = await connect_raw(self, base, request_bytes(b"GET", b"/r/v1/big"), rcvbuf=4096)
            client.transport.pauseProducing()  # type: ignore[union-attr]
            await wait_for(lambda: firehose.started)
            await deferLater(reactor, 1.0)
            held = [_userland_buffer(e.request.channel.transport) for e in service.runtime.active]
            self.assertEqual(len(held), 1)
            self.assertLess(held[0], 1024 * 1024, f"crossbar held {held[0]} bytes for a client that reads nothing")
            self.assertLess(firehose.written, 32 * 1024 * 1024)
            client.transport.abortConnection()  # type: ignore[union-attr]
            await firehose.closed
            await wait_for(lambda: not service.runtime.active, 1.0)

        return ensureDeferred(go())
