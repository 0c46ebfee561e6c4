"""The HTTP/1.1 server channel: Twisted's, with deadlines on each request head and body.

Twisted's own ``timeOut`` (60 s) is an *idle* timeout: every byte restarts it, so a
client trickling one header byte a minute (slowloris) would hold a connection for days.
:class:`HeadDeadlineChannel` gives the whole request head -- request line and headers --
:data:`HEAD_DEADLINE` seconds, counted from when the connection is ready for a request
(opened, or the previous answer finished). An idle keep-alive connection is closed after
the same time. The deadline does not run while a request is being answered, so long
streams are unaffected. A request body then gets :data:`HEAD_DEADLINE` seconds plus one
second per :data:`MIN_BODY_RATE` bytes of it (of the 16 MiB limit when it is chunked):
a body trickled a byte a minute no longer holds a connection for days either.
(docs/design.md §The proxy, rule 9: no request can leave crossbar serving less.)

It also refuses hostile request heads (:func:`hostile_header`, obs-folds) with a JSON
400, and feeds a chunked body that is dense with framing to Twisted's chunk decoder in
:data:`SLICE`-byte slices, one per reactor turn (bounded reactor time per read).
"""

from __future__ import annotations

import re
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import HTTPChannel

from crossbar.errors import raw_error_answer
from crossbar.proxy.request import MAX_BODY
from crossbar.upstream.tcp import no_delay
from crossbar.compat.twisted import BadRequestHook, eager_writes

__all__ = ["HEAD_DEADLINE", "MIN_BODY_RATE", "HeadDeadlineChannel", "body_deadline", "hostile_header"]

HEAD_DEADLINE = 60.0
"""Seconds a connection gets to deliver a complete request head once it is ready for one."""

MIN_BODY_RATE = 64 * 1024
"""Bytes per second a request body must average (on top of :data:`HEAD_DEADLINE`)."""


def body_deadline(length: int | None) -> float:
    """Seconds a request body of ``length`` bytes (None: chunked) may take to arrive."""
    return HEAD_DEADLINE + (MAX_BODY if length is None else length) / MIN_BODY_RATE

_log = Logger(namespace="crossbar.channel")

SLICE = 2048
"""Bytes of a chunked body handed to Twisted's chunk decoder in one reactor turn when a
read is dense with chunk framing: the decoder costs several microseconds per chunk, so a
64 KiB read of 1-byte chunks (10,000 of them) would hold the reactor for 50-100 ms; in
2 KiB slices no request holds it for more than a few ms (docs/design.md §The proxy, rule 9)."""

_DENSE = 256
"""More CRLFs than this in a window of a chunked body (about 128 chunks) and it is fed in
:data:`SLICE`-byte slices, one per reactor turn; honest bodies (large chunks) go whole."""

_WINDOW = 64 * 1024
_PENDING_MAX = 1024 * 1024  # bytes queued for slicing before the client is paused

_FRAMING_NAMES = frozenset({b"content-length", b"transfer-encoding"})
_control_byte = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]").search


def hostile_header(name: bytes, value: bytes, repeated_te: bool) -> str | None:
    """Why the request header ``name: value`` must be refused 400 (docs/design.md §The
    proxy, rule 9), or None when it may pass: a control byte in the value (HTAB
    excepted; Twisted itself refuses only NUL, CR and LF), a name with ``_`` that a
    server could read as ``Content-Length`` or ``Transfer-Encoding``, or a second
    ``Transfer-Encoding`` (``repeated_te``: the request already has one). Nothing
    refused here is ever forwarded, so no less strict host or middlebox behind
    crossbar can be fed a framing crossbar did not read."""
    if _control_byte(value) is not None:  # one C search: every request header passes here
        return "bad header value"
    # find, not ``in``: a bytes ``in`` first tries its needle as an int, raising and
    # clearing a TypeError each time (~1.7k instructions; three headers per request)
    if name.find(b"_") >= 0 or repeated_te:
        lowered = name.strip(b" \t").lower()
        if lowered.find(b"_") >= 0 and lowered.replace(b"_", b"-") in _FRAMING_NAMES:
            return "bad header name"
        if repeated_te and lowered == b"transfer-encoding":
            return "repeated transfer-encoding"
    return None


class HeadDeadlineChannel(BadRequestHook, HTTPChannel):
    """An ``HTTPChannel`` that closes connections whose request head takes longer than
    ``head_deadline`` seconds (default :data:`HEAD_DEADLINE`)."""

    head_deadline = HEAD_DEADLINE
    _head_timer: IDelayedCall | None = None
    _body_chunked = False  # a chunked request body is being read
    _pending: bytearray | None = None  # framing-dense body bytes waiting for their turn
    _slice_call: IDelayedCall | None = None
    _paused_for_slices = False
    _awaiting_request_line = True
    _idle = True
    _te_seen = False  # the request being read has a Transfer-Encoding header
    _method = b""
    _target = b""
    _version = b""

    def connectionMade(self) -> None:
        super().connectionMade()
        no_delay(self.transport)
        eager_writes(self.transport)  # a write goes out at once, not a reactor turn later
        self._arm_head_deadline()
        open_channels = getattr(getattr(self, "site", None), "open_channels", None)
        if open_channels is not None:
            open_channels.add(self)

    _host: Any = None
    _peer: Any = None

    def getHost(self) -> Any:
        """The connection's local address, asked of the socket once: Twisted's
        ``Request`` asks for it on every request (a ``getsockname`` system call and a
        new address object each time), and a connected socket's address never changes."""
        host = self._host
        if host is None:
            host = self._host = super().getHost()
        return host

    def getPeer(self) -> Any:
        """The client's address, made once per connection (as :meth:`getHost`)."""
        peer = self._peer
        if peer is None:
            peer = self._peer = super().getPeer()
        return peer

    def close_when_idle(self) -> bool:
        """Stop keep-alive (a drain): close the connection now if no request is on it,
        else right after the answer in progress. Returns whether it closed now."""
        if self.transport is None:
            return False
        if self.requests:
            self.persistent = False  # HTTPChannel closes after this answer
            return False
        self.transport.loseConnection()
        return True

    def request_line(self) -> tuple[bytes, bytes]:
        """The method and target of the request line being read or answered, as sent
        (``(b"", b"")`` before one arrived). Known from the line itself, before Twisted
        sets ``request.method`` and ``request.uri`` (after the body): what an answer
        made before a resource saw the request, such as the 413, is recorded with."""
        return self._method, self._target

    def request_version(self) -> bytes:
        """The HTTP version of that request line, as sent (``b"HTTP/1.1"``)."""
        return self._version

    def lineReceived(self, line: bytes) -> None:
        if self._awaiting_request_line and line:
            # The method, even of a request line Twisted then refuses (for the 400), and
            # the target (Twisted sets request.uri only after the body: for the 413).
            parts = line.split(b" ", 2)
            self._method = parts[0]
            self._target = parts[1] if len(parts) > 1 else b""
            self._version = parts[2] if len(parts) > 2 else b""
            self._awaiting_request_line = False
            self._te_seen = False
        elif line[:1] in (b" ", b"\t"):
            # obs-fold (RFC 9112 §5.2): a server may refuse it, and crossbar does,
            # whatever header it continues (an obs-folded Transfer-Encoding included).
            self.respond_to_bad_request("obsolete line folding")
            return
        super().lineReceived(line)

    def headerReceived(self, line: bytes) -> bool:
        name, colon, value = line.partition(b":")
        if colon and self.requests:
            why = hostile_header(name, value, self._te_seen)
            if why is not None:
                self.respond_to_bad_request(why)
                return False
            if name.lower() == b"transfer-encoding":  # Twisted refuses names that are not tokens
                self._te_seen = True
        ok: bool = super().headerReceived(line)
        return ok

    def rawDataReceived(self, data: bytes) -> None:
        """Body bytes (and bytes buffered behind a request being answered). A chunked
        body dense with framing is fed to the decoder in :data:`SLICE`-byte slices, one
        per reactor turn, in order; everything else goes to Twisted at once."""
        pending = self._pending
        if pending is not None:
            pending += data
            if len(pending) > _PENDING_MAX and not self._paused_for_slices and self.transport is not None:
                self._paused_for_slices = True
                self.transport.pauseProducing()  # type: ignore[attr-defined]
            return
        if self._body_chunked and len(data) > SLICE and data.count(b"\r\n", 0, _WINDOW) > _DENSE:
            self._pending = bytearray(data[SLICE:])
            super().rawDataReceived(data[:SLICE])
            self._slice_call = self.callLater(0, self._next_slice)
            return
        super().rawDataReceived(data)

    def _next_slice(self) -> None:
        self._slice_call = None
        pending = self._pending
        if pending is None:
            return
        if self.transport is None or "dataReceived" in self.__dict__:  # closed, or refused: dropped
            self._pending = None
            return
        size = _WINDOW if pending.count(b"\r\n", 0, _WINDOW) <= _DENSE else SLICE
        piece = bytes(pending[:size])
        del pending[:size]
        if not pending:
            self._pending = None
            if self._paused_for_slices:
                self._paused_for_slices = False
                self.transport.resumeProducing()  # type: ignore[attr-defined]
        super().rawDataReceived(piece)
        if self._pending is not None:
            self._slice_call = self.callLater(0, self._next_slice)

    def allHeadersReceived(self) -> None:
        length = self.length  # Content-Length, None when chunked, 0 without a body
        if length == 0:
            self._disarm_head_deadline()
            timer = None
        else:  # the head's timer becomes the body's: moved, not cancelled and re-made
            timer, self._head_timer = self._head_timer, None  # detached while Twisted works
        self._body_chunked = length is None
        super().allHeadersReceived()
        if length != 0:  # disarmed again by allContentReceived
            if timer is not None and timer.active():
                timer.reset(body_deadline(length))
                self._head_timer = timer
            else:
                self._head_timer = self.callLater(body_deadline(length), self._head_deadline_passed)

    def allContentReceived(self) -> None:
        self._disarm_head_deadline()
        self._body_chunked = False
        super().allContentReceived()

    def requestDone(self, request: Any) -> None:
        # Armed first: a pipelined request already buffered is parsed inside
        # super().requestDone, and its allHeadersReceived disarms the deadline again.
        self._arm_head_deadline()
        self._awaiting_request_line = True
        super().requestDone(request)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._disarm_head_deadline()
        self._pending = None
        call, self._slice_call = self._slice_call, None
        if call is not None and call.active():
            call.cancel()
        open_channels = getattr(getattr(self, "site", None), "open_channels", None)
        if open_channels is not None:
            open_channels.discard(self)
        super().connectionLost(reason)

    def dataReceived(self, data: bytes) -> None:
        self._idle = False
        super().dataReceived(data)

    def _arm_head_deadline(self) -> None:
        self._idle = True  # no byte of the next request yet
        timer = self._head_timer
        if timer is not None and timer.active():  # left running through an answer: moved, not re-made
            timer.reset(self.head_deadline)
        else:
            self._head_timer = self.callLater(self.head_deadline, self._head_deadline_passed)

    def _disarm_head_deadline(self) -> None:
        timer, self._head_timer = self._head_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def lineLengthExceeded(self, line: bytes) -> None:
        """A request line or header line over ``MAX_LENGTH`` (16 KiB): Twisted would
        just close the connection; crossbar answers its JSON 400 and records it
        (docs/design.md §The proxy, rules 8-9)."""
        self.respond_to_bad_request()

    def respond_to_bad_request(self, message: str = "bad request") -> None:
        """Twisted's answer to a request it cannot parse (bad request line, header,
        framing or size) is a bare ``400``; crossbar's error answers are JSON
        (docs/design.md §The proxy, rule 9) and recorded like any other answer (rule 8).
        Called through :class:`~crossbar.compat.twisted.BadRequestHook`; the tests in
        tests/test_channel.py pin it."""
        if self.transport is None or getattr(self.transport, "disconnecting", False):
            return  # answered already
        answer, sent = raw_error_answer(400, message, head_only=self._method == b"HEAD")
        self.transport.write(answer)
        self.loseConnection()
        record = getattr(getattr(self, "site", None), "record_early_answer", None)
        if record is not None:
            record(self._method, self._target, 400, sent)

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        if self.transport is None:
            return
        peer = self.transport.getPeer()
        if self._idle and self._awaiting_request_line:
            # No byte of a request since the connection was ready for one: an idle
            # keep-alive connection, no request (nothing for the request log, rule 8).
            _log.debug("closing idle connection {peer}", peer=str(peer))
        else:
            _log.debug("closing {peer}: request head or body too slow", peer=str(peer))
        self.transport.abortConnection()  # type: ignore[attr-defined]
