"""One request's sequence through the proxy (docs/design.md §The proxy).

Each request is one :class:`Exchange`, moving through the phases of :mod:`crossbar.proxy.phase`.
It only sequences; the rules live in :mod:`~crossbar.proxy.head` (1-4, §Model names),
:func:`crossbar.hosts.balance.choose` and :mod:`~crossbar.proxy.place` (5),
:mod:`~crossbar.proxy.leg` (one try at one host: its slot, the request, the relay; 6),
:mod:`~crossbar.proxy.policy` (7), :mod:`~crossbar.proxy.tally` (8, written before the
host's slot is freed) and :mod:`~crossbar.proxy.modellist` (10). It never reads or keeps a body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisted.internet.defer import CancelledError
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import Request

from crossbar.config import Config, Route
from crossbar.hosts.balance import Chosen, Verdict, choose
from crossbar.ops.record import NO_ROUTE
from crossbar.paths import PathKind
from crossbar.proxy.attempt import Answer, UpstreamFailed
from crossbar.proxy.client import abort_connection, error_body, write_json
from crossbar.proxy.head import Refusal, RequestHead, check_path, wanted_model
from crossbar.proxy.leg import Leg
from crossbar.proxy.modellist import models_body
from crossbar.proxy.phase import LIVE, Phase, Phased, acts_in
from crossbar.proxy.place import QueuePlace
from crossbar.proxy.policy import Action, Decision, decide
from crossbar.proxy.ratelimit import key_limit_headers
from crossbar.proxy.relay import Relay, RelayEnd
from crossbar.proxy.tally import Tally
from crossbar.state.limits import retry_after_header

if TYPE_CHECKING:
    from crossbar.proxy.resource import ProxyResource

__all__ = ["Exchange"]

_log = Logger(namespace="crossbar.proxy")


class Exchange(Phased):
    """One proxied request, from ``render`` to its record (docs/design.md §The proxy).

    :param head: the request's head, checked under the config current when it was complete;
        the request is served under it (one waiting in a queue adopts a reloaded config).
    """

    def __init__(self, proxy: ProxyResource, request: Request, head: RequestHead) -> None:
        super().__init__()
        self.proxy, self.request, self.head, self.key = proxy, request, head, head.key
        self.runtime, self.clock = proxy.runtime, proxy.clock
        self.config: Config = head.config
        self.route: Route | None = head.route
        self.model: str | None = None
        self.query = head.query
        self.tally = Tally(head, proxy.requests, self.clock.seconds)
        self.tried: list[str] = []
        self.leg: Leg | None = None
        self.relay: Relay | None = None  # the answer's body, once its head went to the client
        self.place: QueuePlace | None = None

    @property
    def route_name(self) -> str:
        """The route's name (for the runtime's per-key counts)."""
        return NO_ROUTE if self.route is None else self.route.name

    def start(self) -> None:
        """Rules 1-3 (:func:`~crossbar.proxy.head.check_path`), rule 10, a key's
        ``max_inflight`` and limits (429, §Access), then forward."""
        self.request.notifyFinish().addErrback(self.on_client_gone)
        head = self.head
        checked = check_path(head)
        if isinstance(checked, Refusal):
            return self.answer_error(checked.code, checked.message)
        assert self.route is not None
        if checked is PathKind.MODEL_LIST:
            body = models_body(self.route, self.runtime.table.all())
            return self.answer_error(503, "no healthy host") if body is None else self.answer(200, body)
        self.model, self.query = wanted_model(head, self.route)
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
        """The key's limits answered: 429 with ``Retry-After`` (when the window allows one), or go on."""
        if wait > 0:
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
        verdict = choose(self.route, self.config.hosts, runtime.table.all(), runtime.inflight.host, self.model,
                         self.head.peeked.affinity_key, runtime.rotation, exclude=self.tried,
                         draining=runtime.drained)
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
        """Send the request to ``chosen.host`` on a new :class:`~crossbar.proxy.leg.Leg` (rules 6-7)."""
        assert self.route is not None
        self._enter(Phase.FORWARDING)
        if not self.tried:
            self.runtime.count_affinity(self.route.name, chosen.affinity)
        self.tally.chose(chosen, failover=bool(self.tried))
        self.leg = Leg(self, chosen)
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
            return self.answer_error(503, refusal, retry_after=True)
        self._enter(Phase.QUEUED)

    def retry(self) -> bool:
        """Room may have freed (the queue's call; True once out of it), under a reloaded config if any."""
        if self.phase is not Phase.QUEUED:
            return True
        current = self.runtime.config
        if current is not self.config and self.route_name in current.routes:
            self.config, self.route = current, current.routes[self.route_name]
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
        assert self.leg is not None
        self.leg.attempt = None
        if not failure.check(CancelledError):
            failure.trap(UpstreamFailed)
            failed = failure.value
            assert isinstance(failed, UpstreamFailed)
            host = self.tally.host
            alive = failed.sent_at is not None and self.runtime.table.alive_since(host, failed.sent_at)
            self.carry_out(decide(failed.kind, host, self.tried, alive), failed.kind.value, failed.reason)

    def carry_out(self, decision: Decision, kind: str = "", reason: str = "") -> None:
        """Do what rule 7 decided about a failure of ``kind`` (``reason`` says what)."""
        host = self.tally.host
        if decision.mark_down and self.proxy.mark_down(host, reason, self.config):
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
        relay = self.relay = self.leg.relay_answer(answer)
        relay.ended.addCallback(self.on_relay_end)
        relay.ended.addErrback(self.on_bug)
        relay.start(answer.response)

    def on_relay_end(self, how: RelayEnd) -> None:
        """Rule 7 after the head: a clean end finishes; a dead or silent host is cut."""
        assert self.relay is not None
        relaying = self.phase is Phase.RELAYING
        self.tally.relayed(self.relay, complete=how is RelayEnd.COMPLETE and relaying)
        if relaying:
            if how is RelayEnd.CLIENT_STALL:  # the client's doing (rule 8): like one that left
                self.tally.client_left()
            self.carry_out(decide(how, self.tally.host, self.tried), how.value, self.relay.reason)

    @acts_in(*LIVE)
    def on_client_gone(self, reason: Failure | None) -> None:
        """The client left before the end: cancel upstream; after the last byte of a complete
        answer (``[DONE]``) it is recorded as a clean end (rule 8)."""
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
        for name, value in key_limit_headers(self.runtime.limits, self.route, self.key):  # §Access
            self.request.setHeader(name, value)
        self.tally.bytes = write_json(self.request, code, body, retry_after or code == 503, self.runtime.draining)
        self.end()

    def end(self) -> None:
        """Once: write the record (rule 8), stop counting it (the drain, its key), then free
        the host's slot (which may dispatch another)."""
        if self._enter(Phase.ENDED):
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
