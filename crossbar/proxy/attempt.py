"""One upstream request to one chosen host (docs/design.md §The proxy, rules 6-7).

An :class:`Attempt` sends the request, retries it once on a fresh connection to the same
host when a reused pooled connection closes or resets before any byte of the answer (the
host dropped an idle connection as the request reached it: HAProxy's ``empty-response``,
Go's "server closed idle connection"; llama-server cancels the work of a connection that
closed, so the host never works twice; rule 7; the pool itself retires connections
before the host's keep-alive timeout and never hands out one it can see closed,
:class:`crossbar.upstream.h1client.H1Pool`), and bounds the wait for the
response head by ``timeouts.first_byte``. Its Deferred fires with an :class:`Answer`
(the response head and when the request was sent) or fails with
:class:`UpstreamFailed`, classified by :class:`FailureKind`, so the exchange's policy
(mark down, fail over, 502, 504) is one decision on one value. Cancelling the Deferred
cancels the upstream request (the client left).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import (  # type: ignore[attr-defined]  # re-exported by twisted.web.client
    RequestNotSent,
    RequestTransmissionFailed,
    ResponseNeverReceived,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse
from zope.interface import implementer

from crossbar.upstream.failures import describe_failure
from crossbar.upstream.h1client import INLINE_BODY, HeaderPairs, IInlineBody
from crossbar.upstream.tls import tls_failure_reason
from crossbar.upstream.pools import ConnectTracker, UpstreamPools

__all__ = ["Answer", "Attempt", "FailureKind", "UpstreamFailed"]

_log = Logger(namespace="crossbar.proxy")

_NO_ANSWER = (RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived)
"""How Twisted's client (and :mod:`crossbar.upstream.h1client`) says a connection was lost
before any byte of the answer: before the request was written, while writing it, or after."""


class FailureKind(Enum):
    """How an attempt failed; each kind has one rule-7 answer."""

    CONNECT = "connect"
    """No connection could be opened: mark down, choose another host."""
    REQUEST = "request"
    """The host failed after the request was sent, before the head: mark down, 502."""
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    """No head within ``timeouts.first_byte``: 504; mark down only if the host showed
    no other sign of life meanwhile."""


class UpstreamFailed(Exception):
    """An attempt failed: ``kind`` says how, ``reason`` is a one-line description
    (for ``last_err`` and the log), ``sent_at`` the clock seconds the request was sent
    (for a ``FIRST_BYTE_TIMEOUT``: signs of life after it spare the host), else None."""

    def __init__(self, kind: FailureKind, reason: str, sent_at: float | None = None) -> None:
        super().__init__(f"{kind.value}: {reason}")
        self.kind = kind
        self.reason = reason
        self.sent_at = sent_at


class Answer(NamedTuple):
    """The host's response head (one per request: a named tuple, cheaper to make than a
    frozen dataclass).

    :ivar response: the response (its body not read yet).
    :ivar sent_at: reactor seconds when the request (body included) was handed to the
        connection: time to first byte counts from here (docs/design.md §Configuration).
    """

    response: IResponse
    sent_at: float


@implementer(IInlineBody)
class BytesProducer:
    """A request body held in memory, written to the upstream connection in slices.

    A body of at most :attr:`SLICE` bytes is written at once, with the request head
    (no Cooperator tick as with FileBodyProducer). A longer one (a chat request carrying
    an image: up to 16 MiB) is written :attr:`SLICE` bytes at a time, the next slice
    when the transport asks for more (``resumeProducing``: Twisted registers the body
    producer as a streaming producer of the connection). Written at once, Twisted would
    join the head and the whole body into one new buffer in a single reactor turn
    (measured: 2.5-8 ms for 15 MiB, every other stream stalled that long; bench (h),
    docs/design.md §"Quality bar"); in slices no reactor turn copies more than a slice.

    :param body: the whole body, as one ``bytes`` or as the chunks it arrived in (a
        sequence of ``bytes``: never joined into one buffer, docs/design.md §Quality bar).
    """

    SLICE = INLINE_BODY
    """Bytes written per slice (a body of at most this is written at once:
    :class:`crossbar.upstream.h1client.IInlineBody`)."""

    def __init__(self, body: bytes | Sequence[bytes]) -> None:
        self._pieces: list[bytes] = [body] if isinstance(body, bytes) else [p for p in body if p]
        self.length = sum(len(p) for p in self._pieces)
        self._index = 0
        self._offset = 0
        self._paused = False
        self._consumer: Any = None
        self._done: Deferred[None] | None = None

    def startProducing(self, consumer: Any) -> Deferred[None]:
        """Write the body to ``consumer`` (an ``IConsumer``); the Deferred fires once
        all of it was handed to the consumer, and never after :meth:`stopProducing`."""
        if self.length <= self.SLICE:
            consumer.write(self.inline())
            return succeed(None)
        self._consumer = consumer
        done: Deferred[None] = Deferred(lambda _: self.stopProducing())
        self._done = done
        self._produce()
        return done

    def inline(self) -> bytes:
        """The whole body (for one of at most :attr:`SLICE` bytes: the client sends it
        with the request head, without :meth:`startProducing`)."""
        return b"".join(self._pieces)

    def _next_slice(self) -> bytes:
        """Up to :attr:`SLICE` bytes from where the body stands (copies at most that)."""
        out: list[bytes] = []
        size = 0
        pieces = self._pieces
        while size < self.SLICE and self._index < len(pieces):
            piece = pieces[self._index]
            want = self.SLICE - size
            if self._offset == 0 and len(piece) <= want:
                part = piece
            else:
                part = piece[self._offset:self._offset + want]
            out.append(part)
            size += len(part)
            self._offset += len(part)
            if self._offset >= len(piece):
                self._index += 1
                self._offset = 0
        return out[0] if len(out) == 1 else b"".join(out)

    def _produce(self) -> None:
        while not self._paused and self._consumer is not None and self._index < len(self._pieces):
            self._consumer.write(self._next_slice())  # may call pauseProducing before it returns
        if self._index >= len(self._pieces) and self._done is not None:
            done, self._done, self._consumer = self._done, None, None
            done.callback(None)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._produce()

    def stopProducing(self) -> None:
        self._consumer = None
        self._done = None


class Attempt:
    """Send ``method url`` with ``headers`` and ``body`` to one host.

    :param pools: where connections come from.
    :param clock: the reactor (timeouts run on it).
    :param method: the request method.
    :param url: the absolute upstream URL (bytes).
    :param headers: the headers to send.
    :param body: the body (bytes, or the chunks it arrived in), or None for none.
    :param first_byte_timeout: seconds to wait for the response head after sending.
    """

    def __init__(
        self,
        pools: UpstreamPools,
        clock: IReactorTime,
        method: bytes,
        url: bytes,
        headers: Headers | HeaderPairs,
        body: bytes | Sequence[bytes] | None,
        first_byte_timeout: float,
    ) -> None:
        self._pools = pools
        self._clock = clock
        self._method = method
        self._url = url
        self._headers = headers
        self._body = body
        self._timeout = first_byte_timeout
        self._current: Deferred[IResponse] | None = None
        self._cancelled = False
        self._requested = 0.0
        self._timer: IDelayedCall | None = None  # the first-byte timeout of the current try
        self._late = False  # that timeout passed: whatever the try gives is a timeout
        self.result: Deferred[Answer] = Deferred(self._cancel)

    def start(self) -> Deferred[Answer]:
        """Send the request; returns :attr:`result`."""
        self._send(fresh=False)
        return self.result

    def _send(self, fresh: bool) -> None:
        agent, tracker = self._pools.agent(fresh=fresh)
        producer = None if self._body is None else BytesProducer(self._body)
        requested = self._requested = self._clock.seconds()
        d = agent.request(self._method, self._url, self._headers, producer)
        self._current = d
        # The first-byte timeout as Deferred.addTimeout keeps it, without its two links
        # in the callback chain: it cancels the try, which then counts as a timeout.
        self._timer = self._clock.callLater(self._timeout, self._time_out, d)
        d.addCallbacks(self._answered, self._failed, callbackArgs=(tracker, requested),
                       errbackArgs=(tracker, fresh))

    def _time_out(self, d: Deferred[IResponse]) -> None:
        """No head within the first-byte timeout: cancel the try (it then fails, or
        hands over a head that won the race, and either becomes the timeout)."""
        self._timer = None
        self._late = True
        d.cancel()

    def _settled(self) -> None:
        """The current try gave its result: its timeout no longer runs."""
        self._current = None
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _timeout_failure(self) -> Failure:
        return Failure(UpstreamFailed(FailureKind.FIRST_BYTE_TIMEOUT, f"no response headers within {self._timeout:g}s",
                                      sent_at=self._requested))

    def _answered(self, response: IResponse, tracker: ConnectTracker, requested: float) -> None:
        if self._late:  # the head won the race with the timeout's cancel
            response.deliverBody(_Discard())  # nobody reads it: close its connection
            return self._failed(self._timeout_failure(), tracker, False)
        self._settled()
        if self._cancelled:  # nobody wants the body
            response.deliverBody(_Discard())
            return
        sent_at = tracker.connected_at if tracker.connected_at is not None else requested
        self.result.callback(Answer(response, sent_at))

    def _failed(self, failure: Failure, tracker: ConnectTracker, fresh: bool) -> None:
        if self._late:  # cancelled by the timeout, whatever the agent says of it
            failure = self._timeout_failure()
        self._settled()
        if self._cancelled:
            return  # cancelled by the exchange: says nothing about the host
        if failure.check(UpstreamFailed):
            self.result.errback(failure)
        elif fresh:  # the host may have received the request the first time: 502, never another host
            reason = f"request failed: {describe_failure(failure)} (on a fresh connection, after a stale one)"
            self.result.errback(UpstreamFailed(FailureKind.REQUEST, reason))
        elif tracker.connect_failure is not None:
            reason = f"connect: {describe_failure(tracker.connect_failure)}"
            self.result.errback(UpstreamFailed(FailureKind.CONNECT, reason))
        elif tls_failure_reason(failure) is not None:
            # TLS 1.3: a host that refuses our client certificate says so after the
            # handshake, before any answer: still a connect failure (rule 7, §Access).
            self.result.errback(UpstreamFailed(FailureKind.CONNECT, f"connect: {describe_failure(failure)}"))
        elif self._is_stale(failure, tracker):
            _log.debug("retrying {url} on a fresh connection", url=self._url.decode("latin-1"))
            self._send(fresh=True)
        else:
            reason = f"request failed: {describe_failure(failure)}"
            self.result.errback(UpstreamFailed(FailureKind.REQUEST, reason))

    def _is_stale(self, failure: Failure, tracker: ConnectTracker) -> bool:
        """Rule 7: the first try went out on a reused pooled connection (no new
        connection was opened) and that connection closed or reset before any byte of
        the answer (:data:`_NO_ANSWER`): retried once on a fresh connection, marking
        nothing down. A connection that sent part of an answer (``ResponseFailed``), or
        one opened for this request, is the host's failure."""
        return tracker.connects == 0 and failure.check(*_NO_ANSWER) is not None

    def _cancel(self, d: Deferred[Answer]) -> None:
        self._cancelled = True  # result then fails with CancelledError
        current, self._current = self._current, None
        if current is not None:
            current.cancel()


class _Discard(Protocol):
    """Drops an upstream body nobody wants and closes its connection."""

    def makeConnection(self, transport: Any) -> None:
        transport.stopProducing()
