"""One try of a request at one host: its slot, the request sent, the answer relayed
(docs/design.md §The proxy, rules 5-7).

A :class:`Leg` is what an :class:`~crossbar.proxy.exchange.Exchange` holds while a host
has its request: the host's in-flight slot (a :class:`~crossbar.state.inflight.Lease`),
the :class:`~crossbar.proxy.attempt.Attempt` until the answer's head, then the
:class:`~crossbar.proxy.relay.Relay` of its body. It is made with what it serves (the
head, the model, the query) and the :class:`~crossbar.proxy.context.ProxyContext`, and
reports through the Deferred of :meth:`Leg.send`; what each outcome means (rule 7) is
the exchange's. A failover makes a new leg for the next host.
"""

from __future__ import annotations

from typing import Callable

from twisted.internet.defer import Deferred
from twisted.web.server import Request

from crossbar.hosts.balance import Chosen, limit_in_force
from crossbar.proxy.attempt import Answer, Attempt
from crossbar.proxy.client import forwarded_headers, write_head
from crossbar.proxy.context import ProxyContext
from crossbar.proxy.head import RequestHead, upstream_body
from crossbar.proxy.headers import content_type, is_event_stream
from crossbar.proxy.ratelimit import key_limit_headers
from crossbar.proxy.relay import Relay, RelayEnd
from crossbar.proxy.tally import Tally

__all__ = ["Leg"]


class Leg:
    """A try at ``chosen.host`` of the request ``request`` (whose head is ``head``,
    wanting ``model``, with the upstream ``query``); it holds the host's slot from now
    until :meth:`release` (idempotent), and counts in ``tally``. With ``cluster.redis``
    the slot may still be being taken in Redis: ``lease.taken``
    (:class:`~crossbar.state.inflight.Lease`).

    :ivar host: the host's name.
    :ivar attempt: the request's Deferred (:meth:`send`), else None; cancelling it once it
        fired (the answer's head, or a failure) does nothing.
    :ivar relay: the answer's body relay once its head went to the client, else None.
    """

    def __init__(self, ctx: ProxyContext, request: Request, head: RequestHead, model: str | None, query: bytes,
                 chosen: Chosen, tally: Tally) -> None:
        assert head.route is not None
        self.ctx, self.request, self.head, self.model, self.query, self.tally = ctx, request, head, model, query, tally
        self.host = chosen.host
        runtime = ctx.runtime
        limit = limit_in_force(head.config.hosts[chosen.host], runtime.table.get(chosen.host))[0]
        self.lease = runtime.inflight.enter(head.route.name, chosen.host, limit)
        if chosen.model is not None:  # §Where models live: requests in flight per model
            runtime.inflight.use_model(self.lease, chosen.model)
        self.attempt: Deferred[Answer] | None = None
        self.relay: Relay | None = None

    def send(self) -> Deferred[Answer]:
        """Send the request (rule 6: the forwarded headers, the body as
        :func:`~crossbar.proxy.head.upstream_body` gives it for this host); fires with the
        answer's head or fails with :class:`~crossbar.proxy.attempt.UpstreamFailed`
        (rule 7, ``timeouts.first_byte``)."""
        head, name, runtime = self.head, self.host, self.ctx.runtime
        assert head.route is not None
        host = head.config.hosts[name]
        headers = forwarded_headers(self.request, bool(head.route.keys), host.api_key, head.key)
        body = upstream_body(head, self.model, lambda: runtime.table.is_router(name))
        target = host.url.target(head.rest + self.query)
        attempt = self.attempt = Attempt(self.ctx.pools, self.ctx.clock, head.method, target, headers, body,
                                         head.config.timeouts.first_byte).start()
        return attempt

    def relay_answer(self, answer: Answer, on_end: Callable[[RelayEnd], None]) -> Relay:
        """The answer's head goes to the client at once, its body follows through the
        returned relay (rule 6), which calls ``on_end`` when it ended; the host counts as
        alive (rule 7)."""
        ctx, host, tally = self.ctx, self.host, self.tally
        life = ctx.runtime.table.life_sign(host)
        life.at = ctx.clock.seconds()
        tally.answered(answer.response.code, answer.sent_at)
        write_head(self.request, answer.response, host, ctx.runtime.draining,
                   key_limit_headers(ctx.runtime.limits, self.head.route, self.head.key))
        answer_type = content_type(self.request.responseHeaders)
        tally.streamed = is_event_stream(answer_type)
        timeouts = self.head.config.timeouts
        relay = self.relay = Relay(self.request, ctx.clock, timeouts.idle, timeouts.client_stall, life, answer_type,
                                   on_end)
        return relay

    def stop(self) -> None:
        """Cancel the request, or stop relaying its answer, whichever is under way."""
        attempt, self.attempt = self.attempt, None
        if attempt is not None:
            attempt.cancel()
        if self.relay is not None:
            self.relay.stop()
            self.tally.relayed(self.relay, complete=False)

    def release(self) -> None:
        """Free the host's slot (:meth:`~crossbar.state.inflight.Lease.release` is idempotent)."""
        self.lease.release()
