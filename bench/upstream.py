"""A fast loopback upstream for the benchmarks: llama-server's shapes, nothing else.

One process, asyncio on uvloop (when installed) with httptools parsing requests, so that
it costs far less per request and per event than crossbar does and is never what a
benchmark measures. It serves:

- ``GET /health`` -> ``{"status":"ok"}``;
- ``GET /v1/models`` -> one model, ``bench``;
- ``POST /v1/chat/completions`` -> a small JSON chat completion (about 300 bytes);
- ``POST /v1/chat/completions?stream=1&n=N&d=D`` -> an SSE stream (chunked) of ``N``
  events, the first at once and then one every ``D`` milliseconds on an absolute
  schedule (no drift); each event is its own chunk and carries ``"t"``, its send time
  in integer nanoseconds of ``time.monotonic_ns()`` (CLOCK_MONOTONIC, comparable across
  processes on one Linux machine), and ``"i"``, its index. The same when the JSON body
  says ``"stream":true`` with ``"bench_n": N`` and ``"bench_d": D`` (the LLM gateways
  smg and vllm-router forward the body but drop the query string);
- ``POST /v1/chat/completions`` whose body says ``"stream":true`` and
  ``"bench_bytes": B`` -> an SSE stream of about ``B`` bytes in 16 KiB events, as fast
  as the connection takes them (with backpressure, like ``/v1/blob``): the slow client
  (d) through a path every gateway forwards;
- ``GET /v1/blob?size=BYTES`` -> ``BYTES`` of ``application/octet-stream`` in 64 KiB
  chunks as fast as the connection takes them, honouring backpressure (it stops
  writing while the kernel buffer is full, so a slow reader holds nothing here).

Run: ``python bench/upstream.py --port 18080`` (prints ``ready <port>`` once listening).
Keep-alive is supported; the request body is read (its first 64 KiB looked at for
``"stream":true``) and discarded. Other paths (the gateways' probes: ``/version``,
``/server_info``, ``/loads``, ``/metrics``...) answer 404, which they accept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from typing import Any
from urllib.parse import parse_qs

import httptools

__all__ = ["UpstreamProtocol", "serve", "main"]

_HEALTH = b'{"status":"ok"}'
_MODELS = b'{"object":"list","data":[{"id":"bench","object":"model","owned_by":"bench"}]}'
_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "Hello! This is a benchmark answer."}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 8, "total_tokens": 17},
    },
    separators=(",", ":"),
).encode()
_BLOB_CHUNK = 64 * 1024
_BLOB = b"x" * _BLOB_CHUNK


def _fixed(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )


_R_HEALTH = _fixed(b"200 OK", _HEALTH)
_R_MODELS = _fixed(b"200 OK", _MODELS)
_R_COMPLETION = _fixed(b"200 OK", _COMPLETION)
_R_NOT_FOUND = _fixed(b"404 Not Found", b'{"error":"not found"}')
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_EVENT_HEAD = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" tok"}}],"i":'
_DONE = b"data: [DONE]\n\n"
_BULK_EVENT = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"' + b"x" * 16_300 + b'"}}]}\n\n'
_BODY_PEEK = 64 * 1024


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class UpstreamProtocol(asyncio.Protocol):
    """One client connection: parse requests with httptools, answer from prebuilt bytes."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body = b""
        self.paused = False
        self.busy = False  # a streaming answer is being written
        self.blob_left = 0
        self.blob_chunk = _BLOB  # what _blob_more writes: raw bytes or one SSE chunk
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.blob_left = 0

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.blob_left:
            self._blob_more()

    # -- httptools callbacks --------------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        if len(self.body) < _BODY_PEEK:
            self.body += body[:_BODY_PEEK]

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        body, self.body = self.body, b""
        path, _, query = url.partition(b"?")
        if path == b"/v1/chat/completions":
            if b'"stream":true' in body or b'"stream": true' in body:
                try:
                    req = json.loads(body)
                except ValueError:
                    req = {}
                if req.get("bench_bytes"):
                    return self._bulk(int(req["bench_bytes"]))
                if "bench_n" in req:
                    return self._stream(int(req["bench_n"]), float(req.get("bench_d", 0)) / 1000.0)
            if query:
                q = parse_qs(query.decode())
                if q.get("stream", ["0"])[0] == "1":
                    n = int(q.get("n", ["10"])[0])
                    delay = float(q.get("d", ["0"])[0]) / 1000.0
                    return self._stream(n, delay)
            self.transport.write(_R_COMPLETION)
        elif path == b"/health":
            self.transport.write(_R_HEALTH)
        elif path == b"/v1/models":
            self.transport.write(_R_MODELS)
        elif path == b"/v1/blob":
            size = int(parse_qs(query.decode()).get("size", ["0"])[0])
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: "
                + str(size).encode() + b"\r\n\r\n"
            )
            self.blob_chunk = _BLOB
            self.blob_left = size
            self._blob_more()
        else:
            self.transport.write(_R_NOT_FOUND)

    # -- answers ------------------------------------------------------------------------

    def _stream(self, n: int, delay: float) -> None:
        loop = asyncio.get_running_loop()
        self.transport.write(_STREAM_HEAD)
        start = loop.time()
        state = {"i": 0}

        def send() -> None:
            self.timer = None
            if self.transport.is_closing():
                return
            i = state["i"]
            event = _EVENT_HEAD + b"%d,\"t\":%d}\n\n" % (i, time.monotonic_ns())
            if i + 1 >= n:
                self.transport.write(_chunk(event) + _chunk(_DONE) + b"0\r\n\r\n")
                return
            self.transport.write(_chunk(event))
            state["i"] = i + 1
            self.timer = loop.call_at(start + (i + 1) * delay, send)

        send()

    def _bulk(self, size: int) -> None:
        """About ``size`` bytes of SSE (whole 16 KiB events), then ``[DONE]``."""
        self.transport.write(_STREAM_HEAD)
        self.blob_chunk = _chunk(_BULK_EVENT)
        self.blob_left = max(1, size // len(_BULK_EVENT)) * len(self.blob_chunk)
        self._blob_more()

    def _blob_more(self) -> None:
        chunk = self.blob_chunk
        while self.blob_left and not self.paused and not self.transport.is_closing():
            size = min(self.blob_left, len(chunk))
            self.transport.write(chunk if size == len(chunk) else chunk[:size])
            self.blob_left -= size
        if not self.blob_left and chunk is not _BLOB and not self.transport.is_closing():
            self.transport.write(_chunk(_DONE) + b"0\r\n\r\n")
            self.blob_chunk = _BLOB


async def serve(port: int, host: str = "127.0.0.1") -> None:
    """Listen on ``host:port`` until cancelled."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(UpstreamProtocol, host, port, backlog=4096, reuse_address=True)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18080, help="TCP port on 127.0.0.1 (0: any free port)")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # plain asyncio still works, only slower
        uvloop = None
    try:
        if uvloop is not None:
            uvloop.run(serve(args.port))
        else:
            asyncio.run(serve(args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
