"""The proxy resource and one request's sequence through it (DESIGN.md §The proxy).

Each request is one :class:`Exchange`, in one :class:`Phase` at a time (the moves
allowed are :data:`_NEXT`; each event handler says in which phases it acts). The
exchange only sequences; where each rule lives:

- rules 1-4: :mod:`crossbar.proxy.head` (the head parsed once, the checks in order),
  :class:`crossbar.proxy.request.CappedRequest` (the 413 and the peek);
  :meth:`Exchange.start` runs :func:`~crossbar.proxy.head.check_path` and a key's
  ``max_inflight`` (429, §Access);
- rule 5: :meth:`Exchange.forward` (:func:`crossbar.hosts.balance.choose`, the queue);
- rule 6: :mod:`crossbar.proxy.headers` (pure), :mod:`crossbar.proxy.client` (what is
  written to the client), :class:`~crossbar.proxy.relay.Relay` (the body);
- rule 7: :func:`crossbar.proxy.policy.decide`, carried out by :meth:`Exchange.carry_out`;
  :class:`~crossbar.proxy.attempt.Attempt` classifies failures before the head;
- rule 8: :class:`crossbar.proxy.tally.Tally`, written by :meth:`Exchange.end` before
  the request's host slot is freed; rule 9: :meth:`Exchange.answer_error`, :meth:`Exchange.on_bug`;
- rule 10: :meth:`Exchange.answer_models` (:mod:`crossbar.proxy.modellist`).

Nothing here reads, logs or keeps a body beyond forwarding it.
"""

from __future__ import annotations

import json
from enum import Enum
from functools import wraps
from typing import Any, Callable, Final, TypeVar, cast

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.config import Config, Route
from crossbar.errors import json_error_bytes
from crossbar.hosts.balance import Chosen, Verdict, choose
from crossbar.ops.record import NO_ROUTE, RequestLog
from crossbar.proxy.attempt import Answer, Attempt, UpstreamFailed
from crossbar.proxy.client import abort_connection, write_head, write_json
from crossbar.proxy.head import MODELS_PATH, RequestHead, check_path
from crossbar.proxy.headers import upstream_headers
from crossbar.proxy.modellist import route_models
from crossbar.proxy.policy import Action, Decision, decide
from crossbar.proxy.relay import Relay, RelayEnd
from crossbar.proxy.request import NO_BODY_METHODS
from crossbar.proxy.tally import Tally
from crossbar.proxy.web import CrossbarRequest
from crossbar.state.inflight import Lease
from crossbar.state.runtime import Runtime
from crossbar.upstream.hosturl import host_url
from crossbar.upstream.pools import UpstreamPools

__all__ = ["Exchange", "Phase", "ProxyResource"]

_log = Logger(namespace="crossbar.proxy")


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
        """Start the request's :class:`Exchange` on its head; it answers asynchronously."""
        head = request.head if isinstance(request, CrossbarRequest) else None
        if head is None:  # not a request of crossbar's site: a wiring bug
            _log.error("no request head for {uri!r}", uri=request.path)
            request.setResponseCode(500)
            request.setHeader(b"Content-Type", b"application/json")
            return json_error_bytes("internal error")
        exchange = Exchange(self, request, head)
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
        for exchange in sorted(self.runtime.active, key=lambda e: e.phase is not Phase.QUEUED):
            exchange.abort(why)

    def mark_down(self, host: str, reason: str, started_with: Config) -> bool:
        """Take ``host`` out of rotation after a request to it really failed (rule 7),
        unless a reload changed that host's URL since the request started under
        ``started_with``: the failure was the old host's, and says nothing of the new one.
        Returns whether it was marked down."""
        current, old = self.runtime.config.hosts.get(host), started_with.hosts.get(host)
        if current is None or old is None or current.url != old.url:
            _log.info("not marking {host} down: its URL changed since the request started ({reason})",
                      host=host, reason=reason)
            return False
        self.runtime.table.mark_down(host, reason)
        return True


class Phase(Enum):
    """Where an exchange is."""

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


_NEXT: Final[dict[Phase, frozenset[Phase]]] = {
    Phase.ROUTING: frozenset({Phase.FORWARDING, Phase.ENDED}),
    Phase.FORWARDING: frozenset({Phase.FORWARDING, Phase.QUEUED, Phase.RELAYING, Phase.ENDED}),
    Phase.QUEUED: frozenset({Phase.FORWARDING, Phase.ENDED}),
    Phase.RELAYING: frozenset({Phase.ENDED}),
    Phase.ENDED: frozenset(),
}
"""Every move an exchange may make (a failover forwards again, and may queue)."""

_LIVE = (Phase.ROUTING, Phase.QUEUED, Phase.FORWARDING, Phase.RELAYING)
_F = TypeVar("_F", bound=Callable[..., None])


def _acts_in(*phases: Phase) -> Callable[[_F], _F]:
    """An event handler that acts only while the exchange is in one of ``phases`` (a
    late event -- a timer, an answer after the client left -- is dropped)."""
    def wrap(handler: _F) -> _F:
        @wraps(handler)
        def guarded(self: Exchange, *args: Any, **kwargs: Any) -> None:
            if self.phase in phases:
                handler(self, *args, **kwargs)
        return cast(_F, guarded)
    return wrap


class Exchange:
    """One proxied request, from ``render`` to its record (DESIGN.md §The proxy).

    :param head: the request's head, checked under the config current when it was
        complete; the request is served under that config (a waiting one adopts a new
        one, :meth:`adopt_current_config`).
    """

    def __init__(self, proxy: ProxyResource, request: Request, head: RequestHead) -> None:
        self.proxy = proxy
        self.request = request
        self.head = head
        self.runtime = proxy.runtime
        self.clock = proxy.clock
        self.config: Config = head.config
        self.route: Route | None = head.route
        self.tally = Tally(head, proxy.requests, self.clock.seconds)
        self.phase = Phase.ROUTING
        self.tried: list[str] = []
        self.lease: Lease | None = None
        self.attempt: Deferred[Answer] | None = None
        self.relay: Relay | None = None
        self.queue_timer: IDelayedCall | None = None

    def _enter(self, phase: Phase) -> bool:
        """Move to ``phase`` if :data:`_NEXT` allows it; False (and stay) otherwise."""
        if phase not in _NEXT[self.phase]:
            return False
        self.phase = phase
        return True

    @property
    def key(self) -> str:
        """The client key's name, or "" (for the runtime's per-key counts)."""
        return self.head.key

    @property
    def route_name(self) -> str:
        """The route's name (the queue's :class:`~crossbar.state.queue.Waiter` interface)."""
        return NO_ROUTE if self.route is None else self.route.name

    @property
    def queued_at(self) -> float | None:
        """When the request first joined its queue (the :class:`~crossbar.state.queue.Waiter` interface)."""
        return self.tally.queued_at

    def start(self) -> None:
        """Check rules 1-3 and a key's ``max_inflight``, answer rule 10, else forward."""
        self.request.notifyFinish().addErrback(self.on_client_gone)
        head = self.head
        refusal = check_path(head)
        if refusal is not None:
            return self.answer_error(refusal.code, refusal.message)
        assert self.route is not None
        if head.rest == MODELS_PATH and head.method in NO_BODY_METHODS:
            return self.answer_models()
        if head.key and not self.runtime.key_admits(self.route, head.key):
            return self.answer_error(429, "too many requests", retry_after=True)
        self.runtime.begin(self)
        self._enter(Phase.FORWARDING)
        self.forward()

    # -- rule 5: choose, wait; rule 7: fail over ------------------------------------

    def choose(self) -> Chosen | Verdict:
        """Rules 1-3 of §Choosing a host for this request, among the hosts not tried."""
        assert self.route is not None
        runtime, head = self.runtime, self.head
        return choose(self.route, self.config.hosts, runtime.table.all(), runtime.inflight.host, head.model,
                      head.peeked.affinity_key, runtime.rotation, exclude=self.tried)

    def forward(self) -> None:
        """Choose a host (rules 1-3 of §Choosing a host, among those not tried) and send
        the request to it, or wait for room, or answer that no host is left."""
        verdict = self.choose()
        if isinstance(verdict, Chosen):
            return self.dispatch(verdict)
        if verdict is Verdict.NO_HOST:
            return self.carry_out(decide(verdict, None, self.tried))
        return self.enqueue()

    def dispatch(self, chosen: Chosen) -> None:
        """Count the request against ``chosen.host`` and send it there (rules 6-7)."""
        assert self.route is not None
        self.leave_queue()
        self._enter(Phase.FORWARDING)
        if not self.tried:
            self.runtime.count_affinity(self.route.name, chosen.affinity)
        self.tally.chose(chosen, failover=bool(self.tried))
        self.lease = self.runtime.inflight.enter(self.route.name, chosen.host)
        host, request = self.config.hosts[chosen.host], self.request
        client = request.getClientAddress()
        headers = upstream_headers(
            request.requestHeaders, keyed=bool(self.route.keys), api_key=host.api_key,
            client=client.host if isinstance(client, (IPv4Address, IPv6Address)) else None,
            secure=request.isSecure(),
        )
        target = host_url(host.url).target(self.head.rest + self.head.query)
        self.attempt = Attempt(self.proxy.pools, self.clock, request.method, target, headers, self.head.body,
                               self.config.timeouts.first_byte).start()
        self.attempt.addCallbacks(self.on_answer, self.on_attempt_failed)
        self.attempt.addErrback(self.on_bug)

    def enqueue(self) -> None:
        """No host of the tier has room (§Choosing a host, rule 4): wait in the route's
        queue, unless it is off (``queue.max: 0``) or full: 503 at once."""
        assert self.route is not None
        settings = self.route.queue
        if settings.max == 0 or (self.route.keys and not self.key):
            # (A keyless preflight on a keyed route never takes a queue place from the
            # route's clients.)
            return self.answer_error(503, "all hosts busy", retry_after=True)
        if self.runtime.queues.queued(self.route.name) >= settings.max:
            return self.answer_error(503, "queue full", retry_after=True)
        self._enter(Phase.QUEUED)
        self.tally.joined_queue()
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
            self.carry_out(decide(verdict, None, self.tried))
        return True

    def adopt_current_config(self) -> None:
        """A waiting request has not gone anywhere yet: after a reload it is chosen for
        under the new config (its weights, limits and primary; §Choosing a host,
        rule 4), as long as its route still exists."""
        current = self.runtime.config
        assert self.route is not None
        if current is not self.config and self.route.name in current.routes:
            self.config, self.route = current, current.routes[self.route.name]

    @_acts_in(Phase.QUEUED)
    def on_queue_timeout(self) -> None:
        """``queue.timeout`` passed without room: 503 with ``Retry-After``."""
        self.queue_timer = None
        self.leave_queue()
        self.answer_error(503, "all hosts busy", retry_after=True)

    def leave_queue(self) -> None:
        """Out of the queue (dispatched, answered or gone): stop its timer, count the wait."""
        timer, self.queue_timer = self.queue_timer, None
        if timer is not None and timer.active():
            timer.cancel()
        if self.runtime.queues.remove(self):
            self.tally.left_queue(self.route_name)

    @_acts_in(Phase.FORWARDING)
    def on_attempt_failed(self, failure: Failure) -> None:
        """Rule 7 before the head (:func:`~crossbar.proxy.policy.decide`)."""
        self.attempt = None
        if failure.check(CancelledError):
            return  # we cancelled it (the client left, a drain): says nothing about the host
        failure.trap(UpstreamFailed)
        failed = failure.value
        assert isinstance(failed, UpstreamFailed)
        self.carry_out(decide(failed.kind, self.tally.host, self.tried), failed.kind.value, failed.reason)

    def carry_out(self, decision: Decision, kind: str = "", reason: str = "") -> None:
        """Do what rule 7 decided about a failure of ``kind`` (``reason`` says what)."""
        host = self.tally.host
        if decision.mark_down and self.proxy.mark_down(host, reason, self.config):
            self.tally.marked_down(host, kind)
        action = decision.action
        if action is Action.FAIL_OVER:
            self.release_host()
            self.tried.append(host)
            self.forward()
        elif action is Action.ANSWER:
            self.answer_error(decision.code, decision.message, host=decision.host)
        elif action is Action.ABORT_CLIENT:
            self.abort_client()
        elif action is Action.FINISH:
            self.request.unregisterProducer()
            self.request.finish()
            self.end()

    # -- rule 6: relay the answer -----------------------------------------------------

    @_acts_in(Phase.FORWARDING)
    def on_answer(self, answer: Answer) -> None:
        """The host's head arrived: send it to the client at once, then relay the body."""
        self.attempt = None
        self._enter(Phase.RELAYING)
        response = answer.response
        self.tally.answered(response.code, answer.sent_at)
        write_head(self.request, response, self.tally.host, self.runtime.draining)
        relay = self.relay = Relay(self.request, self.clock, self.config.timeouts.idle)
        relay.ended.addCallback(self.on_relay_end)
        relay.ended.addErrback(self.on_bug)
        relay.start(response)

    def on_relay_end(self, how: RelayEnd) -> None:
        """Rule 7 mid-answer (:func:`~crossbar.proxy.policy.decide`): a clean end
        finishes the answer; a host that died or went silent is marked down and the
        client's connection cut."""
        assert self.relay is not None
        self.tally.bytes = self.relay.bytes
        if self.phase is Phase.RELAYING:
            self.carry_out(decide(how, self.tally.host, self.tried), how.value, self.relay.reason)

    # -- endings ----------------------------------------------------------------------

    @_acts_in(*_LIVE)
    def on_client_gone(self, reason: Failure | None) -> None:
        """The client's connection closed before the answer ended: cancel upstream."""
        self.tally.status = 499  # nginx's "client closed request", for the log line only
        self.leave_queue()
        self.stop_upstream()
        self.end()

    @_acts_in(*_LIVE)
    def abort(self, why: str) -> None:
        """Abort this exchange from outside (the end of a drain's grace)."""
        _log.info("aborting {method} /{route}{path}: {why}", method=self.head.method.decode("latin-1"),
                  route=self.head.route_name or "", path=self.head.rest.decode("latin-1"), why=why)
        if self.phase is Phase.QUEUED:
            self.leave_queue()
            return self.answer_error(503, why)
        self.stop_upstream()
        self.abort_client()

    def stop_upstream(self) -> None:
        """Cancel the upstream request or stop relaying its body, whichever is under way."""
        attempt, self.attempt = self.attempt, None
        if attempt is not None:
            attempt.cancel()
        if self.relay is not None:
            self.relay.stop()
            self.tally.bytes = self.relay.bytes

    @_acts_in(*_LIVE)
    def abort_client(self) -> None:
        """End the client's connection so it sees a truncated answer, never a clean end."""
        if self.relay is not None:
            self.request.unregisterProducer()
        self.end()
        abort_connection(self.request)

    @_acts_in(*_LIVE)
    def answer_error(self, code: int, message: str, retry_after: bool = False, host: str | None = None) -> None:
        """Answer with crossbar's own JSON error (DESIGN.md rule 9) and end;
        ``retry_after`` adds ``Retry-After: 1`` (busy answers), ``host`` names the host
        that failed (502)."""
        body = json_error_bytes(message) if host is None else json_error_bytes(message, host=host)
        self.answer_json(code, body, retry_after)

    def answer_models(self) -> None:
        """Rule 10: ``GET /{route}/v1/models`` from the health table, no upstream request."""
        assert self.route is not None
        doc = route_models(self.route, self.runtime.table.all())
        if doc is None:
            return self.answer_error(503, "no healthy host")
        self.answer_json(200, json.dumps(doc).encode("utf-8"))

    def answer_json(self, code: int, body: bytes, retry_after: bool = False) -> None:
        """Answer ``code`` with the JSON ``body`` and end."""
        self.tally.answered(code)
        self.tally.bytes = write_json(self.request, code, body, retry_after, self.runtime.draining)
        self.end()

    def end(self) -> None:
        """Once per exchange: write the record (rule 8), then free the host's slot (which
        may dispatch a waiting request: its work is not this request's duration)."""
        if not self._enter(Phase.ENDED):
            return
        self.tally.write()
        self.release_host()
        self.runtime.end(self)

    def release_host(self) -> None:
        """Stop counting this request as in flight to its host."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def on_bug(self, failure: Failure) -> None:
        """Last resort: a bug in crossbar must not leave the client hanging."""
        _log.failure("proxying failed", failure=failure)
        if self.phase is Phase.ENDED:
            return
        self.stop_upstream()
        if self.request.startedWriting:
            self.abort_client()
        else:
            self.answer_error(500, "internal error")
