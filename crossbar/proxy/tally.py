"""What one request's record needs, collected while it runs, and its metrics
(docs/design.md §The proxy, rule 8; §Choosing a host, rule 5).

A :class:`Tally` is made when the exchange starts and told what happens -- the host
chosen and why, the queue joined and left, the answer's head and bytes, a host marked
down -- and becomes the one :class:`~crossbar.ops.record.RequestRecord` at the end
(:meth:`Tally.write`). The request's metrics that are not the record's (time in the
queue, mark-downs) are counted here too, so a request's accounting is in one place.
Extra figures for the record (tokens, a client stall) are added here; so is a key's
token spending once an answer's figures are read (``Runtime.spend``, §Access limits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from crossbar.hosts.balance import Chosen
from crossbar.ops.figures import Figures
from crossbar.ops.record import OTHER_MODEL, RequestLog, RequestRecord
from crossbar.proxy.head import RequestHead
from crossbar.proxy.request import NO_BODY_METHODS
from crossbar.proxy.routing import query_model

if TYPE_CHECKING:
    from crossbar.hosts.health import HostStatus
    from crossbar.proxy.relay import Relay

__all__ = ["Tally"]


class Tally:
    """One request's figures (see the module docstring).

    :param head: the request's head (route, method, path for the record).
    :param log: where the record goes; its metrics are the request metrics.
    :param now: reactor seconds.
    :ivar status: the status sent to the client (499: the client left first); 0 until known.
    :ivar bytes: body bytes sent to the client.
    :ivar ttfb: seconds from the request sent to the host to its head, or None.
    :ivar why: why the host was chosen (§Choosing a host, rule 5), or "".
    :ivar host: the host chosen last, or "".
    :ivar queued_at: reactor seconds when the request first joined its queue, or None.
    :ivar queued: seconds spent in the queue so far.
    :ivar ended: how the answer ended (rule 8): ``complete``, ``cut`` or ``client_gone``.
    :ivar figures: what a complete answer said it did (§What the answers say), or None.
    :ivar model: the model the request was chosen for (rule 4), or None.
    :ivar fit: the chosen host's fit tier (``loaded``, ..., ``fallback``), or "".
    :ivar sent_at: reactor seconds the request was sent to the host that answered, or None.
    :ivar first_byte_at: reactor seconds of the answer's first body byte, or None.
    :ivar streamed: the answer was ``text/event-stream``.
    """

    def __init__(self, head: RequestHead, log: RequestLog, now: Callable[[], float]) -> None:
        self.head = head
        self.log = log
        self.now = now
        self.received = now()
        self.status = 0
        self.bytes = 0
        self.ttfb: float | None = None
        self.why = ""
        self.host = ""
        self.queued_at: float | None = None
        self.queued = 0.0
        self._joined = 0.0
        self.ended = "complete"
        self.figures: Figures | None = None
        self.model: str | None = None
        self.fit = ""
        self.sent_at: float | None = None
        self.first_byte_at: float | None = None
        self.streamed = False

    def chose(self, chosen: Chosen, failover: bool) -> None:
        """``chosen`` took the request: the host and why (``fit pick [queued]
        [failover] affinity=...``)."""
        self.host = chosen.host
        fit = self.fit = chosen.fit.value
        why = [p for p in (fit, chosen.load, chosen.pick) if p]  # load: §Where models live, rule 7
        if self.queued_at is not None:
            why.append("queued")
        if failover:
            why.append("failover")
        why.append(f"affinity={chosen.affinity}")
        self.why = " ".join(why)

    def joined_queue(self) -> None:
        """The request waits in its route's queue (the first time counts for the oldest wait)."""
        if self.queued_at is None:
            self.queued_at = self.now()
        self._joined = self.now()

    def left_queue(self, route: str) -> None:
        """The request left ``route``'s queue: its wait counts in the record and the metric."""
        waited = self.now() - self._joined
        self.queued += waited
        self.log.metrics.queue_wait.labels(route).observe(waited)

    def answered(self, status: int, sent_at: float | None = None) -> None:
        """The answer's head went out with ``status``; ``sent_at`` is when the request was
        sent to the host (time to first byte counts from there), None for crossbar's own."""
        self.status = status
        if sent_at is not None:
            self.sent_at = sent_at
            self.ttfb = self.now() - sent_at

    def relayed(self, relay: Relay, complete: bool) -> None:
        """The body bytes ``relay`` sent the client; a ``complete`` answer's figures too
        (§What the answers say)."""
        self.bytes = relay.bytes
        if complete:
            self.figures = relay.figures(self.head.rest)

    def cut(self) -> None:
        """The client's connection is cut mid-answer; a client that had stalled stays
        ``client_gone`` (rule 8)."""
        if self.ended == "complete":
            self.ended = "cut"

    def client_left(self) -> None:
        """The client left before a complete answer: 499 (nginx's "client closed
        request", for the log line only)."""
        self.status, self.ended = 499, "client_gone"

    def spend(self, spend: Callable[[str, str, int], None]) -> None:
        """A keyed request's answer said what it did: its tokens, every prompt token,
        cached or read, and every generated one, count against the key's limits
        (§Access; §"What the answers say") through ``spend(route, key, tokens)``."""
        figures, route, key = self.figures, self.head.route, self.head.key
        if figures is not None and key and route is not None:
            spend(route.name, key, figures.prompt + figures.cached + figures.generated)

    def marked_down(self, host: str, kind: str) -> None:
        """This request took ``host`` out of rotation, for a failure of ``kind``."""
        self.log.metrics.mark_downs.labels(host, kind).inc()

    def model_label(self, statuses: Callable[[str], HostStatus | None]) -> str:
        """The ``model`` label (§What the answers say): the model chosen for when a host
        of the route lists it, else ``other``; never a value only the request named.
        ``statuses``: a host's health-table entry by name."""
        model, route = self.model, self.head.route
        if model is None or route is None:
            return OTHER_MODEL
        if self.fit and self.fit != "fallback":
            return model  # the chosen host lists it
        for name in route.hosts:
            status = statuses(name)
            if status is not None and (model in status.loaded or model in status.loading or model in status.available):
                return model
        return OTHER_MODEL

    def ttft(self) -> float | None:
        """Time to first token of a streamed answer: request sent -> first body byte."""
        if not self.streamed or self.first_byte_at is None or self.sent_at is None:
            return None
        return self.first_byte_at - self.sent_at

    def named(self) -> tuple[str, str]:
        """The model as the client named it (rule 4: the body's, else a GET or HEAD's
        query parameter; "" for none) and the id it is chosen for (an alias resolved, or
        the route's ``default_model``; "" for none), also for a request refused before a
        host was chosen (403, 404): what the dashboard shows, never a label."""
        head = self.head
        named = head.peeked.model
        if named is None and head.method in NO_BODY_METHODS and head.query:
            named = query_model(head.query)
        resolved = self.model
        if resolved is None and named and head.route is not None:
            resolved = head.route.resolve(named)
        return named or "", resolved or ""

    def record(self, model: str = "") -> RequestRecord:
        """The request's record as of now, with the ``model`` label."""
        head = self.head
        named, resolved = self.named()
        return RequestRecord(
            route=head.route_label, host=self.host, method=head.method.decode("latin-1"),
            path=head.rest.decode("latin-1"),
            target=head.path.decode("latin-1"), status=self.status, bytes=self.bytes,
            duration=self.now() - self.received, ttfb=self.ttfb, queued=self.queued, key=head.key, why=self.why,
            ended=self.ended, figures=self.figures, model=model, ttft=self.ttft(), named=named, resolved=resolved,
        )

    def write(self, statuses: Callable[[str], HostStatus | None]) -> None:
        """Write the record (log line and request metrics); once, at the end."""
        self.log.write(self.record(self.model_label(statuses) if self.head.route is not None else ""))
