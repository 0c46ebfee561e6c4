"""The proxy resource: route, choose a host, forward, stream back (DESIGN.md §The proxy).

Each request is one :class:`Exchange`, in one :class:`Phase` at a time. Where each rule
lives: rules 1-4 :meth:`Exchange.start` (with the pure checks of
:mod:`crossbar.proxy.routing`) and :meth:`Exchange.read_body`; rule 5 :meth:`Exchange.forward`;
rule 6 :meth:`Exchange.upstream_headers`, :meth:`Exchange.on_answer`,
:meth:`Exchange.copy_response_headers` and :class:`~crossbar.proxy.relay.Relay`; rule 7
:meth:`Exchange.on_attempt_failed` (before the head, with :class:`~crossbar.proxy.attempt.Attempt`
classifying failures), :meth:`Exchange.on_relay_end` (mid-answer) and
:meth:`Exchange.on_client_gone`; rule 8 :meth:`Exchange.end` and
:mod:`crossbar.ops.record`; rule 9 :meth:`Exchange.answer_error` and :meth:`Exchange.on_bug`.
Nothing here reads, logs or keeps a body beyond forwarding it.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Iterable, Sequence

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.proxy.attempt import STALE_WINDOW, Answer, Attempt, FailureKind, UpstreamFailed
from crossbar.hosts.balance import Chosen, Verdict, choose
from crossbar.config import Config, Route
from crossbar.upstream.hosturl import host_url
from crossbar.state.inflight import Lease
from crossbar.state.limits import retry_after_header
from crossbar.ops.figures import Figures
from crossbar.ops.record import NO_ROUTE, OTHER_MODEL, RequestLog, RequestRecord
from crossbar.proxy.relay import Relay, RelayEnd
from crossbar.errors import json_error_bytes
from crossbar.proxy.cors import cors_headers
from crossbar.proxy.request import NO_BODY_METHODS
from crossbar.paths import PathKind, classify_path
from crossbar.proxy.modellist import route_models
from crossbar.proxy.peek import Peeked, peek
from crossbar.proxy.routing import (
    has_dot_segment, is_forwardable, query_model, replace_query_model, split_route, split_target,
)
from crossbar.state.runtime import Runtime
from crossbar.upstream.pools import UpstreamPools

__all__ = [
    "HOST_HEADER", "HOP_BY_HOP", "REFUSED_METHODS", "STALE_WINDOW", "Exchange", "Phase", "ProxyResource",
    "hop_by_hop_names", "relayable_phrase",
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
_CLIENT_KEY_HEADERS = frozenset({b"authorization", b"x-api-key"})
"""Where a client presents a keyed route's key; neither reaches a host (DESIGN.md §Access)."""

"""Answered by crossbar from the health table (DESIGN.md §The proxy, rule 10)."""

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


REFUSED_METHODS = frozenset({b"TRACE", b"CONNECT"})
"""Never forwarded (405): a TRACE echoed by a host would show the client the host's
``api_key`` crossbar added (DESIGN.md §Access; RFC 9110 §9.3.8), and a CONNECT is not
a request for a path (§9.3.6)."""

_PHRASES = {429: b"Too Many Requests"}  # codes twisted.web has no phrase for


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

    :param runtime: the shared state: current config, health table, in-flight counts,
        active requests, draining.
    :param pools: upstream connections.
    :param clock: the reactor (timeouts are measured on it).
    :param requests: where each answered request's record goes (log line, metrics).
    """

    isLeaf = True

    def __init__(self, runtime: Runtime, pools: UpstreamPools, clock: IReactorTime, requests: RequestLog) -> None:
        super().__init__()
        self.runtime = runtime
        self.pools = pools
        self.clock = clock
        self.requests = requests

    def render(self, request: Request) -> Any:
        """Start the request's :class:`Exchange`; it answers asynchronously."""
        exchange = Exchange(self, request)
        try:
            exchange.start()
        except Exception:
            exchange.on_bug(Failure())
        return NOT_DONE_YET

    def when_idle(self) -> Deferred[None]:
        """Fires once no request is being handled (at once if none is); cancellable."""
        return self.runtime.idle.wait()

    def abort_all(self, why: str = "crossbar is shutting down") -> None:
        """Abort every request still being handled (the end of a drain's grace): the
        waiting ones first, answered 503, so that no slot freed by an abort dispatches
        one of them."""
        active = sorted(self.runtime.active, key=lambda e: e.phase is not Phase.QUEUED)
        for exchange in active:
            exchange.abort(why)

    def mark_down(self, host: str, kind: str, reason: str, started_with: Config) -> None:
        """Take ``host`` out of rotation after a request to it really failed (rule 7),
        unless a reload changed that host's URL since the request started under
        ``started_with``: the failure was the old host's, and says nothing of the new one."""
        current = self.runtime.config.hosts.get(host)
        old = started_with.hosts.get(host)
        if current is None or old is None or current.url != old.url:
            _log.info("not marking {host} down: its URL changed since the request started ({reason})",
                      host=host, reason=reason)
            return
        self.runtime.table.mark_down(host, reason)
        self.requests.metrics.mark_downs.labels(host, kind).inc()


class Phase(Enum):
    """Where an exchange is; each phase has its own handlers."""

    ROUTING = "routing"
    """Rules 1-4: route, path, body and model."""
    QUEUED = "queued"
    """Rule 5 / §Choosing a host rule 4: waiting in the route's queue for room."""
    FORWARDING = "forwarding"
    """Rules 5-7: a host is being connected to, or its response head awaited."""
    RELAYING = "relaying"
    """Rule 6: the answer's head went out; its body streams."""
    ENDED = "ended"
    """Answered, failed or abandoned; the record was written."""


class Exchange:
    """One proxied request, from ``render`` to its record (DESIGN.md §The proxy).

    The request is served under the config that was current when it arrived.
    """

    def __init__(self, proxy: ProxyResource, request: Request) -> None:
        self.proxy = proxy
        self.request = request
        self.runtime = proxy.runtime
        # The config the request head was checked under (DESIGN.md §Access: one config
        # per request), else the current one.
        self.config: Config = getattr(request, "config", None) or proxy.runtime.config
        self.key = str(getattr(request, "key_name", ""))
        self.clock = proxy.clock
        self.received = self.clock.seconds()
        self.phase = Phase.ROUTING
        self.route: Route | None = None
        self.rest = b""
        self.query = b""
        self.model: str | None = None
        self.affinity_key: str | None = None
        self.body: Sequence[bytes] | None = None
        self.host: str | None = None
        self.tried: list[str] = []
        self.lease: Lease | None = None
        self.attempt: Deferred[Answer] | None = None
        self.relay: Relay | None = None
        self.status = 0
        self.bytes = 0
        self.ttfb: float | None = None
        self.sent_at: float | None = None
        self.why = ""
        self.ended = "complete"  # rule 8: complete | cut | client_gone
        self.figures: Figures | None = None
        self.fit = ""
        self.queued_at: float | None = None
        self.queued = 0.0
        self.queue_timer: IDelayedCall | None = None

    @property
    def route_name(self) -> str:
        """The route's name (the queue's :class:`~crossbar.state.queue.Waiter` interface)."""
        return self.route.name if self.route is not None else NO_ROUTE

    # -- rules 1-4 ----------------------------------------------------------------

    def start(self) -> None:
        """Route the request (rules 1-4), then forward it."""
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
        if request.method in REFUSED_METHODS:
            return self.answer_error(405, "method not allowed")
        kind = classify_path(request.method, self.rest, route.paths)
        if kind is PathKind.FORBIDDEN:
            return self.answer_error(403, "forbidden path")
        if kind is PathKind.NOT_FOUND:
            return self.answer_error(404, "not found")
        if kind is PathKind.MODEL_LIST:
            return self.answer_models()
        self.body, named = self.read_body()
        if named is None and request.method in NO_BODY_METHODS:
            named = query_model(self.query)
            if named is not None and route.resolve(named) != named:  # §Model names: the query too
                self.query = replace_query_model(self.query, route.resolve(named))
        wanted = named if named is not None else route.default_model
        self.model = None if wanted is None else route.resolve(wanted)
        if self.key and not self.runtime.key_admits(route, self.key):
            return self.answer_error(429, "too many requests", retry_after=True)
        if self.key and route.keys[self.key].limits:
            # DESIGN.md §Access: the key's limits (fleet-wide with cluster.redis, where
            # the answer may take up to 50 ms).
            limited = self.runtime.check_limits(route, self.key)
            limited.addCallback(self.on_limits_checked)
            limited.addErrback(self.on_bug)
            return
        self.admitted()

    def on_limits_checked(self, wait: float) -> None:
        """The key's limits answered: 429 with ``Retry-After`` saying when the window
        allows the next request, else go on (unless the client left meanwhile)."""
        if self.phase is not Phase.ROUTING:
            return
        if wait > 0:
            return self.answer_error(429, "too many requests", retry_after=retry_after_header(wait))
        self.admitted()

    def admitted(self) -> None:
        """The request may start: it counts from now (the drain, its key) and goes."""
        self.runtime.begin(self)
        self.phase = Phase.FORWARDING
        self.forward()

    def read_body(self) -> tuple[Sequence[bytes] | None, str | None]:
        """The body to forward (the chunks it arrived in) and the model it names (rule
        4), and the request's affinity key (§Cache affinity), both found by the
        incremental peek while the body arrived (:class:`~crossbar.proxy.request.CappedRequest`).
        GET and HEAD bodies are forwarded when a client sends one (rule 6) but never
        peeked."""
        request = self.request
        chunks: Sequence[bytes] | None = getattr(request, "body_chunks", None)
        if chunks is None:  # a plain twisted.web Request (tests)
            content = request.content.getvalue() if request.content is not None else b""
            chunks = [content] if content else []
        if request.method in NO_BODY_METHODS:
            return (chunks or None), None
        peeked = getattr(request, "peeked", None)
        if not isinstance(peeked, Peeked):
            peeked = peek(b"".join(chunks))
        self.affinity_key = peeked.affinity_key
        return chunks, peeked.model

    # -- rule 5: choose; rule 7: fail over -----------------------------------------

    def choose(self) -> Chosen | Verdict:
        """Rules 1-3 of §Choosing a host for this request, among the hosts not tried."""
        assert self.route is not None
        runtime = self.runtime
        return choose(
            self.route, self.config.hosts, runtime.table.all(), runtime.inflight.host, self.model,
            self.affinity_key, runtime.rotation, exclude=self.tried, draining=runtime.drained,
        )

    def forward(self) -> None:
        """Choose a host (rule 5) and send the request to it, or wait for room, or
        answer that no host is left (503, or 502 after failovers)."""
        verdict = self.choose()
        if isinstance(verdict, Chosen):
            return self.dispatch(verdict)
        if verdict is Verdict.BUSY:
            return self.enqueue()
        return self.no_host(verdict)

    def no_host(self, verdict: Verdict) -> None:
        """No host can take the request: 404 when every healthy host is in router mode
        and none lists the model (§Choosing a host rule 1); else no healthy host is
        left: 503, or 502 naming the last host tried (rule 7)."""
        if verdict is Verdict.NO_MODEL:
            return self.answer_error(404, "model not found")
        if self.tried:
            return self.answer_error(502, "upstream failed", host=self.tried[-1])
        return self.answer_error(503, "no healthy host")

    def dispatch(self, chosen: Chosen) -> None:
        """Count the request against ``chosen.host`` and send it there (rules 6-7)."""
        assert self.route is not None
        self.leave_queue()
        self.phase = Phase.FORWARDING
        host = self.host = chosen.host
        self.fit = chosen.fit.value
        why = [chosen.fit.value] + ([chosen.pick] if chosen.pick else [])
        if self.queued_at is not None:
            why.append("queued")
        if self.tried:
            why.append("failover")
        else:
            self.runtime.count_affinity(self.route.name, chosen.affinity)
        why.append(f"affinity={chosen.affinity}")
        self.why = " ".join(why)
        self.lease = self.runtime.inflight.enter(self.route.name, host)
        target = host_url(self.config.hosts[host].url).target(self.rest + self.query)
        attempt = Attempt(
            self.proxy.pools, self.clock, self.request.method, target,
            self.upstream_headers(), self.body, self.config.timeouts.first_byte,
        )
        self.attempt = attempt.start()
        self.attempt.addCallbacks(self.on_answer, self.on_attempt_failed)
        self.attempt.addErrback(self.on_bug)

    # -- §Choosing a host, rule 4: the queue ---------------------------------------

    def enqueue(self) -> None:
        """No host of the tier has room: wait in the route's queue, unless it is off
        (``queue.max: 0``: 503 at once) or full (503 ``queue full``)."""
        assert self.route is not None
        settings = self.route.queue
        if settings.max == 0 or (self.route.keys and not self.key):
            # (A keyless preflight on a keyed route never takes a queue place from the
            # route's clients.)
            return self.answer_error(503, "all hosts busy", retry_after=True)
        if self.runtime.queues.queued(self.route.name) >= settings.max:
            return self.answer_error(503, "queue full", retry_after=True)
        self.phase = Phase.QUEUED
        if self.queued_at is None:
            self.queued_at = self.clock.seconds()
        self.runtime.queues.add(self)
        self.queue_timer = self.clock.callLater(settings.timeout, self.on_queue_timeout)

    def retry(self) -> bool:
        """The queue's call when room may have freed: True once this request left it."""
        if self.phase is not Phase.QUEUED:
            return True
        self.adopt_current_config()
        verdict = self.choose()
        if verdict is Verdict.BUSY:
            return False
        if isinstance(verdict, Chosen):
            self.dispatch(verdict)
        else:
            self.leave_queue()
            self.no_host(verdict)
        return True

    def adopt_current_config(self) -> None:
        """A waiting request has not gone anywhere yet: after a reload it is chosen for
        under the new config (its weights, limits and primary; DESIGN.md §Choosing a
        host, rule 4), as long as its route still exists."""
        current = self.runtime.config
        assert self.route is not None
        if current is self.config or self.route.name not in current.routes:
            return
        self.config = current
        self.route = current.routes[self.route.name]

    def on_queue_timeout(self) -> None:
        """``queue.timeout`` passed without room: 503 with ``Retry-After``."""
        self.queue_timer = None
        if self.phase is Phase.QUEUED:
            self.leave_queue()
            self.answer_error(503, "all hosts busy", retry_after=True)

    def leave_queue(self) -> None:
        """Out of the queue (dispatched, answered or gone): stop its timer, count the wait."""
        timer, self.queue_timer = self.queue_timer, None
        if timer is not None and timer.active():
            timer.cancel()
        if self.runtime.queues.remove(self):
            assert self.queued_at is not None and self.route is not None
            waited = self.clock.seconds() - self.queued_at
            self.queued += waited
            self.proxy.requests.metrics.queue_wait.labels(self.route.name).observe(waited)

    def on_attempt_failed(self, failure: Failure) -> None:
        """Rule 7 before the head: a connect failure fails over to another host; a
        failure after sending is a 502; no head in time is a 504."""
        self.attempt = None
        if self.phase is Phase.ENDED or failure.check(CancelledError):
            return  # we cancelled it (the client left, a drain): says nothing about the host
        failure.trap(UpstreamFailed)
        failed = failure.value
        assert isinstance(failed, UpstreamFailed) and self.host is not None
        self.mark_down(failed.kind.value, failed.reason)
        if failed.kind is FailureKind.CONNECT:
            self.release_host()
            self.tried.append(self.host)
            return self.forward()
        if failed.kind is FailureKind.FIRST_BYTE_TIMEOUT:
            return self.answer_error(504, "upstream timed out")
        return self.answer_error(502, "upstream failed", host=self.host)

    # -- rule 6: relay the answer ---------------------------------------------------

    def upstream_headers(self) -> Headers:
        """The headers sent upstream (rule 6): the client's, hop-by-hop ones removed,
        ``Host`` the upstream's, fresh ``X-Forwarded-*``; ``Authorization`` per
        §Access (on a keyed route the client's ``Authorization`` and ``X-Api-Key``
        dropped; the host's ``api_key`` when it has one, except on a keyless
        preflight of a keyed route)."""
        src = self.request.requestHeaders
        drop = hop_by_hop_names(src) | _REPLACED_UPSTREAM
        assert self.route is not None and self.host is not None
        if self.route.keys:
            drop = drop | _CLIENT_KEY_HEADERS  # the client's crossbar key stays here
        out = Headers()
        for name, values in src.getAllRawHeaders():
            if name.lower() not in drop:
                out.setRawHeaders(name, values)
        api_key = self.config.hosts[self.host].api_key
        if self.route.keys and not self.key:
            api_key = None  # a keyless preflight on a keyed route: never the host's key
        if api_key is not None:  # DESIGN.md §Access: the host's key, never the client's
            out.setRawHeaders(b"Authorization", [b"Bearer " + api_key.encode("ascii")])
        client = getattr(self.request.getClientAddress(), "host", None)
        if client:
            out.setRawHeaders(b"X-Forwarded-For", [client.encode("ascii", "replace")])
        host = src.getRawHeaders(b"host")
        if host:
            out.setRawHeaders(b"X-Forwarded-Host", [host[0]])
        out.setRawHeaders(b"X-Forwarded-Proto", [b"https" if self.request.isSecure() else b"http"])
        return out

    def on_answer(self, answer: Answer) -> None:
        """The host's head arrived: send it to the client at once (before any body
        byte, DESIGN.md §Quality bar), then relay the body."""
        self.attempt = None
        response = answer.response
        self.sent_at = answer.sent_at
        self.ttfb = self.clock.seconds() - answer.sent_at
        self.phase = Phase.RELAYING
        request = self.request
        self.status = response.code
        request.setResponseCode(response.code, relayable_phrase(response.phrase))
        request.responseHeaders.removeHeader(b"server")
        self.copy_response_headers(response)
        self.close_if_draining()
        assert self.host is not None
        request.responseHeaders.setRawHeaders(HOST_HEADER, [self.host.encode("utf-8")])
        request.write(b"")  # the head goes out now, not with the first body chunk
        relay = self.relay = Relay(request, self.clock, self.config.timeouts.idle)
        relay.ended.addCallback(self.on_relay_end)
        relay.ended.addErrback(self.on_bug)
        relay.start(response)

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

    def on_relay_end(self, how: RelayEnd) -> None:
        """Rule 7 mid-answer: a clean end finishes the answer; a host that died or went
        silent is marked down and the client's connection cut (a truncated answer,
        never a clean end)."""
        assert self.relay is not None
        self.bytes = self.relay.bytes
        if self.phase is Phase.ENDED or how is RelayEnd.STOPPED:
            return
        if how is RelayEnd.COMPLETE:
            self.figures = self.relay.figures(self.rest)  # §What the answers say
            self.request.unregisterProducer()
            self.request.finish()
            return self.end()
        self.ended = "cut"
        self.mark_down(how.value, self.relay.reason)
        self.abort_client()

    # -- endings ----------------------------------------------------------------------

    def on_client_gone(self, reason: Failure | None) -> None:
        """The client's connection closed before the answer ended: cancel upstream."""
        if self.phase is Phase.ENDED:
            return
        self.status = 499  # nginx's "client closed request", for the log line only
        self.ended = "client_gone"
        self.leave_queue()
        self.stop_upstream()
        self.end()

    def abort(self, why: str) -> None:
        """Abort this exchange from outside (the end of a drain's grace)."""
        if self.phase is Phase.ENDED:
            return
        _log.info("aborting {method} /{route}{path}: {why}", method=self.request.method.decode("latin-1"),
                  route=self.route.name if self.route else "", path=self.rest.decode("latin-1"), why=why)
        if self.phase is Phase.QUEUED:
            self.leave_queue()
            return self.answer_error(503, why)
        self.ended = "cut"
        self.stop_upstream()
        self.abort_client()

    def stop_upstream(self) -> None:
        """Cancel the upstream request or stop relaying its body, whichever is under way."""
        attempt, self.attempt = self.attempt, None
        if attempt is not None:
            attempt.cancel()
        if self.relay is not None:
            self.relay.stop()
            self.bytes = self.relay.bytes

    def abort_client(self) -> None:
        """End the client's connection so it sees a truncated answer, never a clean end."""
        if self.phase is Phase.ENDED:
            return
        if self.relay is not None:
            self.request.unregisterProducer()
        self.end()
        transport: Any = self.request.channel.transport if self.request.channel is not None else None
        if transport is not None:
            transport.abortConnection()

    def answer_error(self, code: int, message: str, retry_after: bool | int = False, **extra: str) -> None:
        """Answer with crossbar's own JSON error (DESIGN.md rule 9) and end;
        ``retry_after`` adds ``Retry-After: 1`` (busy answers), or that many seconds."""
        if self.phase is Phase.ENDED:
            return
        self.answer_json(code, json_error_bytes(message, **extra), retry_after)

    def answer_models(self) -> None:
        """Rule 10: ``GET /{route}/v1/models`` from the health table, no upstream request."""
        assert self.route is not None
        doc = route_models(self.route, self.runtime.table.all())
        if doc is None:
            return self.answer_error(503, "no healthy host")
        self.answer_json(200, json.dumps(doc).encode("utf-8"))

    def answer_json(self, code: int, body: bytes, retry_after: bool | int = False) -> None:
        """Answer ``code`` with the JSON ``body`` and end; ``retry_after``: True for
        ``Retry-After: 1``, or a number of seconds."""
        request = self.request
        self.status = code
        request.setResponseCode(code, _PHRASES.get(code))
        request.responseHeaders.removeHeader(b"server")
        if retry_after:
            request.setHeader(b"Retry-After", str(int(retry_after)).encode("ascii"))
        for name, value in cors_headers(request.requestHeaders):  # like the hosts' answers
            request.setHeader(name, value)
        request.setHeader(b"Content-Type", b"application/json")
        request.setHeader(b"Content-Length", str(len(body)).encode("ascii"))
        self.close_if_draining()
        request.write(body)
        self.bytes = 0 if request.method == b"HEAD" else len(body)
        request.finish()
        self.end()

    def close_if_draining(self) -> None:
        """During a drain, answer with ``Connection: close`` and close after it."""
        if not self.runtime.draining:
            return
        self.request.responseHeaders.setRawHeaders(b"Connection", [b"close"])
        channel = self.request.channel
        if channel is not None:
            channel.persistent = False

    def end(self) -> None:
        """Once per exchange: release the host and write the record (rule 8)."""
        if self.phase is Phase.ENDED:
            return
        self.phase = Phase.ENDED
        self.release_host()
        self.runtime.end(self)
        figures = self.figures
        if figures is not None and self.key and self.route is not None:
            # Key limits (DESIGN.md §Access): the answer's tokens (§"What the answers
            # say"): every prompt token, cached or read, and every generated one.
            self.runtime.spend(self.route.name, self.key, figures.prompt + figures.cached + figures.generated)
        self.proxy.requests.write(RequestRecord(
            route=self.route.name if self.route is not None else NO_ROUTE,
            host=self.host or "",
            method=self.request.method.decode("latin-1"),
            path=self.rest.decode("latin-1"),
            target=split_target(self.request.uri)[0].decode("latin-1"),
            status=self.status,
            bytes=self.bytes,
            duration=self.clock.seconds() - self.received,
            ttfb=self.ttfb,
            queued=self.queued,
            key=self.key,
            why=self.why,
            ended=self.ended,
            figures=self.figures,
            model=self.model_label() if self.route is not None else "",
            ttft=self.ttft_stream(),
        ))

    def ttft_stream(self) -> float | None:
        """Time to first token of a streamed answer: request sent -> first body byte."""
        relay, answer_sent = self.relay, self.sent_at
        if relay is None or relay.first_byte_at is None or answer_sent is None:
            return None
        types = self.request.responseHeaders.getRawHeaders(b"content-type")
        if not types or not types[0].startswith(b"text/event-stream"):
            return None
        return relay.first_byte_at - answer_sent

    def model_label(self) -> str:
        """The ``model`` label (§What the answers say): the model chosen for when a host
        of the route lists it, else ``other``; never a value only the request named."""
        model, route = self.model, self.route
        if model is None or route is None:
            return OTHER_MODEL
        if self.fit and self.fit != "fallback":
            return model  # the chosen host lists it
        for name in route.hosts:
            status = self.runtime.table.get(name)
            if status is not None and (model in status.loaded or model in status.loading or model in status.available):
                return model
        return OTHER_MODEL

    def release_host(self) -> None:
        """Stop counting this request as in flight to its host."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def mark_down(self, kind: str, reason: str) -> None:
        """Take the host this request went to out of rotation (rule 7)."""
        assert self.host is not None
        self.proxy.mark_down(self.host, kind, reason, self.config)

    def on_bug(self, failure: Failure) -> None:
        """Last resort: a bug in crossbar must not leave the client hanging."""
        _log.failure("proxying failed", failure=failure)
        if self.phase is Phase.ENDED:
            return
        self.stop_upstream()
        if self.request.startedWriting:
            self.ended = "cut"
            self.abort_client()
        else:
            self.answer_error(500, "internal error")
