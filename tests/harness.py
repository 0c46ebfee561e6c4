"""Shared test harness: a loopback stand-in for llama-server and crossbar in-process.

:class:`FakeLlama` speaks the parts of llama-server's HTTP interface crossbar uses
(``/health``, ``/v1/models``, ``/v1/chat/completions`` plain and streaming) on a real
loopback socket, with knobs for failure modes. :func:`start_crossbar` runs a real
:class:`~crossbar.service.CrossbarService` on ``127.0.0.1:<free port>``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IListeningPort
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from treq.client import HTTPClient
from twisted.web.client import Agent, HTTPConnectionPool

from crossbar.config import parse_config
from crossbar.service import CrossbarService, make_service

__all__ = ["FakeLlama", "Seen", "http_client", "listen", "start_crossbar", "sse_event"]


class Seen:
    """One request as the upstream saw it."""

    def __init__(self, request: Request, body: bytes) -> None:
        self.method: bytes = request.method
        self.uri: bytes = request.uri
        self.headers = request.requestHeaders
        self.body = body
        self.client = request.getClientAddress()


def sse_event(i: int) -> bytes:
    """An OpenAI-style chat completion chunk carrying its index and send time."""
    chunk = {"object": "chat.completion.chunk", "i": i, "sent": time.time(),
             "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class FakeLlama(Resource):
    """A loopback upstream with llama-server's shapes.

    :ivar health_code: status of ``GET /health``.
    :ivar models: the ``/v1/models`` document (or raw bytes) to answer.
    :ivar events: server-sent events per streaming completion.
    :ivar event_delay: seconds between events.
    :ivar handlers: path -> ``f(request, body) -> bytes | NOT_DONE_YET`` overrides.
    :ivar seen: every request received, in order.
    """

    isLeaf = True

    def __init__(self, models: list[str] | None = None) -> None:
        super().__init__()
        self.health_code = 200
        self.models: Any = {"object": "list", "data": [{"id": m} for m in (models or ["tiny-a"])]}
        self.events = 5
        self.event_delay = 0.0
        self.handlers: dict[bytes, Callable[[Request, bytes], Any]] = {}
        self.seen: list[Seen] = []
        self.streams_closed: list[Deferred[None]] = []

    def render(self, request: Request) -> Any:
        body = request.content.read() if request.content is not None else b""
        self.seen.append(Seen(request, body))
        path = request.path
        if path in self.handlers:
            return self.handlers[path](request, body)
        if path == b"/health":
            request.setResponseCode(self.health_code)
            request.setHeader(b"content-type", b"application/json")
            return b'{"status":"ok"}' if self.health_code == 200 else b'{"error":"loading"}'
        if path == b"/v1/models":
            request.setHeader(b"content-type", b"application/json")
            return self.models if isinstance(self.models, bytes) else json.dumps(self.models).encode()
        if path == b"/v1/chat/completions":
            try:
                doc = json.loads(body or b"{}")
            except ValueError:
                doc = {}
            if isinstance(doc, dict) and doc.get("stream"):
                return self._stream(request)
            request.setHeader(b"content-type", b"application/json")
            return json.dumps({"object": "chat.completion", "model": doc.get("model") if isinstance(doc, dict) else None,
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}).encode()
        request.setResponseCode(404)
        request.setHeader(b"content-type", b"application/json")
        return b'{"error":"not found"}'

    def _stream(self, request: Request) -> Any:
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        closed: Deferred[None] = Deferred()
        self.streams_closed.append(closed)
        state = {"i": 0, "call": None, "gone": False}

        def gone(_: object) -> None:
            state["gone"] = True
            call = state["call"]
            if call is not None and call.active():  # type: ignore[attr-defined]
                call.cancel()  # type: ignore[attr-defined]
            if not closed.called:
                closed.callback(None)

        request.notifyFinish().addBoth(gone)

        def tick() -> None:
            state["call"] = None
            if state["gone"]:
                return
            i = state["i"]
            if i < self.events:
                request.write(sse_event(i))
                state["i"] = i + 1
                state["call"] = reactor.callLater(self.event_delay, tick)  # type: ignore[attr-defined]
            else:
                request.write(b"data: [DONE]\n\n")
                request.finish()

        tick()
        return NOT_DONE_YET


def http_client(case: TestCase) -> HTTPClient:
    """A treq client with its own connection pool, closed when the test ends."""
    pool = HTTPConnectionPool(reactor, persistent=True)
    case.addCleanup(pool.closeCachedConnections)
    return HTTPClient(Agent(reactor, pool=pool))


async def listen(case: TestCase, resource: Resource) -> str:
    """Serve ``resource`` on a free loopback port for the test; returns its base URL."""
    site = Site(resource)
    site.noisy = False
    port: IListeningPort = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
    case.addCleanup(port.stopListening)
    return f"http://127.0.0.1:{port.getHost().port}"  # type: ignore[attr-defined]


async def start_crossbar(case: TestCase, config_yaml: str) -> tuple[CrossbarService, str]:
    """Run crossbar for ``config_yaml`` (its ``listen`` is replaced by a free loopback
    port) until the test ends; returns the service and crossbar's base URL."""
    text = "listen: \"tcp:0:interface=127.0.0.1\"\n" + "\n".join(
        line for line in config_yaml.splitlines() if not line.startswith("listen:")
    )
    service = make_service(parse_config(text, "test.yaml"))
    service.startService()
    case.addCleanup(service.stopService)
    port = await service.web.when_listening()
    return service, f"http://127.0.0.1:{port.getHost().port}"  # type: ignore[attr-defined]
