"""One try of a request at one host: its slot, the request sent, the answer relayed
(docs/design.md §The proxy, rules 5-7).

A :class:`Leg` is what an :class:`~crossbar.proxy.exchange.Exchange` holds while a host
has its request: the host's in-flight slot (a :class:`~crossbar.state.inflight.Lease`),
the :class:`~crossbar.proxy.attempt.Attempt` until the answer's head, then the
:class:`~crossbar.proxy.relay.Relay` of its body. It does the mechanics; what each
outcome means (rule 7) is the exchange's. A failover makes a new leg for the next host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisted.internet.defer import Deferred

from crossbar.hosts.balance import Chosen
from crossbar.proxy.attempt import Answer, Attempt
from crossbar.proxy.client import forwarded_headers, write_head
from crossbar.proxy.head import upstream_body
from crossbar.proxy.headers import content_type, is_event_stream
from crossbar.proxy.ratelimit import key_limit_headers
from crossbar.proxy.relay import Relay
from crossbar.upstream.hosturl import host_url

if TYPE_CHECKING:
    from crossbar.proxy.exchange import Exchange

__all__ = ["Leg"]


class Leg:
    """``exchange``'s try at ``chosen.host``; it holds the host's slot from now until
    :meth:`release` (idempotent).

    :ivar host: the host's name.
    :ivar attempt: the request under way until the answer's head (or a failure), else None.
    :ivar relay: the answer's body relay once its head went to the client, else None.
    """

    def __init__(self, exchange: Exchange, chosen: Chosen) -> None:
        self.exchange = exchange
        self.host = chosen.host
        assert exchange.route is not None
        self.lease = exchange.runtime.inflight.enter(exchange.route.name, chosen.host)
        self.attempt: Deferred[Answer] | None = None
        self.relay: Relay | None = None

    def send(self) -> Deferred[Answer]:
        """Send the request (rule 6: the forwarded headers, the body as
        :func:`~crossbar.proxy.head.upstream_body` gives it for this host); fires with the
        answer's head or fails with :class:`~crossbar.proxy.attempt.UpstreamFailed`
        (rule 7, ``timeouts.first_byte``)."""
        ex, name = self.exchange, self.host
        assert ex.route is not None
        host, head, runtime = ex.config.hosts[name], ex.head, ex.runtime
        headers = forwarded_headers(ex.request, bool(ex.route.keys), host.api_key, ex.key)
        body = upstream_body(head, ex.model, lambda: runtime.table.is_router(name))
        target = host_url(host.url).target(head.rest + ex.query)
        self.attempt = Attempt(ex.proxy.pools, ex.clock, head.method, target, headers, body,
                               ex.config.timeouts.first_byte).start()
        return self.attempt

    def relay_answer(self, answer: Answer) -> Relay:
        """The answer's head goes to the client at once, its body follows through the
        returned relay (rule 6); the host counts as alive (rule 7)."""
        ex, host = self.exchange, self.host
        self.attempt = None
        table, timeouts, tally = ex.runtime.table, ex.config.timeouts, ex.tally
        table.seen[host] = ex.clock.seconds()
        tally.answered(answer.response.code, answer.sent_at)
        write_head(ex.request, answer.response, host, ex.runtime.draining,
                   key_limit_headers(ex.runtime.limits, ex.route, ex.key))
        answer_type = content_type(ex.request.responseHeaders)
        tally.streamed = is_event_stream(answer_type)
        relay = self.relay = Relay(ex.request, ex.clock, timeouts.idle, timeouts.client_stall, host, table.seen,
                                   answer_type)
        return relay

    def stop(self) -> None:
        """Cancel the request, or stop relaying its answer, whichever is under way."""
        attempt, self.attempt = self.attempt, None
        if attempt is not None:
            attempt.cancel()
        if self.relay is not None:
            self.relay.stop()
            self.exchange.tally.relayed(self.relay, complete=False)

    def release(self) -> None:
        """Free the host's slot (:meth:`~crossbar.state.inflight.Lease.release` is idempotent)."""
        self.lease.release()
