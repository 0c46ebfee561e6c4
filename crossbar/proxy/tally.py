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

from typing import Callable

from crossbar.hosts.balance import Chosen
from crossbar.ops.record import RequestLog, RequestRecord
from crossbar.proxy.head import RequestHead

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

    def chose(self, chosen: Chosen, failover: bool) -> None:
        """``chosen`` took the request: the host and why (``fit pick [queued]
        [failover] affinity=...``)."""
        self.host = chosen.host
        why = [chosen.fit.value] + ([chosen.pick] if chosen.pick else [])
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
            self.ttfb = self.now() - sent_at

    def marked_down(self, host: str, kind: str) -> None:
        """This request took ``host`` out of rotation, for a failure of ``kind``."""
        self.log.metrics.mark_downs.labels(host, kind).inc()

    def record(self) -> RequestRecord:
        """The request's record as of now."""
        head = self.head
        return RequestRecord(
            route=head.route_label, host=self.host, method=head.method.decode("latin-1"),
            path=head.rest.decode("latin-1"),
            target=head.path.decode("latin-1"), status=self.status, bytes=self.bytes,
            duration=self.now() - self.received, ttfb=self.ttfb, queued=self.queued, key=head.key, why=self.why,
        )

    def write(self) -> None:
        """Write the record (log line and request metrics); once, at the end."""
        self.log.write(self.record())
