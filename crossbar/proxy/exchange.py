"""One request's sequence through the proxy (docs/design.md §The proxy).

Each request is one :class:`Exchange`, moving through the phases of :mod:`crossbar.proxy.phase`.
It only sequences; the rules live in :mod:`~crossbar.proxy.head` (1-4, §Model names),
:func:`crossbar.hosts.balance.choose` and :mod:`~crossbar.proxy.place` (5),
:mod:`~crossbar.proxy.leg` (one try at one host: its slot, the request, the relay; 6),
:mod:`~crossbar.proxy.policy` (7), :mod:`~crossbar.proxy.tally` (8, written before the
host's slot is freed) and :mod:`~crossbar.proxy.modellist` (10). It never reads or keeps a body.
"""

from __future__ import annotations

from functools import wraps
from typing import Any, Callable, TypeVar, cast

from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.python.failure import Failure

from crossbar.config import Config, Route
from crossbar.hosts.balance import Chosen, Verdict
from crossbar.ops.record import NO_ROUTE
from crossbar.paths import PathKind
from crossbar.proxy.attempt import Answer, UpstreamFailed
from crossbar.proxy.client import abort_connection, error_body, write_json
from crossbar.proxy.context import ProxyContext
from crossbar.proxy.head import Refusal, RequestHead, wanted_model
from crossbar.proxy.leg import Leg
from crossbar.proxy.phase import LIVE, Phase, Phased, acts_in
from crossbar.proxy.place import QueuePlace
from crossbar.proxy.policy import Action, Decision, decide
from crossbar.proxy.ratelimit import key_limit_headers
from crossbar.proxy.relay import Relay, RelayEnd
from crossbar.proxy.request import CappedRequest
from crossbar.proxy.tally import Tally
from crossbar.state.limits import retry_after_header

__all__ = ["Exchange"]

_log = Logger(namespace="crossbar.proxy")

_H = TypeVar("_H", bound=Callable[..., None])


def called_directly(handler: _H) -> _H:
    """Decorate an exchange's handler that is called directly (by the relay, by the
    request), not as a Deferred's callback with ``on_bug`` as its errback: a bug in it
    goes to ``on_bug`` all the same."""
    @wraps(handler)
    def guarded(self: Exchange, *args: Any) -> None:
        try:
            handler(self, *args)
        except Exception:
            self.on_bug(Failure())
    return cast(_H, guarded)


class Exchange(Phased):
    """One proxied request, from ``render`` to its record (docs/design.md §The proxy).

    :param ctx: the proxy's shared parts.
    :param head: the request's head, checked under the config current when it was complete;
        the request is served under it (one waiting in a queue adopts a reloaded config:
        :attr:`head` is then the same head under that config). The head alone says the
        config, the route and the key.
    :ivar model: the model the request is chosen for (rule 4, after aliases), once known.
    :ivar upstream_query: the query string sent upstream (an alias in ``?model=`` rewritten).
    """

    def __init__(self, ctx: ProxyContext, request: CappedRequest, head: RequestHead) -> None:
        super().__init__()
        self.ctx, self.request, self.head = ctx, request, head
        self.runtime, self.clock = ctx.runtime, ctx.clock
        self.model: str | None = None
        self.upstream_query = head.query
        self.tally = Tally(head, ctx.requests, self.clock.seconds)
        self.tried: list[str] = []
        self.leg: Leg | None = None
        self.relay: Relay | None = None  # the answer's body, once its head went to the client
        self.place: QueuePlace | None = None
        self.limits_refused: float | None = None  # a 429 of the key's limits: its Retry-After

    @property
    def config(self) -> Config:
        """The config the request is served under (its head's)."""
        return self.head.config

    @property
    def route(self) -> Route | None:
        """The configured route the request names, under :attr:`config`, or None."""
        return self.head.route

    @property
    def key(self) -> str:
        """The client key's name ("" for none; the runtime's per-key counts)."""
        return self.head.key

    @property
    def route_name(self) -> str:
        """The route's name (for the runtime's per-key counts)."""
        return NO_ROUTE if self.head.route is None else self.head.route.name

    @property
    def host(self) -> str:
        """The host of the current try ("" before the first)."""
        return "" if self.leg is None else self.leg.host

    def start(self, checked: Refusal | PathKind) -> None:
        """Answer ``checked``'s refusal (rules 1-3, :func:`~crossbar.proxy.head.check_path`),
        or a key's ``max_inflight`` and limits (429, §Access), or forward."""
        self.request.on_lost = self.on_client_gone
        head = self.head
        if isinstance(checked, Refusal):
            return self.answer_error(checked.code, checked.message)
        assert self.route is not None
        self.model, self.upstream_query = wanted_model(head, self.route)
        self.tally.model = self.model
        if head.key and not self.runtime.key_admits(self.route, head.key):
            return self.answer_error(429, "too many requests", retry_after=True)
        if head.key and self.route.keys[head.key].limits:  # fleet-wide with cluster.redis: up to 50 ms
            limited = self.runtime.check_limits(self.route, head.key)
            limited.addCallback(self.on_limits_checked)
            limited.addErrback(self.on_bug)
            return
        self.admitted()

    @acts_in(Phase.ROUTING)
    def on_limits_checked(self, wait: float) -> None:
        """The key's limits answered: 429 with ``Retry-After`` (when the window allows one)
        and 0 remaining in its rate-limit headers, or go on."""
        if wait > 0:
            self.limits_refused = float(retry_after_header(wait))
            return self.answer_error(429, "too many requests", retry_after=retry_after_header(wait))
        self.admitted()

    def admitted(self) -> None:
        """The request may start: it counts from now (the drain, its key) and goes."""
        self.runtime.begin(self)
        self._enter(Phase.FORWARDING)
        self.forward()

    def forward(self, waiting: bool = False) -> bool:
        """Send the request to a host not tried (§Choosing a host), or wait for room (a
        ``waiting`` request stays queued), or answer that none is left. True once out of the queue."""
        assert self.route is not None
        runtime = self.runtime
        verdict = runtime.choose(self.route, self.model, self.head.peeked.affinity_key, self.tried,
                                 self.tally.queued_at)  # §Where models live: placement, loads counted
        if verdict is Verdict.BUSY:
            if not waiting:
                self.enqueue()
            return False
        self.leave_queue()
        if isinstance(verdict, Chosen):
            self.dispatch(verdict)
        else:
            self.carry_out(decide(verdict, None, self.tried))
        return True

    def dispatch(self, chosen: Chosen) -> None:
        """Send the request to ``chosen.host`` on a new :class:`~crossbar.proxy.leg.Leg` (rules 6-7),
        once its slot is taken (with ``cluster.redis``, in Redis: §Several crossbars)."""
        self._enter(Phase.FORWARDING)
        leg = self.leg = Leg(self.ctx, self.request, self.head, self.model, self.upstream_query, chosen, self.tally)
        taken = leg.lease.taken
        if taken is None:
            return self.send_leg(chosen)
        taken.addCallback(self.on_taken, leg, chosen)
        taken.addErrback(self.on_bug)

    @acts_in(Phase.FORWARDING)
    def on_taken(self, taken: bool, leg: Leg, chosen: Chosen) -> None:
        """Redis answered for the host's slot: send, or (the fleet has the host full; the
        view now knows it) choose again, which may wait in the queue."""
        if leg is not self.leg:
            return
        if taken:
            return self.send_leg(chosen)
        leg.release()
        self.leg = None
        self.forward()

    def send_leg(self, chosen: Chosen) -> None:
        """The slot at ``chosen.host`` is this request's: send it there."""
        assert self.route is not None and self.leg is not None
        if not self.tried:
            self.runtime.count_affinity(self.route.name, chosen.affinity)
        self.tally.chose(chosen, failover=bool(self.tried))
        sent = self.leg.send()
        sent.addCallbacks(self.on_answer, self.on_attempt_failed)
        sent.addErrback(self.on_bug)

    def enqueue(self) -> None:
        """No host has room: wait in the route's queue, or 503 at once (:meth:`QueuePlace.join`)."""
        assert self.route is not None
        if self.place is None:
            self.place = QueuePlace(self.runtime.queues, self.clock, self.tally, self.retry, self.on_queue_timeout)
        refusal = self.place.join(self.route, preflight=bool(self.route.keys) and not self.key)
        if refusal is not None:
            return self.queue_refused(refusal)
        self._enter(Phase.QUEUED)

    def queue_refused(self, refusal: str) -> None:
        """The request may not wait (``refusal``: :func:`~crossbar.proxy.policy.queue_refusal`'s 503 message)."""
        self.answer_error(503, refusal, retry_after=True)

    def retry(self) -> bool:
        """Room may have freed (the queue's call; True once out of it), under a reloaded config if any."""
        if self.phase is not Phase.QUEUED:
            return True
        current = self.runtime.config
        if current is not self.config and self.route_name in current.routes:
            self.head = self.head.under(current)
        return self.forward(waiting=True)

    @acts_in(Phase.QUEUED)
    def on_queue_timeout(self) -> None:
        """``queue.timeout`` passed without room: 503 with ``Retry-After``."""
        self.answer_error(503, "all hosts busy", retry_after=True)

    def leave_queue(self) -> None:
        """Out of the queue, if in it (dispatched, answered or gone)."""
        if self.place is not None:
            self.place.leave()

    @acts_in(Phase.FORWARDING)
    def on_attempt_failed(self, failure: Failure) -> None:
        """Rule 7 before the head; a cancel is ours (the client left, a drain), not the host's."""
        if not failure.check(CancelledError):
            failure.trap(UpstreamFailed)
            failed = failure.value
            assert isinstance(failed, UpstreamFailed)
            host = self.host
            alive = failed.sent_at is not None and self.runtime.table.alive_since(host, failed.sent_at)
            self.carry_out(decide(failed.kind, host, self.tried, alive), failed.kind.value, failed.reason)

    def carry_out(self, decision: Decision, kind: str = "", reason: str = "") -> None:
        """Do what rule 7 decided about a failure of ``kind`` (``reason`` says what)."""
        host = self.host
        if decision.mark_down and self.ctx.mark_down(host, reason, self.config):
            self.tally.marked_down(host, kind)
        if decision.action is Action.FAIL_OVER:
            self.release_host()
            self.tried.append(host)
            self.forward()
        elif decision.action is Action.ANSWER:
            self.answer_error(decision.code, decision.message, host=decision.host)
        elif decision.action is Action.ABORT_CLIENT:
            self.tally.cut()
            self.abort_client()
        elif decision.action is Action.FINISH:
            self.request.unregisterProducer()
            self.request.finish()
            self.end()

    @acts_in(Phase.FORWARDING)
    def on_answer(self, answer: Answer) -> None:
        """The host's head arrived: send it to the client at once, then relay the body (rule 6)."""
        assert self.leg is not None
        self._enter(Phase.RELAYING)
        relay = self.relay = self.leg.relay_answer(answer, self.on_relay_end)
        relay.start(answer.response)

    @called_directly
    def on_relay_end(self, how: RelayEnd) -> None:
        """Rule 7 after the head: a clean end finishes; a dead or silent host is cut."""
        assert self.relay is not None
        relaying = self.phase is Phase.RELAYING
        self.tally.relayed(self.relay, complete=how is RelayEnd.COMPLETE and relaying)
        if relaying:
            if how is RelayEnd.CLIENT_STALL:  # the client's doing (rule 8): like one that left
                self.tally.client_left()
            self.carry_out(decide(how, self.host, self.tried), how.value, self.relay.reason)

    @called_directly
    @acts_in(*LIVE)
    def on_client_gone(self, reason: Failure | None) -> None:
        """The client left before the end (the request's ``on_lost``): cancel upstream;
        after the last byte of a complete answer (``[DONE]``) it is recorded as a clean
        end (rule 8)."""
        relay = self.relay
        complete = relay is not None and relay.delivered_complete()
        if not complete:
            self.tally.client_left()
        self.leave_queue()
        self.stop_upstream()
        if complete and relay is not None:
            self.tally.relayed(relay, complete=True)
        self.end()

    @acts_in(*LIVE)
    def abort(self, why: str) -> None:
        """Abort this exchange from outside (the end of a drain's grace)."""
        _log.info("aborting {method} {path}: {why}", method=self.head.method.decode("latin-1"),
                  path=self.head.path.decode("latin-1"), why=why)
        if self.phase is Phase.QUEUED:
            self.leave_queue()
            return self.answer_error(503, why)
        self.tally.ended = "cut"
        self.stop_upstream()
        self.abort_client()

    def stop_upstream(self) -> None:
        """Cancel the upstream request or stop relaying its body, whichever is under way."""
        if self.leg is not None:
            self.leg.stop()

    @acts_in(*LIVE)
    def abort_client(self) -> None:
        """End the client's connection so it sees a truncated answer, never a clean end."""
        if self.relay is not None:
            self.request.unregisterProducer()
        self.end()
        abort_connection(self.request)

    @acts_in(*LIVE)
    def answer_error(self, code: int, message: str, retry_after: bool | int = False, host: str | None = None) -> None:
        """Answer crossbar's own JSON error (rule 9, :func:`~crossbar.proxy.client.error_body`) and end."""
        self.answer(code, error_body(self.request, code, message, host), retry_after)

    def answer(self, code: int, body: bytes, retry_after: bool | int = False) -> None:
        """Answer ``code`` with the JSON ``body`` and end; ``retry_after``: ``Retry-After: 1``
        (busy) or that many seconds; every 503 has one (rule 10: retries back off)."""
        self.tally.answered(code)
        for name, value in key_limit_headers(self.runtime.limits, self.route, self.key, self.limits_refused):  # §Access
            self.request.setHeader(name, value)
        self.tally.bytes = write_json(self.request, code, body, retry_after or code == 503, self.runtime.draining)
        self.end()

    def end(self) -> None:
        """Once: write the record (rule 8), stop counting it (the drain, its key), then free
        the host's slot (which may dispatch another)."""
        if self.phase is Phase.ENDED:
            return
        self._enter(Phase.ENDED)
        if self.relay is not None:
            self.tally.first_byte_at = self.relay.first_byte_at
        self.tally.spend(self.runtime.spend)
        self.tally.write(self.runtime.table.get)
        self.runtime.end(self)  # its key stops counting before the freed slot is offered (fair order)
        self.release_host()

    def release_host(self) -> None:
        """Stop counting this request as in flight to its host (idempotent)."""
        if self.leg is not None:
            self.leg.release()

    def on_bug(self, failure: Failure) -> None:
        """Last resort: a bug in crossbar must not leave the client hanging."""
        _log.failure("proxying failed", failure=failure)
        if self.phase is not Phase.ENDED:
            self.stop_upstream()
            if self.request.startedWriting:
                self.tally.ended = "cut"
                self.abort_client()
            else:
                self.answer_error(500, "internal error")
