"""Shared test harness: loopback stand-ins for llama-server and crossbar in-process.

:class:`FakeLlama` speaks the parts of llama-server's HTTP interface crossbar uses
(``/health``, ``/v1/models``, ``/v1/chat/completions`` plain and streaming) on a real
loopback socket, with knobs for failure modes; :func:`listen` serves it (or any
resource). :func:`start_crossbar` runs a real :class:`~crossbar.process.service.CrossbarService`
for a YAML text on ``127.0.0.1:<free port>``; :func:`start_routes` builds that text
from hosts and routes and waits for the first poll round; :func:`two_hosts` is the
common two-host set-up. :func:`wait_for` polls a condition."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import deferLater
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request, Site

from treq.client import HTTPClient
from twisted.web.client import Agent, HTTPConnectionPool

from crossbar.config import parse_config
from crossbar.process.service import CrossbarService, make_service
from tools.llama_server import skip_reason

__all__ = [
    "FakeLlama", "Seen", "TwoHosts", "http_client", "listen", "port_of", "require_llama_server", "sse_event",
    "start_crossbar",
    "start_routes", "two_hosts", "upstream_requests", "wait_for",
]


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
    :ivar events: server-sent events per streaming completion (a request's JSON ``n``
        overrides it).
    :ivar event_delay: seconds between events (a request's JSON ``delay`` overrides it).
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
        answer = self._answer(request)
        if request.method == b"HEAD" and isinstance(answer, bytes) and answer:
            # llama-server answers HEAD with the head alone; given a body, Twisted's
            # server would log a warning naming the request (its query string too).
            request.setHeader(b"content-length", b"%d" % len(answer))
            return b""
        return answer

    def _answer(self, request: Request) -> Any:
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
                return self._stream(request, int(doc.get("n", self.events)), float(doc.get("delay", self.event_delay)))
            request.setHeader(b"content-type", b"application/json")
            return json.dumps({"object": "chat.completion", "model": doc.get("model") if isinstance(doc, dict) else None,
                               "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}).encode()
        request.setResponseCode(404)
        request.setHeader(b"content-type", b"application/json")
        return b'{"error":"not found"}'

    def _stream(self, request: Request, events: int, delay: float) -> Any:
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-cache")
        request.setHeader(b"x-accel-buffering", b"no")
        closed: Deferred[None] = Deferred()
        self.streams_closed.append(closed)
        state: dict[str, Any] = {"i": 0, "call": None, "gone": False}

        def gone(_: object) -> None:
            state["gone"] = True
            call = state["call"]
            if call is not None and call.active():
                call.cancel()
            if not closed.called:
                closed.callback(None)

        request.notifyFinish().addBoth(gone)

        def tick() -> None:
            state["call"] = None
            if state["gone"]:
                return
            i = state["i"]
            if i < events:
                request.write(sse_event(i))
                state["i"] = i + 1
                state["call"] = reactor.callLater(delay, tick)
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


class _QuietSite(Site):
    """An upstream's site without an access log, so captured log events are crossbar's."""

    noisy = False

    def log(self, request: Any) -> None:
        pass


async def listen(case: TestCase, resource: Resource) -> str:
    """Serve ``resource`` on a free loopback port for the test, without an access log;
    returns its base URL."""
    port: IListeningPort = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(_QuietSite(resource))
    case.addCleanup(port.stopListening)
    return f"http://127.0.0.1:{port.getHost().port}"  # type: ignore[attr-defined]


def port_of(base_url: str) -> int:
    """The port of a base URL such as ``http://127.0.0.1:PORT``."""
    port = urlsplit(base_url).port
    assert port is not None, base_url
    return port


async def start_crossbar(case: TestCase, config_yaml: str) -> tuple[CrossbarService, str]:
    """Run crossbar for ``config_yaml`` (its ``listen`` is replaced by a free loopback
    port) until the test ends; returns the service and crossbar's base URL."""
    lines = [line for line in config_yaml.splitlines() if not line.startswith("listen:")]
    if not any(line.startswith("drain:") for line in lines):
        # Stopping the service drains it: no delay or grace for a test's clean-up.
        lines.insert(0, "drain: {delay: 0.001, grace: 0.001}")
    text = "listen: \"tcp:0:interface=127.0.0.1\"\n" + "\n".join(lines)
    service = make_service(parse_config(text, "test.yaml"))
    service.startService()
    case.addCleanup(service.stopService)
    port = await service.web.when_listening()
    return service, f"http://127.0.0.1:{port.getHost().port}"  # type: ignore[attr-defined]


async def start_routes(
    case: TestCase,
    hosts: dict[str, str],
    routes: dict[str, list[str]] | None = None,
    timeouts: str = "",
    default_models: dict[str, str] | None = None,
) -> tuple[CrossbarService, str]:
    """crossbar with ``hosts`` (name -> URL) and ``routes`` (name -> host names, in
    order; default: one route ``r`` over every host), a poll interval long enough
    that polls do not heal a marked-down host during a test, the given ``timeouts``
    flow mapping (e.g. ``"{idle: 1}"``) and route ``default_models``. Returns the
    service and crossbar's base URL once the first poll round is done."""
    routes = routes or {"r": list(hosts)}
    text = "health: {interval: 60, timeout: 5}\n"
    if timeouts:
        text += f"timeouts: {timeouts}\n"
    text += "hosts:\n" + "".join(f"  {name}: {url}\n" for name, url in hosts.items())
    text += "routes:\n"
    for name, members in routes.items():
        text += f"  {name}:\n    hosts: [{', '.join(members)}]\n"
        if default_models and name in default_models:
            text += f"    default_model: {default_models[name]}\n"
    service, base = await start_crossbar(case, text)
    await service.poller.when_first_round_done()
    return service, base


def upstream_requests(upstream: FakeLlama) -> list[Seen]:
    """What the upstream saw apart from health polls."""
    return [s for s in upstream.seen if s.uri not in (b"/health", b"/v1/models")]


@dataclass
class TwoHosts:
    """crossbar in front of two FakeLlama hosts: ``a`` has ``model-a`` loaded, ``b``
    ``model-b``; route ``r`` is ``[a, b]`` with default model ``model-b``; route ``d``
    is ``[dead]`` (a host that answers health 503).

    :ivar port: crossbar's loopback port; :ivar base: its base URL.
    """

    a: FakeLlama
    b: FakeLlama
    dead: FakeLlama
    service: CrossbarService
    base: str
    port: int

    def chosen(self) -> list[str]:
        """Which host got each proxied request, in order."""
        out = [(s, "a") for s in upstream_requests(self.a)] + [(s, "b") for s in upstream_requests(self.b)]
        return [name for _, name in out]


async def two_hosts(case: TestCase) -> TwoHosts:
    """Start :class:`TwoHosts` and wait for the first poll round."""
    a, b, dead = FakeLlama(["model-a"]), FakeLlama(["model-b"]), FakeLlama(["model-x"])
    dead.health_code = 503
    urls = [await listen(case, u) for u in (a, b, dead)]
    service, base = await start_routes(
        case, dict(zip(("a", "b", "dead"), urls)), {"r": ["a", "b"], "d": ["dead"]},
        default_models={"r": "model-b"},
    )
    return TwoHosts(a, b, dead, service, base, port_of(base))


async def wait_for(check: Callable[[], Any], timeout: float = 5.0, what: str = "condition",
                   step: float = 0.05) -> Any:
    """Poll the sync or async ``check`` every ``step`` seconds until it returns a truthy
    value, which is returned.

    :raises AssertionError: not within ``timeout`` seconds.
    """
    deadline = reactor.seconds() + timeout
    while True:
        value = check()
        if isinstance(value, Deferred) or hasattr(value, "__await__"):
            value = await value
        if value:
            return value
        if reactor.seconds() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        await deferLater(reactor, step)


def require_llama_server(case: SynchronousTestCase) -> None:
    """Skip ``case`` when no real llama-server can be had; fail it instead when the
    environment has ``CI=true``.

    :raises SkipTest: no llama-server, not under CI.
    """
    reason = skip_reason()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        case.fail(f"CI=true requires a real llama-server: {reason}")
    raise SkipTest(reason)
