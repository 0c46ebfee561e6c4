"""One immutable record per answered request, and the one place it becomes a log line
and metrics (docs/design.md §The proxy, rule 8).

Whatever crossbar answers -- a proxied answer, one of its own JSON errors, a 413 for a
body over the limit, a 400 for a request Twisted cannot parse -- ends in exactly one
:class:`RequestRecord` handed to :meth:`RequestLog.write`, which logs it once and counts
it once. Label values come only from the config and fixed sets (:data:`NO_ROUTE`),
never from a request.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from twisted.logger import Logger, LogLevel

from crossbar.ops.emit import emit
from crossbar.ops.figures import Figures
from crossbar.ops.metrics import Metrics, adder, observer
from crossbar.state.tokens import Cells, TokenLedger

__all__ = ["ENDINGS", "NO_ROUTE", "OTHER_MODEL", "RequestLog", "RequestRecord"]

ENDINGS = ("complete", "cut", "client_gone")
"""How an answer ended (docs/design.md §The proxy, rule 8)."""

OTHER_MODEL = "other"
"""The ``model`` label of tokens for a model no host of the route lists."""

NO_ROUTE = "-"
"""The route (and host) label of an answer no configured route applies to: a request
Twisted cannot parse, a missing or unknown route."""

_log = Logger(namespace="crossbar.proxy")
_INFO = LogLevel.info


class _TokenSeries(NamedTuple):
    """What one (route, host, key, model)'s tokens go to, made once: the adders of its
    three ``crossbar_tokens_total`` children, its generation speed histogram's observer
    and its cells in the token ledger (None without a ledger)."""

    prompt: Callable[[float], None]
    cached: Callable[[float], None]
    generated: Callable[[float], None]
    speed: Callable[[float], None]
    cells: Cells | None


class RequestRecord(NamedTuple):
    """What one answered request did: an immutable record, one per request (a named
    tuple: made with keywords it costs ~13k instructions, a frozen dataclass of the same
    fields ~33k, its ``object.__setattr__`` per field).

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
    :ivar why: why the host was chosen (docs/design.md §Choosing a host, rule 5), or "".
    :ivar ended: how the answer ended, one of :data:`ENDINGS`: ``cut`` when the host
        died or went silent mid-answer or a drain's grace ran out, ``client_gone`` when
        the client left (or took no byte for ``timeouts.client_stall``) before the
        answer ended; a client that left after a complete answer's last event: complete.
    :ivar figures: what a complete answer said it did (tokens, speed), or None (an
        answer cut short or without figures counts no tokens).
    :ivar model: the ``model`` label: the model id the request was chosen for when a
        host of its route lists it, else :data:`OTHER_MODEL` ("" where no route
        applies; counted as :data:`OTHER_MODEL`).
    :ivar ttft: streamed answers: seconds from the request sent to the host to the
        first body byte, else None.
    :ivar named: the model as the client named it (the body's top-level ``"model"``,
        or a GET or HEAD's ``model`` query parameter), "" for none: the request's own
        text, for the dashboard only, never a label value.
    :ivar resolved: the model id the request was chosen for (an alias's target, or the
        route's ``default_model`` when it named none), "" where none applies.
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
    ended: str = "complete"
    figures: Figures | None = None
    model: str = ""
    ttft: float | None = None
    named: str = ""
    resolved: str = ""


class RequestLog:
    """Writes each :class:`RequestRecord` as one log event and into ``metrics``.

    The event's text is rendered here with an f-string and logged as ``{line}``
    (the fields stay in the event for structured observers): twisted.logger's
    ``string.Formatter`` is pure Python and cost ~9 us per request with the whole
    template. The metrics' label children are looked up once per label set.
    """

    def __init__(self, metrics: Metrics, tokens: TokenLedger | None = None) -> None:
        self.metrics = metrics
        self.tokens = tokens
        self._ended: dict[tuple[str, str, str], Any] = {}
        self._token_series: dict[tuple[str, str, str, str], _TokenSeries] = {}
        self._requests: dict[tuple[str, str, str, str, str], Callable[[float], None]] = {}
        self._durations: dict[tuple[str, str], tuple[Callable[[float], None], ...]] = {}
        """Per (route, host): the request duration's, time to first byte's and time to
        first token's observers."""
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
        figures = record.figures
        if figures is None:
            tokens_text, tokens, tps = "", None, None
        else:
            prompt, cached, generated, _, tps = figures
            tokens = (prompt, cached, generated)
            # f"{tps:.1f}" is str(round(tps, 1)) for every speed below MAX_SPEED, at a third of the cost
            tokens_text = f" tokens={prompt}+{cached}/{generated} tps={'-' if tps is None else f'{tps:.1f}'}"
        ended_text = "" if record.ended == "complete" else f" ended={record.ended}"
        line = (f"{record.method} {record.target} -> {host} {status} {record.bytes}B{queued} ttfb={ttfb_text} "
                f"{ms}ms{why}{key_text}{tokens_text}{ended_text}")
        # as _log.info("{line}", ...) builds the event: one per request
        emit(_log, _INFO, "{line}", dict(
            line=line,
            route=route, host=host, method=record.method, path=record.path,
            target=record.target, status=status, bytes=record.bytes, ttfb_ms=ttfb_ms, ms=ms,
            queued_ms=round(record.queued * 1000, 1), key=key, why=record.why, ended=record.ended,
            tokens=tokens, tps=tps,
        ))
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
        request_labels = (route, host, str(record.status), record.key, record.ended)
        count = self._requests.get(request_labels)
        if count is None:
            count = self._requests[request_labels] = adder(m.requests.labels(*request_labels))
        count(1)
        observers = self._durations.get((route, host))
        if observers is None:
            observers = self._durations[(route, host)] = (
                observer(m.duration.labels(route, host)), observer(m.ttfb.labels(route, host)),
                observer(m.ttft.labels(route, host)))
        observers[0](record.duration)
        if record.ttfb is not None:
            observers[1](record.ttfb)
        if record.ended != "complete":
            ended_labels = (route, host, record.ended)
            ended = self._ended.get(ended_labels)
            if ended is None:
                ended = self._ended[ended_labels] = m.unfinished.labels(*ended_labels)
            ended.inc()
        if record.ttft is not None:
            observers[2](record.ttft)
        figures = record.figures
        if figures is not None:
            # a complete answer's tokens: the metrics and the ledger behind status (what a
            # client key spent is counted by the exchange, ``Runtime.spend``); inline, once
            # per request
            model = record.model or OTHER_MODEL
            labels = (route, host, record.key, model)
            series = self._token_series.get(labels)
            if series is None:
                series = self._token_series[labels] = _TokenSeries(
                    adder(m.tokens.labels(*labels, "prompt")), adder(m.tokens.labels(*labels, "cached")),
                    adder(m.tokens.labels(*labels, "generated")), observer(m.generation_speed.labels(host, model)),
                    None if self.tokens is None else self.tokens.cells(route, host),
                )
            prompt, cached, generated, _, speed = figures
            if prompt:
                series.prompt(prompt)
            if cached:
                series.cached(cached)
            if generated:
                series.generated(generated)
            if speed is not None:
                series.speed(speed)
            if series.cells is not None and self.tokens is not None:
                self.tokens.add_to(series.cells, prompt, cached, generated)
