"""crossbar's HTTP/1.1 client to hosts, for proxied requests and health polls alike,
over ``httptools`` (CPU per event; docs/design.md §Configuration, §The proxy, rules 6-7
and 9; §Quality bar).

Twisted's ``Agent`` decodes every chunked body into a buffer and wraps each call in
several layers (``Agent.request``, the pool, ``HTTP11ClientProtocol``'s stateful
dispatch, ``_ChunkedTransferDecoder``): per request and per streamed event that is the
largest share of the proxy's CPU (bench/HISTORY.md, measured). :class:`H1Agent` speaks
the same ``IAgent`` contract to :class:`crossbar.proxy.attempt.Attempt` with a C parser
(llhttp through ``httptools.HttpResponseParser``) under one small Twisted protocol
(:class:`H1Connection`) and its own persistent pool (:class:`H1Pool`, per ``(scheme,
host, port)``); connections are opened through ``UpstreamEndpoints`` (TLS included),
via the attempt's :class:`crossbar.upstream.pools.ConnectTracker` (for polls:
:class:`crossbar.upstream.pools.PollAgent`).

The answers are :class:`crossbar.upstream.h1answer.H1Response` objects
(``twisted.web.iweb.IResponse``), their heads read and checked by
:class:`crossbar.upstream.h1answer.AnswerHead` (what an answer says: its module doc);
this module holds the connection, the request it writes (:func:`request_head`) and the
pool. Failures are Twisted's exception types, so every rule that reads them holds:

- the connection lost before any answer byte: ``RequestNotSent`` (not written yet),
  ``RequestTransmissionFailed`` (while writing the body) or ``ResponseNeverReceived``
  (after); rule 7 sends a request again on a fresh connection only after the first;
- a head that cannot be parsed, over ``MAX_RESPONSE_HEAD`` bytes, a ``101`` or a
  status outside 100-599: ``ResponseFailed`` (rules 7, 9), the connection aborted;
- a ``Content-Length`` or chunked body cut short: the body protocol's
  ``connectionLost`` gets ``ResponseFailed([reason, BodyTruncated])`` (never
  ``ResponseDone``); a close-delimited body ends with ``PotentialDataLoss`` when the
  host closed cleanly, and is cut short like the others when the connection was reset.

More than ``MAX_RESPONSE_HEAD`` bytes of chunk framing or trailers with no body byte
between them is a broken answer, like an oversized head. A connection goes back to the
pool only after a complete answer that allows it, once the read that completed it is
fully parsed: a byte after the answer (nobody asked for it) drops the connection
instead, so it can never be read as the answer to the next request. An answer that ends
before the request body was all sent aborts the connection (RFC 9112 §9.6): the host
will not read the rest. An idle pooled connection is retired before the host's
advertised keep-alive timeout and never reused once its host closed it
(:class:`H1Pool`, rule 7).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Sequence, cast

import httptools
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.error import ConnectionAborted, ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.web.client import (  # type: ignore[attr-defined]  # re-exported by twisted.web.client
    URI, RequestNotSent, RequestTransmissionFailed, ResponseDone, ResponseFailed, ResponseNeverReceived,
)
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IAgent, IAgentEndpointFactory, IBodyProducer, IResponse
from zope.interface import implementer

from crossbar.upstream.h1answer import (
    MAX_RESPONSE_HEAD, AnswerHead, BodyTruncated, H1Response, ResponseHeadTooLarge, UnrelayableStatus, status_line_cr,
)
from crossbar.upstream.tcp import no_delay
from crossbar.compat.twisted import eager_writes, hold_writes, release_writes

__all__ = [
    "INLINE_BODY", "KEEP_ALIVE_MARGIN", "H1Agent", "H1Connection", "H1Pool", "HeaderPairs", "IInlineBody", "request_head",
]

HeaderPairs = Sequence[tuple[bytes, Sequence[bytes]]]
"""Request headers as ``(name, values)`` pairs, written in that order as they are (what
``Headers.getAllRawHeaders`` gives), never a ``Host`` (written from the URL): the
proxy's forwarded headers, made without a ``Headers``, which would check every name and
value the client's ``Headers`` already checked (:func:`crossbar.proxy.headers.upstream_headers`)."""

INLINE_BODY = 256 * 1024
"""Bytes: a body of at most this size from an :class:`IInlineBody` producer is written
with the request head, in one write."""

PEEK_AFTER = 0.5
"""Seconds idle after which :meth:`H1Pool.take` looks at a connection's socket before
handing it out (a host closes idle connections after seconds, not milliseconds: a
connection reused sooner costs no system call)."""

KEEP_ALIVE_MARGIN = 1.0
"""Seconds before a host's advertised keep-alive timeout (``Keep-Alive: timeout=N``)
that crossbar stops reusing an idle connection to it (docs/design.md rule 7): the host
would close it at N, possibly while a request is on its way."""


class IInlineBody(IBodyProducer):
    """An ``IBodyProducer`` whose body, when its ``length`` is at most :data:`INLINE_BODY`,
    the client takes whole from :meth:`inline` (and sends with the request head in one
    write) instead of starting it (no Deferred per request)."""

    def inline() -> bytes:
        """The whole body, at most :data:`INLINE_BODY` bytes."""


class State(Enum):
    """Where one :class:`H1Connection` stands."""

    IDLE = "idle"
    """No request on it: it may be sent one."""
    SENDING = "sending"
    """A request's body is being written."""
    WAITING = "waiting"
    """The request is written; no answer head yet."""
    BODY = "body"
    """The answer's head arrived; its body is being read."""
    DEAD = "dead"
    """Closed or given up: never used again."""
    DONE = "done"
    """The answer is complete and the connection already in the pool (so closing the
    pool closes it), but not to be taken until the parser has returned with no byte
    left over (``dataReceived``): never from inside the parser's callbacks."""


# Module-level names for the hot path (an Enum attribute lookup costs ten times a global).
_IDLE, _SENDING, _WAITING, _BODY, _DEAD, _DONE = (
    State.IDLE, State.SENDING, State.WAITING, State.BODY, State.DEAD, State.DONE,
)
_RESPONSE_DONE = Failure(ResponseDone())
"""The one reason every cleanly ended body gets (shared like ``connectionDone``: a
Failure built per answer cost ~1.7 us of its capture machinery)."""

_HTTP_NAME = b"HTTP/"


class H1Connection(Protocol):
    """One HTTP/1.1 connection to a host, one request at a time (no pipelining).

    :ivar key: the pool key ``(scheme, host, port)``.
    :ivar persistent: whether it may go back to the pool after a complete answer.
    :ivar reused: requests sent on it before the current one.
    :ivar paused: whether a body reader paused its reading.
    :ivar idle_since: reactor seconds when it was last put in the pool.
    :ivar keep_alive: seconds the host said it keeps an idle connection open (the last
        answer's ``Keep-Alive: timeout=N``), or None when it did not say.
    :ivar streamed: its last answer was chunked (a stream).
    """

    def __init__(self, pool: H1Pool | None, key: tuple[bytes, bytes, int], persistent: bool) -> None:
        self._pool = pool
        self.key = key
        self.persistent = persistent
        self.state = _IDLE
        self.reused = 0
        self.paused = False
        self.idle_since = 0.0
        self.keep_alive: float | None = None
        self.streamed = False
        self._lost: list[Deferred[None]] | None = []
        self._head = AnswerHead(self, self.on_body, self.on_message_complete, self._answered)
        self._parser: Any = None
        self._result: Deferred[IResponse] | None = None
        self._response: H1Response | None = None
        self._producer: Any = None
        self._head_bytes = 0
        self._got_bytes = False
        self._start = b""
        self._body_in_read = 0
        self._framing = 0
        self._close_after = False

    def connectionMade(self) -> None:
        no_delay(self.transport)
        eager_writes(self.transport)  # a write goes out at once, not a reactor turn later

    def when_lost(self) -> Deferred[None]:
        """A Deferred that fires once the connection is closed."""
        if self._lost is None:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._lost.append(d)
        return d

    # -- sending ----------------------------------------------------------------------

    def send(self, method: bytes, path: bytes, headers: Headers | HeaderPairs, producer: IBodyProducer | None,
             host: bytes | None = None) -> Deferred[IResponse]:
        """Write one request; the Deferred fires with its :class:`H1Response` once the
        head arrived (body not read yet), or fails as the module says. Cancelling it
        aborts the connection. ``host``: a ``Host`` value written before ``headers``
        (which then have none), or None."""
        result: Deferred[IResponse] = Deferred(self._cancel)
        length = None if producer is None else producer.length
        if self.state is not _IDLE or self.transport is None or length is UNKNOWN_LENGTH:
            result.errback(RequestNotSent())  # and only bodies of known length are sent
            return result
        self.state = _SENDING
        self._result = result
        self._head_bytes = 0
        self._got_bytes = False
        self._start = b""
        self._framing = 0
        self._response = None
        self._close_after = not self.persistent
        self._parser = self._head.parser(method)
        lines = request_head(method, path, headers, host, self.persistent, length)
        transport: Any = self.transport
        if producer is None:
            transport.write(b"".join(lines))
        elif producer.length <= INLINE_BODY and _inline(producer):
            lines.append(cast(IInlineBody, producer).inline())
            transport.write(b"".join(lines))
        else:
            transport.write(b"".join(lines))
            self._producer = producer
            transport.registerProducer(producer, True)
            written = producer.startProducing(transport)
            written.addCallbacks(self._body_written, self._body_failed)
            if self.state is _SENDING:
                return result
        if self.state is _SENDING:
            self.state = _WAITING
        return result

    def _body_written(self, _: object) -> None:
        if self._producer is not None:
            self._producer = None
            transport: Any = self.transport  # an IConsumer too
            if transport is not None:
                transport.unregisterProducer()
        if self.state is _SENDING:
            self.state = _WAITING

    def _body_failed(self, failure: Failure) -> None:
        self._producer = None
        if self.state in (_SENDING, _WAITING):
            self._fail(Failure(RequestTransmissionFailed([failure])))

    def _cancel(self, d: Deferred[IResponse]) -> None:
        self._result = None
        self.abandon()

    def abandon(self) -> None:
        """Give up on this connection: abort it, never pool it again."""
        if self.state is _DEAD:
            return
        self._kill()
        response, self._response = self._response, None
        if response is not None:
            response._ended(Failure(ResponseFailed([Failure(ConnectionAborted())])))

    def _stop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.stopProducing()
            transport: Any = self.transport  # an IConsumer too
            if transport is not None:
                transport.unregisterProducer()

    # -- receiving (httptools callbacks) ----------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        state = self.state
        if state is _BODY:
            self._body_in_read = 0
            if self._feed(data) and self.state is _BODY:
                # bytes of this read that were not body: chunk framing, trailers
                framing = len(data) - self._body_in_read
                self._framing = framing if self._body_in_read else self._framing + framing
                if self._framing > MAX_RESPONSE_HEAD:
                    self._broken(ResponseHeadTooLarge(f"chunk framing or trailers over {MAX_RESPONSE_HEAD} bytes"))
            return
        if state is not _WAITING and state is not _SENDING:
            self.abandon()  # bytes on an idle connection: nothing to pair them with
            return
        if not self._got_bytes:
            data = status_line_cr(data)
        self._got_bytes = True
        if len(self._start) < len(_HTTP_NAME):
            self._start = (self._start + data[:len(_HTTP_NAME)])[:len(_HTTP_NAME)]
            if not _HTTP_NAME.startswith(self._start):  # RTSP/1.0, ICE/1.0: not HTTP (RFC 9112 §2.3)
                self._broken(ResponseFailed([Failure(UnrelayableStatus("not an HTTP answer"))]))
                return
        self._head_bytes += len(data)
        # What a read of the head makes crossbar write (the answer's head, a small
        # answer's body and end) goes out together, in one system call per connection.
        holding = hold_writes()
        try:
            fed = self._feed(data)
        finally:
            if holding:
                release_writes()
        if fed and self.state in (_WAITING, _SENDING) and self._head_bytes > MAX_RESPONSE_HEAD:
            self._broken(ResponseHeadTooLarge(f"response head over {MAX_RESPONSE_HEAD} bytes"))

    def _feed(self, data: bytes) -> bool:
        """Parse ``data``; False when that ended the answer: broken, or complete (the
        connection then goes back to the pool, the read having nothing after it)."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._broken(e)
            return False
        if self.state is _DONE:
            self._reuse()
            return False
        return True

    def _broken(self, error: BaseException) -> None:
        """The answer cannot be read on: abort the connection, fail the answer."""
        if not isinstance(error, ResponseFailed):
            cause = error.__cause__ or error.__context__
            if isinstance(cause, (UnrelayableStatus, ResponseHeadTooLarge)):
                error = cause
            error = ResponseFailed([Failure(error)])
        if self._response is not None:
            response, self._response = self._response, None
            self._kill()
            response._ended(Failure(error))
        else:
            self._fail(Failure(error))

    def _answered(self, response: H1Response, no_body: bool) -> None:
        """The final answer's head was read (:class:`AnswerHead`): hand it on."""
        head = self._head
        if head.closes:
            self._close_after = True
        self.keep_alive = head.keep_alive
        self._response = response
        self.state = _BODY
        result, self._result = self._result, None
        if no_body:
            self._complete()
        if result is not None:
            result.callback(response)

    def on_body(self, data: bytes) -> None:
        self._body_in_read += len(data)
        response = self._response
        if response is not None:
            receiver = response._receiver
            if receiver is not None:  # H1Response._data's hot path, one call less per chunk
                receiver.dataReceived(data)
            else:
                response._data(data)

    def on_message_complete(self) -> None:
        if self.state is _BODY and self._response is not None:
            self._complete()

    def _complete(self) -> None:
        """The answer ended as its framing said (inside the parser): mark the
        connection for reuse (:meth:`_reuse`, once the parser returned), close it, or
        abort it when the request body was not all sent."""
        response, self._response = self._response, None
        unfinished = self._producer is not None  # an answer before the whole body went
        chunked = self._head.chunked
        if unfinished:
            self._kill()  # the host will not read the rest: don't wait to send it
        elif self._close_after or self._pool is None or (chunked and self._pool.closes_after_chunked(self.key)):
            self._close()
        else:
            self.streamed = chunked
            self.state = _DONE
            self._pool.put(self)  # may close it (the pool is full)
        if response is not None:
            response._ended(_RESPONSE_DONE)

    def _reuse(self) -> None:
        """The read that completed the answer had nothing after it: it may be taken."""
        if self.paused:  # the reader paused it with the last bytes: read again
            self.paused = False
            transport: Any = self.transport
            transport.resumeProducing()
        self.state = _IDLE
        self.reused += 1

    def _close(self) -> None:
        self.state = _DEAD
        if self._pool is not None:
            self._pool.forget(self)
        if self.transport is not None:
            self.transport.loseConnection()

    def _kill(self) -> None:
        """Dead: the body producer stopped, out of the pool, the connection aborted."""
        self.state = _DEAD
        self._stop_producer()
        if self._pool is not None:
            self._pool.forget(self)
        transport: Any = self.transport
        if transport is not None:
            transport.abortConnection()

    def _fail(self, failure: Failure) -> None:
        """The request failed before an answer head: abort the connection, errback."""
        self._kill()
        result, self._result = self._result, None
        if result is not None:
            result.errback(failure)

    def connectionLost(self, reason: Failure = Failure(ConnectionDone())) -> None:
        state, self.state = self.state, _DEAD
        if state is _IDLE and self.streamed and self._pool is not None:
            self._pool.closed_while_idle(self)
        lost, self._lost = self._lost, None
        for d in lost or ():
            d.callback(None)
        self._stop_producer()
        if self._pool is not None:
            self._pool.forget(self)
        response, self._response = self._response, None
        if response is not None:
            if response.length is UNKNOWN_LENGTH and not self._head.chunked and reason.check(ConnectionDone):
                response._ended(Failure(PotentialDataLoss()))  # close-delimited: a clean close ends it
            else:
                response._ended(Failure(ResponseFailed([reason, Failure(BodyTruncated())])))
            return
        result, self._result = self._result, None
        if result is None:
            return
        if state is _SENDING and not self._got_bytes:
            result.errback(RequestTransmissionFailed([reason]))
        elif self._got_bytes:
            result.errback(ResponseFailed([reason]))
        else:
            result.errback(ResponseNeverReceived([reason]))


def request_head(method: bytes, path: bytes, headers: Headers | HeaderPairs, host: bytes | None, persistent: bool,
                 length: int | None) -> list[bytes]:
    """The pieces of one request's head (bytes, to be joined): the request line, ``Host``
    when ``host`` is given (``headers`` then have none), ``Connection: close`` unless
    ``persistent``, the body's ``Content-Length`` (``length``, bytes; 0 for a ``PUT``
    or ``POST`` without a body: None) and ``headers`` as they are, repeated values kept."""
    lines = [method, b" ", path, b" HTTP/1.1\r\n"]
    if host is not None:
        lines += (b"Host: ", host, b"\r\n")
    if not persistent:
        lines.append(b"Connection: close\r\n")
    if length is not None:
        lines.append(b"Content-Length: %d\r\n" % length)
    elif method in (b"PUT", b"POST"):
        lines.append(b"Content-Length: 0\r\n")
    for name, values in headers.getAllRawHeaders() if isinstance(headers, Headers) else headers:
        for value in values:
            lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    return lines


class _ConnectionFactory(Factory):
    noisy = False

    def __init__(self, pool: H1Pool | None, key: tuple[bytes, bytes, int], persistent: bool) -> None:
        self._pool = pool
        self._key = key
        self._persistent = persistent

    def buildProtocol(self, addr: Any) -> H1Connection:
        return H1Connection(self._pool, self._key, self._persistent)


class H1Pool:
    """Idle persistent connections per ``(scheme, host, port)``.

    An idle connection is closed ``idle_seconds`` after it was put back, or sooner when
    its host said it keeps idle connections for less (``Keep-Alive: timeout=N``: closed
    :data:`KEEP_ALIVE_MARGIN` seconds before N, docs/design.md rule 7); one timer per pool
    checks them, so a request costs no timer work, and :meth:`take` never hands out one
    past its time. Nor one whose host already closed it or sent bytes nobody asked for
    while the reactor had not read them yet (a look at the socket without reading):
    a request is never written on a connection known to be dead.

    :param reactor: the reactor (the idle timer).
    :param max_per_host: idle connections kept per key; more are closed.
    :param idle_seconds: an idle connection is closed after this many seconds.
    """

    def __init__(self, reactor: IReactorTime, max_per_host: int = 64, idle_seconds: float = 60.0) -> None:
        self._reactor = reactor
        self.max_per_host = max_per_host
        self.idle_seconds = idle_seconds
        self._idle: dict[tuple[bytes, bytes, int], list[H1Connection]] = {}
        self._timer: IDelayedCall | None = None
        self._close_streams: set[tuple[bytes, bytes, int]] = set()

    def closes_after_chunked(self, key: tuple[bytes, bytes, int]) -> bool:
        """Whether the host at ``key`` was seen closing a connection right after a
        chunked answer (llama-server does, after every stream, with no ``Connection:
        close``): such connections are then closed by crossbar instead of pooled, so no
        request is ever written on one the host is closing (rule 7)."""
        return key in self._close_streams

    def closed_while_idle(self, connection: H1Connection) -> None:
        """``connection`` (its last answer a stream) was closed by its host while idle;
        within :data:`PEEK_AFTER` of that answer, the host closes after streams."""
        if self._reactor.seconds() - connection.idle_since < PEEK_AFTER:
            self._close_streams.add(connection.key)

    def _limit(self, connection: H1Connection) -> float:
        """Seconds ``connection`` may stay idle."""
        keep_alive = connection.keep_alive
        if keep_alive is None:
            return self.idle_seconds
        return min(self.idle_seconds, retire_after(keep_alive))

    def take(self, key: tuple[bytes, bytes, int]) -> H1Connection | None:
        """The most recently used idle connection for ``key`` that is still good, or
        None (one whose answer is still being parsed stays; a dead one, one past its
        idle time and one whose host closed it are dropped and closed)."""
        idle = self._idle.get(key)
        if not idle:
            return None
        now = self._reactor.seconds()
        for i in range(len(idle) - 1, -1, -1):
            connection = idle[i]
            state = connection.state
            if state is _DONE:
                continue
            del idle[i]
            if state is not _IDLE:
                continue
            idle_for = now - connection.idle_since
            if idle_for >= self._limit(connection):
                connection._close()
                continue
            if (idle_for >= PEEK_AFTER or connection.streamed) and _peer_spoke(connection.transport):
                if connection.streamed:
                    self.closed_while_idle(connection)
                connection._close()
                continue
            return connection
        return None

    def put(self, connection: H1Connection) -> None:
        """Keep an idle connection (or close it when ``max_per_host`` are kept, or when
        its host keeps idle connections too briefly to reuse it)."""
        limit = self._limit(connection)
        idle = self._idle.get(connection.key)
        if limit <= 0:
            connection._close()
            return
        if idle is None:
            idle = self._idle[connection.key] = []
        elif len(idle) >= self.max_per_host:
            connection._close()
            return
        idle.append(connection)
        now = connection.idle_since = self._reactor.seconds()
        timer = self._timer
        if timer is None:
            self._timer = self._reactor.callLater(limit, self._expire)
        elif timer.getTime() > now + limit:
            timer.reset(limit)

    def _expire(self) -> None:
        """Close the connections idle for their time; wait for the next one."""
        self._timer = None
        now = self._reactor.seconds()
        soonest: float | None = None
        for key, idle in list(self._idle.items()):
            kept = []
            for connection in list(idle):  # oldest first: put appends, take pops the newest
                due = connection.idle_since + self._limit(connection) - now
                if due <= 0 and connection.state is not _DONE:
                    connection._close()  # forgets itself: not in ``kept``
                    continue
                kept.append(connection)
                if due > 0:
                    soonest = due if soonest is None else min(soonest, due)
            if kept:
                self._idle[key] = kept
            else:
                del self._idle[key]
        if soonest is not None:
            self._timer = self._reactor.callLater(soonest, self._expire)

    def forget(self, connection: H1Connection) -> None:
        """Drop ``connection`` from the idle lists (it is busy, closing or gone)."""
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> Deferred[None]:
        """Close every idle connection; fires once all of them are closed."""
        waits: list[Deferred[None]] = []
        for idle in list(self._idle.values()):
            for connection in list(idle):
                waits.append(connection.when_lost())
                connection._close()
        self._idle.clear()
        timer, self._timer = self._timer, None
        if timer is not None and timer.active():
            timer.cancel()
        done: Deferred[None] = gatherResults(waits).addCallback(lambda _: None)
        return done


_INLINE_TYPES: dict[type, bool] = {}


def _inline(producer: IBodyProducer) -> bool:
    """Whether ``producer`` provides :class:`IInlineBody` (per class: a dict lookup)."""
    kind = type(producer)
    inline = _INLINE_TYPES.get(kind)
    if inline is None:
        inline = _INLINE_TYPES[kind] = IInlineBody.implementedBy(kind)
    return inline


def retire_after(keep_alive: float) -> float:
    """Seconds a connection to a host that keeps idle connections ``keep_alive``
    seconds is reused: :data:`KEEP_ALIVE_MARGIN` less, or half of it when that is short."""
    if keep_alive > 2 * KEEP_ALIVE_MARGIN:
        return keep_alive - KEEP_ALIVE_MARGIN
    return keep_alive / 2


def _peer_spoke(transport: Any) -> bool:
    """Whether the host already closed an idle connection (or reset it, or sent bytes
    nobody asked for) and the reactor has not read that yet: one non-blocking peek at
    the socket under ``transport`` (TLS included). A transport without a socket (a test
    double) reads as quiet."""
    sock = _socket_of(transport)
    if sock is None:
        return False
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False  # nothing waiting: open and quiet
    except OSError:
        return True  # reset
    return True  # an end of file, or bytes on an idle connection


def _socket_of(transport: Any) -> socket.socket | None:
    """The socket under ``transport`` (through a TLS layer), or None."""
    for _ in range(3):
        if transport is None:
            return None
        get = getattr(transport, "getHandle", None)
        if get is not None:
            handle = get()
            if isinstance(handle, socket.socket):
                return handle
        transport = getattr(transport, "transport", None)
    return None


@implementer(IAgent)
class H1Agent:
    """An ``IAgent`` for one attempt: a pooled connection for the URL's ``(scheme,
    host, port)`` if ``pool`` has one, else a new one from ``endpoints`` (the
    attempt's ``ConnectTracker``: it counts new connections).

    :param endpoints: where new connections come from.
    :param pool: the persistent pool, or None for a fresh ``Connection: close`` one.
    """

    def __init__(self, endpoints: IAgentEndpointFactory, pool: H1Pool | None) -> None:
        self._endpoints = endpoints
        self._pool = pool

    def request(self, method: bytes, uri: bytes, headers: Headers | HeaderPairs | None = None,
                bodyProducer: IBodyProducer | None = None) -> Deferred[IResponse]:
        """Send one request; see :meth:`H1Connection.send` for what the Deferred does.
        A ``Host`` header is added from the URL when ``headers`` has none (or are
        :data:`HeaderPairs`)."""
        origin, path = split_url(uri)
        key = origin.key
        if headers is None:
            headers = ()
        # written as it is, no copy of headers
        host = None if isinstance(headers, Headers) and headers.hasHeader(b"host") else origin.netloc
        pool = self._pool
        if pool is not None:
            connection = pool.take(key)
            if connection is not None:
                return connection.send(method, path, headers, bodyProducer, host)
        factory = _ConnectionFactory(pool, key, pool is not None)
        connecting = self._endpoints.endpointForURI(origin.uri).connect(factory)
        sending: list[Deferred[IResponse]] = []

        def cancel(_: object) -> None:
            connecting.cancel()
            for d in sending:
                d.cancel()

        result: Deferred[IResponse] = Deferred(cancel)

        def connected(connection: H1Connection) -> None:
            if result.called:  # cancelled while the connection was being made
                connection.abandon()
                return
            d = connection.send(method, path, headers, bodyProducer, host)
            sending.append(d)
            d.chainDeferred(result)

        connecting.addCallbacks(connected, _relay_failure(result))
        return result


@dataclass(frozen=True)
class Origin:
    """What a connection to a host needs, from an absolute URL.

    :ivar key: the pool key ``(scheme, host, port)``.
    :ivar netloc: the ``Host`` header value (bytes).
    :ivar uri: a ``URI`` of the origin alone (path ``/``), for ``endpointForURI``.
    """

    key: tuple[bytes, bytes, int]
    netloc: bytes
    uri: URI


def split_url(url: bytes) -> tuple[Origin, bytes]:
    """``url`` (absolute) as its :class:`Origin` and its request target (path and
    query, the fragment dropped, ``/`` when empty), as ``URI.fromBytes`` reads them.

    Origins are remembered (``URI.fromBytes`` costs 4.7 us a request; a fleet has few
    hosts), keyed by ``scheme://host:port`` alone: never by a path or a query string,
    which crossbar does not keep (docs/design.md rule 8).

    :raises ValueError: when ``url`` has no ``scheme://``.
    """
    end = url.find(b"/", 8)  # the path: after "http://" or "https://" and one byte of host
    if end < 0:
        end = len(url)
    origin = _ORIGINS.get(url[:end])
    if origin is None:
        return _split_slowly(url)
    target = url[end:]
    fragment = target.find(b"#")  # find, not ``in``: a bytes ``in`` first tries the needle as an int
    if fragment >= 0:
        target = target[:fragment]
    return origin, target or b"/"


def _split_slowly(url: bytes) -> tuple[Origin, bytes]:
    """:func:`split_url` for an origin not seen yet (it is then remembered) or a URL
    whose query or fragment starts right after the authority."""
    start = url.find(b"://")
    if start < 0:
        raise ValueError("not an absolute URL")
    start += 3
    end = len(url)
    for separator in (b"/", b"?", b"#"):
        found = url.find(separator, start, end)
        if found >= 0:
            end = found
    target = url[end:]
    if b"#" in target:
        target = target[:target.index(b"#")]
    if target[:1] != b"/":
        target = b"/" + target
    prefix = url[:end]
    origin = _ORIGINS.get(prefix)
    if origin is None:
        if len(_ORIGINS) >= 256:
            _ORIGINS.clear()
        uri = URI.fromBytes(prefix + b"/")
        origin = _ORIGINS[prefix] = Origin((uri.scheme, uri.host, uri.port), uri.netloc, uri)
    return origin, target


_ORIGINS: dict[bytes, Origin] = {}
"""``scheme://authority`` -> its :class:`Origin` (at most 256: a fleet's hosts)."""


def _relay_failure(result: Deferred[IResponse]) -> Callable[[Failure], None]:
    def failed(failure: Failure) -> None:
        if not result.called:
            result.errback(failure)
    return failed
