"""The proxy resource: route, choose a host, forward, stream back (DESIGN.md §The proxy).

Each request is one :class:`_Exchange`. The upstream answer's body is a producer and the
client's connection its consumer: every chunk is written to the client as it arrives,
and when the client cannot take more the upstream read pauses (so a slow client never
makes crossbar hold a whole answer). A client that goes away cancels the upstream
request at once. Nothing here reads, logs or keeps a body beyond forwarding it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from twisted.internet.defer import Deferred, succeed
from twisted.internet.error import ConnectionLost
from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request
from twisted.web._newclient import RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived
from zope.interface import implementer

from crossbar.failures import describe_failure
from crossbar.config import Config, Route
from crossbar.health import HealthTable
from crossbar.hosturl import host_url
from crossbar.metrics import Metrics
from crossbar.request import json_error_bytes
from crossbar.routing import (
    choose, has_dot_segment, is_allowed, is_forwardable, peek_model, split_route, split_target,
)
from crossbar.upstream import ConnectTracker, UpstreamPools

__all__ = [
    "HOST_HEADER", "HOP_BY_HOP", "STALE_WINDOW", "ProxyResource", "hop_by_hop_names",
    "relayable_phrase",
]

_log = Logger(namespace="crossbar.proxy")

HOST_HEADER = b"X-Crossbar-Host"
"""Set on every proxied answer: the name of the host that answered (DESIGN.md rule 6)."""

HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
        b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade",
    }
)
"""Hop-by-hop header names (RFC 9110 §7.6.1, plus the common ``Proxy-Connection``)."""

_REPLACED_UPSTREAM = frozenset(
    {b"host", b"content-length", b"expect", b"x-forwarded-for", b"x-forwarded-host",
     b"x-forwarded-proto", b"forwarded"}
)
_NO_BODY_METHODS = (b"GET", b"HEAD")

STALE_WINDOW = 1.0
"""Seconds after sending within which a reused pooled connection that dies before any
answer counts as stale (closed by the host while idle) and is retried once on a fresh
connection (DESIGN.md rule 7). Later, the host had the request long enough to have
started the work: that is a host failure (mark_down, 502, no retry)."""
_NO_BODY_CODES = (204, 304)


def hop_by_hop_names(headers: Headers, connection: Iterable[bytes] = ()) -> frozenset[bytes]:
    """The lower-cased names not to forward (DESIGN.md §The proxy, rule 6):
    :data:`HOP_BY_HOP` and those listed in ``Connection`` -- the values in ``headers``
    and, for an upstream answer (whose ``Connection`` Twisted keeps out of
    ``IResponse.headers``), the raw values in ``connection``."""
    named = {
        token.strip().lower()
        for value in (*headers.getRawHeaders(b"connection", []), *connection)
        for token in value.split(b",")
    }
    named.discard(b"")
    return HOP_BY_HOP | named


def relayable_phrase(phrase: bytes) -> bytes | None:
    """The upstream's reason phrase if it may be relayed as it is, else ``None`` (the
    standard phrase for the code is sent instead): RFC 9112 §4 allows only HTAB, SP,
    visible ASCII and obs-text, so a bare CR (which a lenient client could read as a
    line end, i.e. a header injected by the host) or a NUL never reaches the client."""
    if not phrase or any(c < 0x20 and c != 0x09 or c == 0x7F for c in phrase):
        return None
    return phrase


class ProxyResource(Resource):
    """The leaf resource that proxies every request outside ``/_crossbar``.

    :param config: the running configuration; assign :attr:`config` to swap it (reload).
    :param table: the health table choices are made from and mark-downs go to.
    :param pools: upstream connections.
    :param clock: the reactor (timeouts are measured on it).
    :param metrics: where request metrics go.
    """

    isLeaf = True

    def __init__(
        self, config: Config, table: HealthTable, pools: UpstreamPools, clock: IReactorTime, metrics: Metrics
    ) -> None:
        super().__init__()
        self.config = config
        self.table = table
        self.pools = pools
        self.clock = clock
        self.metrics = metrics
        self.inflight: dict[str, int] = {}
        self.active: set[_Exchange] = set()
        self._idle_waiters: list[Deferred[None]] = []
        self.draining = False
        """Set when a drain starts: answers then close their connection (keep-alive
        clients reconnect elsewhere instead of sending more requests here)."""

    def render(self, request: Request) -> Any:
        exchange = _Exchange(self, request)
        try:
            exchange.start()
        except Exception:
            exchange.on_bug(Failure())
        return NOT_DONE_YET

    def when_idle(self) -> Deferred[None]:
        """Fires once no request is in flight (at once if none is); cancellable."""
        if not self.active:
            return succeed(None)
        d: Deferred[None] = Deferred(self._idle_waiters.remove)
        self._idle_waiters.append(d)
        return d

    def _exchange_ended(self, exchange: _Exchange) -> None:
        self.active.discard(exchange)
        if not self.active and self._idle_waiters:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def abort_all(self) -> None:
        """Abort every request still in flight (the end of a drain's grace)."""
        for exchange in list(self.active):
            exchange.abort("crossbar is shutting down")


@implementer(IPushProducer)
class _StreamBody(Protocol):
    """Receives the upstream body (an ``IProtocol`` for ``deliverBody``) and is the
    producer the client's connection pauses and resumes."""

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange
        self.paused = False
        self.transport: Any = None

    def makeConnection(self, transport: Any) -> None:
        self.transport = transport
        if self.paused:
            transport.pauseProducing()

    def dataReceived(self, data: bytes) -> None:
        self.exchange.on_body(data)

    def connectionLost(self, reason: Failure = Failure(ConnectionLost())) -> None:
        self.exchange.on_body_end(reason)

    def pauseProducing(self) -> None:
        self.paused = True
        self.exchange.stop_idle_timer()
        if self.transport is not None:
            self.transport.pauseProducing()

    def hold_pause(self) -> None:
        """Re-apply a pause: ``Response.deliverBody`` resumes the upstream transport
        unconditionally once it has handed over, even when a write during the hand-over
        made the client's connection pause us."""
        if self.paused and self.transport is not None:
            self.transport.pauseProducing()

    def resumeProducing(self) -> None:
        self.paused = False
        if self.transport is not None:
            self.transport.resumeProducing()
        self.exchange.start_idle_timer()

    def stopProducing(self) -> None:
        self.exchange.on_client_gone(None)

    def close_upstream(self) -> None:
        if self.transport is not None:
            self.transport.stopProducing()


class _Exchange:
    """One proxied request, from ``render`` to its log line."""

    def __init__(self, proxy: ProxyResource, request: Request) -> None:
        self.proxy = proxy
        self.request = request
        self.config = proxy.config
        self.clock = proxy.clock
        self.started = self.clock.seconds()
        self.route: Route | None = None
        self.rest = b""
        self.query = b""
        self.model: str | None = None
        self.body: bytes | None = None
        self.host: str | None = None
        self.entered: str | None = None
        self.tried: list[str] = []
        self.ended = False
        self.status = 0
        self.bytes = 0
        self.ttfb: float | None = None
        self.sent_at = 0.0
        self.upstream: Deferred[IResponse] | None = None
        self.stream: _StreamBody | None = None
        self.first_byte_timer: IDelayedCall | None = None
        self.first_byte_timed_out = False
        self.idle_timer: IDelayedCall | None = None
        self.last_body_at = 0.0
        self.idle_timed_out = False

    # -- rules 1-5 ----------------------------------------------------------------

    def start(self) -> None:
        request = self.request
        request.notifyFinish().addErrback(self.on_client_gone)
        path, self.query = split_target(request.uri)
        split = split_route(path)
        if split is None:
            return self.answer_error(400, "missing route")
        route_name, self.rest = split
        route = self.config.routes.get(route_name)
        if route is None:
            return self.answer_error(404, "unknown route")
        self.route = route
        if has_dot_segment(self.rest) or not is_forwardable(request.method, self.rest + self.query):
            return self.answer_error(400, "bad path")
        if not is_allowed(self.rest):
            return self.answer_error(404, "not found")
        content = request.content.getvalue() if request.content is not None else b""
        if request.method not in _NO_BODY_METHODS:
            self.body = content
            self.model = peek_model(content)
        if self.model is None:
            self.model = route.default_model
        self.proxy.active.add(self)
        self.attempt()

    def attempt(self) -> None:
        assert self.route is not None
        table = self.proxy.table

        def loaded(name: str) -> tuple[str, ...]:
            status = table.get(name)
            return status.loaded if status is not None else ()

        host = choose(self.route.hosts, self.model, table.is_healthy, loaded, exclude=self.tried)
        if host is None:
            if self.tried:
                return self.answer_error(502, "upstream failed", host=self.tried[-1])
            return self.answer_error(503, "no healthy host")
        self.host = self.entered = host
        self.proxy.inflight[host] = self.proxy.inflight.get(host, 0) + 1
        self.proxy.metrics.inflight.labels(self.route.name, host).inc()
        self.send(fresh=False)

    # -- rule 6: forward ----------------------------------------------------------

    def upstream_headers(self) -> Headers:
        src = self.request.requestHeaders
        drop = hop_by_hop_names(src) | _REPLACED_UPSTREAM
        out = Headers()
        for name, values in src.getAllRawHeaders():
            if name.lower() not in drop:
                out.setRawHeaders(name, values)
        client = getattr(self.request.getClientAddress(), "host", None)
        if client:
            out.setRawHeaders(b"X-Forwarded-For", [client.encode("ascii", "replace")])
        host = src.getRawHeaders(b"host")
        if host:
            out.setRawHeaders(b"X-Forwarded-Host", [host[0]])
        out.setRawHeaders(b"X-Forwarded-Proto", [b"https" if self.request.isSecure() else b"http"])
        return out

    def send(self, fresh: bool) -> None:
        assert self.host is not None
        target = host_url(self.config.hosts[self.host].url).target(self.rest + self.query)
        agent, tracker = self.proxy.pools.agent(fresh=fresh)
        producer = None if self.body is None else _BytesProducer(self.body)
        self.sent_at = self.clock.seconds()
        d = agent.request(self.request.method, target, self.upstream_headers(), producer)
        self.upstream = d
        self.first_byte_timed_out = False
        self.first_byte_timer = self.clock.callLater(
            self.config.timeouts.first_byte, self.on_first_byte_timeout
        )
        d.addCallbacks(self.on_response, self.on_request_failed, errbackArgs=(tracker, fresh))
        d.addErrback(self.on_bug)

    def on_first_byte_timeout(self) -> None:
        self.first_byte_timed_out = True
        if self.upstream is not None:
            self.upstream.cancel()

    def on_request_failed(self, failure: Failure, tracker: ConnectTracker, fresh: bool) -> None:
        self.cancel_timer("first_byte_timer")
        self.upstream = None
        if self.ended:
            return  # the client left and we cancelled it: says nothing about the host
        host = self.host
        assert host is not None
        if self.first_byte_timed_out:
            timeout = self.config.timeouts.first_byte
            self.mark_down("first_byte_timeout", f"no response headers within {timeout:g}s")
            return self.answer_error(504, "upstream timed out")
        if tracker.connect_failure is not None:
            self.mark_down("connect", f"connect: {describe_failure(tracker.connect_failure)}")
            self.leave_host()
            self.tried.append(host)
            return self.attempt()
        if (
            not fresh
            and tracker.connects == 0
            and self.clock.seconds() - self.sent_at < STALE_WINDOW
            and failure.check(RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived)
        ):
            # A reused pooled connection was dead before any answer: once more, fresh.
            _log.debug("retrying {host} on a fresh connection", host=host)
            return self.send(fresh=True)
        self.mark_down("request", f"request failed: {describe_failure(failure)}")
        return self.answer_error(502, "upstream failed", host=host)

    def on_response(self, response: IResponse) -> None:
        self.cancel_timer("first_byte_timer")
        self.upstream = None
        if self.ended:
            response.deliverBody(_Discard())
            return
        self.ttfb = self.clock.seconds() - self.sent_at
        request = self.request
        self.status = response.code
        request.setResponseCode(response.code, relayable_phrase(response.phrase))
        out = request.responseHeaders
        out.removeHeader(b"server")
        self.copy_response_headers(response)
        self.close_if_draining()
        assert self.host is not None
        out.setRawHeaders(HOST_HEADER, [self.host.encode("utf-8")])
        stream = self.stream = _StreamBody(self)
        request.registerProducer(stream, True)
        if getattr(request.channel, "_waitingForTransport", False):
            # The client's connection is already full (e.g. a pipelined answer before
            # this one): HTTPChannel only tells producers of later pauses.
            stream.pauseProducing()
        self.start_idle_timer()
        response.deliverBody(stream)
        if not self.ended:
            stream.hold_pause()

    def copy_response_headers(self, response: IResponse) -> None:
        """The upstream answer's headers onto the client's answer (rule 6): hop-by-hop
        ones dropped, repeated ones kept, and ``Content-Length`` kept when the upstream
        gave one (Twisted moves it to ``response.length``), so the answer is chunked
        only when the upstream's was. HEAD answers keep theirs in ``response.headers``;
        204 and 304 carry none."""
        out = self.request.responseHeaders
        drop = hop_by_hop_names(response.headers, getattr(response, "upstream_connection", ()))
        for name, values in response.headers.getAllRawHeaders():
            if name.lower() not in drop:
                out.setRawHeaders(name, values)
        length = response.length
        if (
            isinstance(length, int)
            and response.code not in _NO_BODY_CODES
            and self.request.method != b"HEAD"
        ):
            out.setRawHeaders(b"Content-Length", [str(length).encode("ascii")])

    # -- streaming ------------------------------------------------------------------

    def on_body(self, data: bytes) -> None:
        if self.ended:
            return
        self.bytes += len(data)
        self.request.write(data)
        self.last_body_at = self.clock.seconds()

    def on_body_end(self, reason: Failure) -> None:
        self.cancel_timer("idle_timer")
        if self.ended:
            return
        if reason.check(ResponseDone, PotentialDataLoss):
            self.request.unregisterProducer()
            self.request.finish()
            return self.end()
        if self.idle_timed_out:
            return
        self.mark_down("mid_answer", f"failed mid-answer: {describe_failure(reason)}")
        self.abort_client()

    def start_idle_timer(self) -> None:
        if self.ended or self.stream is None or self.stream.paused:
            return
        self.last_body_at = self.clock.seconds()
        if self.idle_timer is None or not self.idle_timer.active():
            self.idle_timer = self.clock.callLater(self.config.timeouts.idle, self.on_idle_timeout)

    def stop_idle_timer(self) -> None:
        self.cancel_timer("idle_timer")

    def on_idle_timeout(self) -> None:
        if self.ended:
            return
        left = self.last_body_at + self.config.timeouts.idle - self.clock.seconds()
        if left > 0:
            self.idle_timer = self.clock.callLater(left, self.on_idle_timeout)
            return
        self.idle_timed_out = True
        self.mark_down("idle_timeout", f"no body byte within {self.config.timeouts.idle:g}s")
        if self.stream is not None:
            self.stream.close_upstream()
        self.abort_client()

    # -- endings ----------------------------------------------------------------------

    def on_client_gone(self, reason: Failure | None) -> None:
        """The client's connection closed before the answer ended: cancel upstream."""
        if self.ended:
            return
        self.status = 499  # nginx's "client closed request", for the log line only
        self.end()
        if self.upstream is not None:
            upstream, self.upstream = self.upstream, None
            upstream.cancel()
        if self.stream is not None:
            self.stream.close_upstream()

    def abort(self, why: str) -> None:
        """Abort this exchange from outside (the end of a drain's grace)."""
        if self.ended:
            return
        _log.info("aborting {method} /{route}{path}: {why}", method=self.request.method.decode("latin-1"),
                             route=self.route.name if self.route else "", path=self.rest.decode("latin-1"), why=why)
        upstream, self.upstream = self.upstream, None
        self.abort_client()
        if upstream is not None:
            upstream.cancel()
        if self.stream is not None:
            self.stream.close_upstream()

    def abort_client(self) -> None:
        """End the client's connection so it sees a truncated answer, never a clean end."""
        if self.ended:
            return
        if self.stream is not None:
            self.request.unregisterProducer()
        self.end()
        transport: Any = self.request.channel.transport if self.request.channel is not None else None
        if transport is not None:
            transport.abortConnection()

    def answer_error(self, code: int, message: str, **extra: str) -> None:
        """Answer with crossbar's own JSON error (DESIGN.md rule 9) and end."""
        if self.ended:
            return
        body = json_error_bytes(message, **extra)
        request = self.request
        self.status = code
        request.setResponseCode(code)
        request.responseHeaders.removeHeader(b"server")
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", str(len(body)).encode("ascii"))
        self.close_if_draining()
        request.write(body)
        request.finish()
        self.end()

    def close_if_draining(self) -> None:
        """During a drain, answer with ``Connection: close`` and close after it."""
        if not self.proxy.draining:
            return
        self.request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
        channel = self.request.channel
        if channel is not None:
            channel.persistent = False

    def end(self) -> None:
        """Once per exchange: release the host, count, and write the log line (rule 8)."""
        if self.ended:
            return
        self.ended = True
        self.cancel_timer("first_byte_timer")
        self.cancel_timer("idle_timer")
        self.proxy._exchange_ended(self)
        self.leave_host()
        now = self.clock.seconds()
        route = self.route.name if self.route is not None else ""
        host = self.host or ""
        ms = round((now - self.started) * 1000, 1)
        ttfb_ms = round(self.ttfb * 1000, 1) if self.ttfb is not None else None
        if self.route is not None:
            m = self.proxy.metrics
            m.requests.labels(route, host, str(self.status)).inc()
            m.duration.labels(route, host).observe(now - self.started)
            if self.ttfb is not None:
                m.ttfb.labels(route, host).observe(self.ttfb)
        _log.info(
            "{method} {target} -> {host} {status} {bytes}B ttfb={ttfb_text} {ms}ms",
            route=route, host=host or "-", method=self.request.method.decode("latin-1"),
            path=self.rest.decode("latin-1"), status=self.status, bytes=self.bytes,
            ttfb_ms=ttfb_ms, ttfb_text="-" if ttfb_ms is None else f"{ttfb_ms}ms", ms=ms,
            target=split_target(self.request.uri)[0].decode("latin-1"),
        )

    def leave_host(self) -> None:
        """Stop counting this exchange as in flight to the host it entered."""
        host, self.entered = self.entered, None
        if host is None or self.route is None:
            return
        count = self.proxy.inflight.get(host, 0)
        if count > 0:
            self.proxy.inflight[host] = count - 1
        self.proxy.metrics.inflight.labels(self.route.name, host).dec()

    def mark_down(self, kind: str, reason: str) -> None:
        """Take the host this request went to out of rotation (rule 7), unless a reload
        changed that host's URL since the request started: the failure was the old
        host's, and says nothing of the new one."""
        host = self.host
        assert host is not None
        current = self.proxy.config.hosts.get(host)
        if current is None or current.url != self.config.hosts[host].url:
            _log.info("not marking {host} down: its URL changed since the request started ({reason})",
                      host=host, reason=reason)
            return
        self.proxy.table.mark_down(host, reason)
        self.proxy.metrics.mark_downs.labels(host, kind).inc()

    def cancel_timer(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None and timer.active():
            timer.cancel()
        setattr(self, name, None)

    def on_bug(self, failure: Failure) -> None:
        """Last resort: a bug in crossbar must not leave the client hanging."""
        _log.failure("proxying failed", failure=failure)
        if self.ended:
            return
        upstream, self.upstream = self.upstream, None
        if self.request.startedWriting:
            self.abort_client()
        else:
            self.answer_error(500, "internal error")
        if upstream is not None:
            upstream.cancel()
        if self.stream is not None:
            self.stream.close_upstream()


class _Discard(Protocol):
    """Drops an upstream body nobody wants and closes its connection."""

    def makeConnection(self, transport: Any) -> None:
        transport.stopProducing()


@implementer(IBodyProducer)
class _BytesProducer:
    """The request body, written at once (no Cooperator tick as with FileBodyProducer)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.length = len(body)

    def startProducing(self, consumer: Any) -> Deferred[None]:
        consumer.write(self.body)
        return succeed(None)

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass
