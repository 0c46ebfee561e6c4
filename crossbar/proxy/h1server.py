"""The HTTP/1.1 server channel with request heads parsed in C (llhttp, through ``httptools``).

Twisted's ``HTTPChannel`` parses a request head line by line and header by header in
Python (a ``LineReceiver``, a ``headerReceived`` per header, its name encoded and its
value checked): tens of Python calls per request, a large part of what a small proxied
request costs crossbar (bench/instructions.sh). :class:`H1ServerChannel` finds the head's
end with one search, hands the head to llhttp (which checks it: tokens, header value
bytes, ``Content-Length``) and gives the same ``twisted.web`` ``Request`` the same calls
Twisted's channel makes (``gotLength``, ``handleContentChunk``, ``requestReceived``, the
headers through ``Headers.addRawHeader``), so ``Site``, ``Resource``, Klein's ops app and
producer/consumer are unchanged above it (docs/design.md §Shape).

It parses only what it can parse exactly as Twisted's channel (with crossbar's own
refusals, :class:`~crossbar.proxy.channel.HeadDeadlineChannel`) would: a head of at most
:data:`MAX_HEAD` bytes, one of the seven methods, ``HTTP/1.1`` or ``HTTP/1.0``, a body
framed by ``Content-Length`` or none, no header llhttp or crossbar refuses. Anything
else -- a chunked body, a method crossbar answers 405, a head to refuse 400, one too
large, an empty line before a request -- is handed with its bytes, from the first byte of
that request, to Twisted's own parser for the rest of the connection (the inherited
:class:`~crossbar.proxy.channel.HeadDeadlineChannel`), which answers it as before. So is
every connection when the fence's start-up check fails (touchpoint 12 of
:mod:`crossbar.compat.twisted`).

As Twisted's channel it answers one request at a time: bytes after a complete request
are held while it is answered (the transport paused beyond 16 KiB) and parsed when its
answer is done; the idle timeout is off while a request is answered; the head and body
deadlines of :class:`~crossbar.proxy.channel.HeadDeadlineChannel` apply.
"""

from __future__ import annotations

import re
from typing import Any

import httptools
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web.iweb import INonQueuedRequestFactory

from crossbar.compat.twisted import hold_pipelined, parsed_heads, start_answering
from crossbar.proxy.channel import HeadDeadlineChannel, body_deadline, hostile_header
from crossbar.proxy.head import METHODS

__all__ = ["MAX_HEAD", "H1ServerChannel"]

MAX_HEAD = 16384
"""Bytes of a request head (request line and headers, line ends included) parsed here;
a longer one goes to Twisted's parser, which refuses it or not by its own count
(``HTTPChannel.totalHeadersSize``, 16 KiB without line ends)."""

_MAX_HEADERS = 500  # HTTPChannel.maxHeaders: more goes to Twisted's parser (a 400)
_VERSIONS = frozenset({b"HTTP/1.1", b"HTTP/1.0"})
_METHODS = frozenset(METHODS)
_folded = re.compile(rb"\r\n[ \t]").search
_LOOKED_AT = frozenset({b"connection", b"expect", b"cookie"})  # what Twisted reads once the head is in

# The channel's modes (:attr:`H1ServerChannel.mode`), and the moves between them.
HEAD = "head"  # reading a request head (none begun, or part of one held)
BODY = "body"  # reading a Content-Length body
ANSWERING = "answering"  # a complete request is answered; later bytes are held
TWISTED = "twisted"  # every byte goes to Twisted's parser
_MOVES = frozenset({(HEAD, BODY), (HEAD, ANSWERING), (BODY, ANSWERING), (ANSWERING, HEAD), (HEAD, TWISTED)})


class _HandOver(Exception):
    """Raised inside llhttp's header callback: this head goes to Twisted's parser."""


class H1ServerChannel(HeadDeadlineChannel):
    """A :class:`~crossbar.proxy.channel.HeadDeadlineChannel` that parses request heads
    with llhttp (see the module's docstring).

    :ivar mode: :data:`HEAD`, :data:`BODY`, :data:`ANSWERING` or :data:`TWISTED`.
    """

    mode = TWISTED
    _parser: Any = None  # httptools.HttpRequestParser, one per connection
    _held = b""  # the bytes of a head not yet complete
    _remaining = 0  # bytes of the body still to come
    _length = 0  # the Content-Length of the head being parsed
    _headers = 0  # headers of the head being parsed
    _plain = True  # the head being parsed has none of the headers in _LOOKED_AT
    _add: Any = None  # its request's requestHeaders.addRawHeader
    _request: Any = None  # the request whose body is read

    def connectionMade(self) -> None:
        super().connectionMade()
        if parsed_heads():
            self._parser = httptools.HttpRequestParser(self)
            self.mode = HEAD

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._parser = self._add = self._request = None  # the parser holds this channel's on_header
        self._held = b""
        super().connectionLost(reason)

    def _move(self, to: str) -> None:
        """Change :attr:`mode`; raises ``RuntimeError`` on a move the channel never makes."""
        if (self.mode, to) not in _MOVES:
            raise RuntimeError(f"channel cannot move from {self.mode} to {to}")
        self.mode = to

    def dataReceived(self, data: bytes) -> None:
        mode = self.mode
        if mode is TWISTED:
            super().dataReceived(data)
            return
        self._idle = False
        self.resetTimeout()
        if mode is ANSWERING:
            hold_pipelined(self, data)
            return
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        """Parse ``data``, request after request, until it is used up, held, or the
        connection is being closed or handed over."""
        while data:
            mode = self.mode
            if mode is BODY:
                data = self._body(data)
            elif mode is HEAD:
                if not self.persistent:
                    return  # bytes after the last request: dropped, as Twisted does
                data = self._head(data)
            else:
                if mode is ANSWERING:
                    hold_pipelined(self, data)
                return
            transport: Any = self.transport
            if transport is None or getattr(transport, "disconnecting", False) or "dataReceived" in self.__dict__:
                return  # refused (its bytes are dropped from now on), or closed

    def _head(self, data: bytes) -> bytes:
        """Take ``data`` as (more of) a request head; returns what follows the head."""
        held = self._held
        if held:
            start = max(0, len(held) - 3)
            data = held + data
            end = data.find(b"\r\n\r\n", start)
        else:
            end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) > MAX_HEAD:
                self._hand_over(data)
            else:
                self._held = data
            return b""
        self._held = b""
        end += 4
        line = data[:data.find(b"\r\n")]
        parts = line.split(b" ")
        if (end > MAX_HEAD or len(parts) != 3 or parts[0] not in _METHODS or parts[2] not in _VERSIONS
                or _folded(data, 0, end) is not None):
            self._hand_over(data)  # Twisted's parser decides: 400, 405, or as it parses
            return b""
        factory: Any = self.requestFactory
        request = factory(self) if INonQueuedRequestFactory.providedBy(factory) else factory(self, len(self.requests))
        self._add = request.requestHeaders.addRawHeader
        self._length = self._headers = 0
        self._plain = True
        try:
            self._parser.feed_data(data[:end])
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):  # refused or an upgrade, or _HandOver
            self._hand_over(data)
            return b""
        method, target, version = parts
        self._method, self._target, self._version = method, target, version
        self._awaiting_request_line = False
        self._te_seen = False
        self.requests.append(request)
        # As HTTPChannel.allHeadersReceived, with HeadDeadlineChannel's deadlines.
        plain = self._plain
        if plain:  # what parseCookies and checkPersistence come to without those headers
            self.persistent = version == b"HTTP/1.1"
        else:
            request.parseCookies()
            self.persistent = self.checkPersistence(request, version)
        length = self._length
        if length:
            timer, self._head_timer = self._head_timer, None
            if timer is not None and timer.active():
                timer.reset(body_deadline(length))
                self._head_timer = timer
            else:
                self._head_timer = self.callLater(body_deadline(length), self._head_deadline_passed)
        else:
            self._disarm_head_deadline()
        request.gotLength(length)
        transport: Any = self.transport
        if transport is None or getattr(transport, "disconnecting", False) or "dataReceived" in self.__dict__:
            return b""  # refused on the head
        expect = None if plain else request.requestHeaders.getRawHeaders(b"expect")
        if expect and expect[0].lower() == b"100-continue" and version == b"HTTP/1.1":
            transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if length:
            self._request = request
            self._remaining = length
            self._move(BODY)
        else:
            self._complete(request)
        return data[end:]

    def on_header(self, name: bytes, value: bytes) -> None:
        """llhttp's callback for one header of the head being parsed (its name a token,
        its value free of control bytes but HTAB, leading blanks stripped)."""
        value = value.rstrip(b" \t")
        if name.find(b"_") >= 0 and hostile_header(name, value, False) is not None:
            raise _HandOver
        size = len(name)
        if size == 14 or size == 17:
            lowered = name.lower()
            if lowered == b"content-length":
                self._length = int(value)  # llhttp checked: digits, and only one
            elif lowered == b"transfer-encoding":
                raise _HandOver  # a chunked body: Twisted's decoder (and its 400s)
        elif (size == 6 or size == 10) and name.lower() in _LOOKED_AT:
            self._plain = False
        self._headers += 1
        if self._headers > _MAX_HEADERS:
            raise _HandOver
        self._add(name, value)

    def _body(self, data: bytes) -> bytes:
        """Give ``data`` (or the part of it that is this body) to the request; returns
        what follows the body."""
        remaining = self._remaining
        if len(data) > remaining:
            data, rest = data[:remaining], data[remaining:]
        else:
            rest = b""
        self._parser.feed_data(data)  # llhttp follows the body, to be ready for the next head
        self._remaining = remaining = remaining - len(data)
        request = self._request
        request.handleContentChunk(data)
        if remaining == 0 and "dataReceived" not in self.__dict__:
            self._request = None
            self._complete(request)
        return rest

    def _complete(self, request: Any) -> None:
        """The request is complete: answer it (as ``HTTPChannel.allContentReceived``).
        A body's deadline is left running (it does not apply while the request is
        answered: :meth:`_head_deadline_passed`), for the next head's to reuse its timer."""
        self._move(ANSWERING)
        start_answering(self)
        request.requestReceived(self._method, self._target, self._version)

    def _head_deadline_passed(self) -> None:
        if self.mode is ANSWERING:  # a body's deadline that ran on: none applies now
            self._head_timer = None
            return
        super()._head_deadline_passed()

    def requestDone(self, request: Any) -> None:
        if self.mode is ANSWERING:
            self._move(HEAD)  # before Twisted hands back the bytes it held
        super().requestDone(request)

    def _hand_over(self, data: bytes) -> None:
        """From ``data`` (which starts a request) on, every byte of the connection goes
        to Twisted's parser."""
        self._move(TWISTED)
        self._parser = self._add = None
        self._held = b""
        self._awaiting_request_line = True
        super().dataReceived(data)
