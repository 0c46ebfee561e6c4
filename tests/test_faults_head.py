"""Issue 11 item 1: the response head reaches the client as soon as it comes from the
host, before any body byte (docs/design.md §Quality bar), and a host that then goes silent
leaves the client a 200 and a truncated body, and is marked down (rule 7).

The host is a raw socket (:class:`tests.upstreams.RawHost`) so the head and the first
event leave it at times the test chooses; the client is a raw socket
(:class:`tests.raw.RawClient`) that records when each read arrived.
"""

from __future__ import annotations

import time

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

from tests.harness import sse_event, start_routes, wait_for
from tests.raw import connect_raw, post_bytes
from tests.upstreams import RawHost, RawHostProtocol, host_status, serve_raw

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT_DELAY = 1.0
"""Seconds between the head and the first event (a long prompt being processed)."""


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


class _Script:
    """Sends :data:`HEAD` at once; then, unless ``silent``, one event after
    :data:`EVENT_DELAY` s and the end of the body. Records when the head was sent."""

    def __init__(self, silent: bool = False) -> None:
        self.silent = silent
        self.head_sent: float | None = None

    def __call__(self, proto: RawHostProtocol) -> None:
        proto.write(HEAD)
        self.head_sent = time.time()
        if not self.silent:
            reactor.callLater(EVENT_DELAY, self._rest, proto)

    def _rest(self, proto: RawHostProtocol) -> None:
        if proto.transport is not None and not proto.closed.called:
            proto.write(_chunk(sse_event(0)) + b"0\r\n\r\n")


def _arrival(reads: list[tuple[float, bytes]], marker: bytes) -> tuple[float, bytes]:
    """When the client first had ``marker``, and everything it had then."""
    seen = b""
    for at, data in reads:
        seen += data
        if marker in seen:
            return at, seen
    raise AssertionError(f"no {marker!r} in {seen!r}")


class HeadBeforeBodyTests(TestCase):
    timeout = 30

    def test_head_arrives_before_the_first_event(self) -> object:
        async def go() -> None:
            script = _Script()
            host = RawHost(script)
            _, base = await start_routes(self, {"a": await serve_raw(self, host)})
            client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", b'{"stream": true}'))
            await client.wait_for(b"0\r\n\r\n")  # the whole answer, event included
            assert script.head_sent is not None
            head_at, so_far = _arrival(client.reads, b"\r\n\r\n")
            # half the event's delay either side (a head that waited would come with the
            # event; a loaded machine delays either arrival by a few hundred ms)
            self.assertLess(head_at - script.head_sent, EVENT_DELAY / 2, "the head waited for the body")
            self.assertTrue(so_far.startswith(b"HTTP/1.1 200 "), so_far)
            self.assertNotIn(b"tok0", so_far, "the head came with the first event")
            event_at, _ = _arrival(client.reads, b"tok0")
            self.assertGreater(event_at - head_at, EVENT_DELAY / 2)
            response = client.response()
            assert response is not None
            self.assertTrue(response.complete)
            self.assertIn(b"tok0", response.body)

        return ensureDeferred(go())

    def test_silent_host_leaves_a_200_and_a_truncated_body(self) -> object:
        """The head went out; the host then sends nothing for ``timeouts.idle``: the
        client has the 200 and a body without its terminating chunk, and the host is
        down with the idle timeout as its last error."""

        async def go() -> None:
            host = RawHost(_Script(silent=True))
            _, base = await start_routes(self, {"a": await serve_raw(self, host)}, timeouts="{idle: 1}")
            client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", b'{"stream": true}'))
            started = reactor.seconds()
            await client.wait_for(b"\r\n\r\n")
            self.assertLess(reactor.seconds() - started, 0.8, "the head waited for the body")  # (the cut: 1 s)
            await client.closed
            self.assertGreater(reactor.seconds() - started, 0.9, "cut before timeouts.idle")
            response = client.response()
            assert response is not None
            self.assertEqual(response.status, 200)
            self.assertTrue(response.chunked)
            self.assertFalse(response.complete, "a clean end for an answer the host never finished")
            self.assertFalse(client.data.endswith(b"0\r\n\r\n"))

            async def down() -> dict[str, object]:
                status: dict[str, object] = (await host_status(self, base))["a"]
                return status if not status["healthy"] else {}

            status = await wait_for(down, 3.0, "host a marked down")
            self.assertIn("no body byte within 1s", str(status["last_err"]))

        return ensureDeferred(go())
