"""One immutable record per answered request, and the one place it becomes a log line
and metrics (DESIGN.md §The proxy, rule 8).

Whatever crossbar answers -- a proxied answer, one of its own JSON errors, a 413 for a
body over the limit, a 400 for a request Twisted cannot parse -- ends in exactly one
:class:`RequestRecord` handed to :meth:`RequestLog.write`, which logs it once and counts
it once. Label values come only from the config and fixed sets (:data:`NO_ROUTE`),
never from a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from twisted.logger import Logger

from crossbar.ops.metrics import Metrics

__all__ = ["NO_ROUTE", "RequestLog", "RequestRecord"]

NO_ROUTE = "-"
"""The route (and host) label of an answer no configured route applies to: a request
Twisted cannot parse, a missing or unknown route."""

_log = Logger(namespace="crossbar.proxy")


@dataclass(frozen=True)
class RequestRecord:
    """What one answered request did.

    :ivar route: the configured route, or :data:`NO_ROUTE`.
    :ivar host: the host that answered (or last failed), or "" for none.
    :ivar key: the name of the client key used ("" where none applies).
    :ivar method: the request method, as sent (latin-1).
    :ivar path: the upstream path (the rest after the route), never the query string.
    :ivar target: the request path as received (route included), never the query.
    :ivar status: the status sent to the client (499: the client left first).
    :ivar bytes: body bytes sent to the client.
    :ivar queued: seconds spent waiting for a host with room.
    :ivar ttfb: seconds from the request sent to the host to its response head, or
        None when no head arrived.
    :ivar duration: seconds from the request received to the answer ended.
    :ivar why: why the host was chosen (DESIGN.md §Choosing a host, rule 5), or "".
    """

    route: str
    host: str
    method: str
    path: str
    target: str
    status: int
    bytes: int
    duration: float
    ttfb: float | None = None
    queued: float = 0.0
    key: str = ""
    why: str = ""


class RequestLog:
    """Writes each :class:`RequestRecord` as one log event and into ``metrics``.

    The event's text is rendered here with an f-string and logged as ``{line}``
    (the fields stay in the event for structured observers): twisted.logger's
    ``string.Formatter`` is pure Python and cost ~9 us per request with the whole
    template (issue 14). The metrics' label children are looked up once per label set.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._requests: dict[tuple[str, str, str, str], Any] = {}
        self._durations: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._metric_failures = 0
        self.observers: list[Callable[[RequestRecord], None]] = []
        """Called with every record after it is logged and counted (the dashboard's
        bounded ring of recent requests, :mod:`crossbar.ops.recent`); each must be cheap
        and must not raise."""

    def write(self, record: RequestRecord) -> None:
        """Log ``record`` (namespace ``crossbar.proxy.exchange``) and count it in the request
        metrics; never raises for a well-formed record (metrics that cannot be written,
        e.g. their multiprocess files removed under a worker, are logged, not raised)."""
        route, status, key = record.route, record.status, record.key
        host = record.host or NO_ROUTE
        ms = round(record.duration * 1000, 1)
        ttfb_ms = None if record.ttfb is None else round(record.ttfb * 1000, 1)
        why = f" ({record.why})" if record.why else ""
        key_text = f" key={key}" if key else ""
        ttfb_text = "-" if ttfb_ms is None else f"{ttfb_ms}ms"
        queued = f" queued={round(record.queued * 1000, 1)}ms" if record.queued else ""
        line = (f"{record.method} {record.target} -> {host} {status} {record.bytes}B{queued} ttfb={ttfb_text} "
                f"{ms}ms{why}{key_text}")
        _log.info(
            "{line}", line=line,
            route=route, host=host, method=record.method, path=record.path,
            target=record.target, status=status, bytes=record.bytes, ttfb_ms=ttfb_ms, ms=ms,
            queued_ms=round(record.queued * 1000, 1), key=key, why=record.why,
        )
        try:
            self._count(record, route, host)
        except OSError as e:
            self._metric_failures += 1
            if self._metric_failures in (1, 10, 100) or self._metric_failures % 1000 == 0:
                _log.error("request metrics not recorded ({count} so far): {error}",
                           count=self._metric_failures, error=str(e))
        for observe in self.observers:
            observe(record)

    def _count(self, record: RequestRecord, route: str, host: str) -> None:
        m = self.metrics
        labels = (route, host, str(record.status), record.key)
        counter = self._requests.get(labels)
        if counter is None:
            counter = self._requests[labels] = m.requests.labels(*labels)
        counter.inc()
        histograms = self._durations.get((route, host))
        if histograms is None:
            histograms = self._durations[(route, host)] = (m.duration.labels(route, host), m.ttfb.labels(route, host))
        histograms[0].observe(record.duration)
        if record.ttfb is not None:
            histograms[1].observe(record.ttfb)
