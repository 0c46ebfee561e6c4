"""Load clients for the benchmarks that need per-event receive times (asyncio + httptools).

Streams: each stream is its own connection sending one ``POST`` and reading an SSE
answer from ``bench/upstream.py`` (directly or through crossbar). Every socket read is
stamped with ``time.monotonic_ns()`` once, as it arrives; every SSE event completed by
that read gets that stamp as its receive time. An event's *lag* is its receive time
minus the send time the upstream wrote into it (``"t"``, same clock). An event is
*coalesced* when it completes in the same socket read as an earlier event: the client
could not see it separately, it waited for a later one.

The slow reader reads a byte stream ``chunk`` bytes at a time with a pause between
reads, for a fixed time, with a small receive buffer.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import httptools

__all__ = ["StreamResult", "StreamsResult", "run_streams", "slow_read"]


@dataclass
class StreamResult:
    """One stream: ``ttfe_ns`` from request written to first event received (ns),
    ``lags_ns`` per event (ns), ``events`` received, ``coalesced`` events, ``done``
    (the answer ended cleanly with every event), ``error`` (one line, or "")."""

    expected: int
    ttfe_ns: int | None = None
    lags_ns: list[int] = field(default_factory=list)
    events: int = 0
    coalesced: int = 0
    done: bool = False
    error: str = ""


@dataclass
class StreamsResult:
    """All streams of one run and the client's own CPU use (seconds of CPU per second
    of wall time, 1.0 = one core busy)."""

    streams: list[StreamResult]
    wall_s: float
    client_cpu: float

    @property
    def completed(self) -> int:
        return sum(1 for s in self.streams if s.done)

    @property
    def lags_ms(self) -> list[float]:
        return [lag / 1e6 for s in self.streams for lag in s.lags_ns]

    @property
    def ttfe_ms(self) -> list[float]:
        return [s.ttfe_ns / 1e6 for s in self.streams if s.ttfe_ns is not None]

    @property
    def coalesced_share(self) -> float:
        events = sum(s.events for s in self.streams)
        return sum(s.coalesced for s in self.streams) / events if events else 0.0


class _StreamClient(asyncio.Protocol):
    def __init__(self, request: bytes, result: StreamResult, finished: asyncio.Future[None]) -> None:
        self.request = request
        self.result = result
        self.finished = finished
        self.parser = httptools.HttpResponseParser(self)
        self.buf = b""
        self.sent_ns = 0
        self.now = 0
        self.in_read = 0
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sent_ns = time.monotonic_ns()
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.now = time.monotonic_ns()
        self.in_read = 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._finish(f"parse error: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(f"connection lost: {exc or 'closed'}")

    def on_status(self, status: bytes) -> None:
        code = self.parser.get_status_code()
        if code != 200:
            self.result.error = f"HTTP {code}"

    def on_body(self, body: bytes) -> None:
        buf = self.buf + body
        result = self.result
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            event, buf = buf[:end], buf[end + 2:]
            at = event.rfind(b'"t":')
            if at < 0:
                continue  # [DONE]
            sent = int(event[at + 4:event.index(b"}", at)])
            if result.ttfe_ns is None:
                result.ttfe_ns = self.now - self.sent_ns
            result.lags_ns.append(self.now - sent)
            result.events += 1
            if self.in_read:
                result.coalesced += 1
            self.in_read += 1
        self.buf = buf

    def on_message_complete(self) -> None:
        self.result.done = self.result.events == self.result.expected and not self.result.error
        if not self.result.done and not self.result.error:
            self.result.error = f"{self.result.events}/{self.result.expected} events"
        self._finish("")
        self.transport.close()

    def _finish(self, error: str) -> None:
        if not self.finished.done():
            if error and not self.result.error:
                self.result.error = error
            self.finished.set_result(None)


async def _one_stream(host: str, port: int, request: bytes, expected: int, timeout: float) -> StreamResult:
    loop = asyncio.get_running_loop()
    result = StreamResult(expected)
    finished: asyncio.Future[None] = loop.create_future()
    transport = None
    try:
        transport, _ = await asyncio.wait_for(
            loop.create_connection(lambda: _StreamClient(request, result, finished), host, port), timeout
        )
        await asyncio.wait_for(finished, timeout)
    except (OSError, asyncio.TimeoutError) as e:
        result.error = result.error or f"{type(e).__name__}: {e}"
    finally:
        if transport is not None:
            transport.close()
    return result


async def run_streams(
    host: str, port: int, prefix: str, streams: int, events: int, delay_ms: float, timeout: float
) -> StreamsResult:
    """Open ``streams`` concurrent SSE streams of ``events`` events ``delay_ms`` apart
    through ``http://host:port{prefix}/v1/chat/completions`` and wait for all of them
    (each gives up after ``timeout`` seconds)."""
    # the query for crossbar and direct, the same in the body for the gateways that drop
    # the query string (smg, vllm-router forward the body's unknown fields)
    body = (b'{"model":"bench","stream":true,"bench_n":%d,"bench_d":%s,'
            b'"messages":[{"role":"user","content":"hi"}]}' % (events, f"{delay_ms:g}".encode()))
    request = (
        f"POST {prefix}/v1/chat/completions?stream=1&n={events}&d={delay_ms:g} HTTP/1.1\r\n"
        f"Host: {host}:{port}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    cpu0, wall0 = time.process_time(), time.monotonic()
    results = await asyncio.gather(*(_one_stream(host, port, request, events, timeout) for _ in range(streams)))
    wall = time.monotonic() - wall0
    return StreamsResult(list(results), wall, (time.process_time() - cpu0) / wall)


async def slow_read(host: str, port: int, path: str, chunk: int, pause: float, duration: float,
                    body: bytes | None = None) -> int:
    """Read ``GET path`` (``POST`` of the JSON ``body`` when given) ``chunk`` bytes every
    ``pause`` seconds for ``duration`` seconds with a 64 KiB receive buffer, then close.
    Returns the bytes read."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setblocking(False)
    got = 0
    try:
        await loop.sock_connect(sock, (host, port))
        if body is None:
            head = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
        else:
            head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        await loop.sock_sendall(sock, head.encode() + (body or b""))
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            data = await asyncio.wait_for(loop.sock_recv(sock, chunk), duration)
            if not data:
                break
            got += len(data)
            await asyncio.sleep(pause)
    finally:
        sock.close()
    return got
