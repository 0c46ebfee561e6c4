"""One upstream answer as crossbar's HTTP/1.1 client reads it (docs/design.md §The proxy,
rules 6-7 and 9): its head through llhttp's callbacks (:class:`AnswerHead`), checked,
and the :class:`H1Response` the attempt is given (``twisted.web.iweb.IResponse``).

The connection that reads it (:class:`crossbar.upstream.h1client.H1Connection`) feeds
the parser and holds the request's state; this module knows what an answer says:

- the ``Connection``-control headers are kept out of ``headers`` as Twisted does
  (``Content-Length`` stays for ``HEAD``), ``length`` is the ``Content-Length`` or
  ``UNKNOWN_LENGTH``, and ``upstream_connection`` holds the raw ``Connection`` values;
- interim ``1xx`` answers are skipped; ``HEAD``, ``204`` and ``304`` answers have no
  body; trailer fields are read and dropped (they were never relayed);
- ``101``, a status outside 100-599, a transfer-coding other than ``chunked`` or an
  HTTP version other than 1.x is :class:`UnrelayableStatus` (rules 7, 9), a byte after
  a complete answer :class:`UnsolicitedAnswer`;
- the connection closes after an answer that says so, and after a chunked ``HTTP/1.0``
  one (faulty framing, RFC 9112 §6.1).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import httptools
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.iweb import UNKNOWN_LENGTH, IResponse
from zope.interface import implementer

__all__ = [
    "MAX_RESPONSE_HEAD", "AnswerHead", "BodyTruncated", "H1Response", "ResponseHeadTooLarge", "UnrelayableStatus",
    "UnsolicitedAnswer", "keep_alive_timeout", "status_line_cr",
]

MAX_RESPONSE_HEAD = 64 * 1024
"""The most bytes of an upstream answer's head (status lines and headers, interim
``1xx`` answers included) crossbar reads before giving up on it (docs/design.md §The proxy,
rule 9); the same bound holds for chunk framing and trailers with no body byte between."""


class ResponseHeadTooLarge(Exception):
    """An upstream answer's head went over :data:`MAX_RESPONSE_HEAD` bytes."""


class BodyTruncated(Exception):
    """A ``Content-Length`` or chunked answer body ended before its framing said
    (docs/design.md rule 7: the client must see a truncated answer)."""


class UnsolicitedAnswer(Exception):
    """The host sent an answer nobody asked for (the connection is dropped)."""


class UnrelayableStatus(Exception):
    """``101 Switching Protocols``, a status outside 100-599, or a transfer-coding
    other than ``chunked`` (rule 7)."""


_CONNECTION_CONTROL = frozenset({
    b"content-length", b"connection", b"keep-alive", b"te", b"trailers", b"transfer-encoding", b"upgrade",
    b"proxy-connection",
})
"""Headers kept out of ``IResponse.headers``, as ``twisted.web`` does."""

_NO_BODY_CODES = frozenset({204, 304})


class Upstream(Protocol):
    """What an answer's body reader controls of the connection it comes on."""

    transport: Any
    paused: bool
    """Whether a body reader paused its reading."""

    def abandon(self) -> None:
        """Give up on the connection: abort it, never pool it again."""


@implementer(IResponse)
class H1Response:
    """One upstream answer (``twisted.web.iweb.IResponse``).

    :ivar code: the status code (int); :ivar phrase: the reason phrase (bytes).
    :ivar headers: the end-to-end headers (``Headers``, repeated values kept).
    :ivar length: the ``Content-Length`` in bytes, or ``UNKNOWN_LENGTH``.
    :ivar upstream_connection: the raw ``Connection`` header values (tuple of bytes).
    """

    version = (b"HTTP", 1, 1)
    request = None
    previousResponse = None

    def __init__(self, code: int, phrase: bytes, headers: Headers, length: Any,
                 upstream_connection: tuple[bytes, ...], connection: Upstream | None) -> None:
        self.code = code
        self.phrase = phrase
        self.headers = headers
        self.length = length
        self.upstream_connection = upstream_connection
        self._connection = connection  # None once the body is complete
        self._receiver: Any = None
        self._buffer: list[bytes] | None = []
        self._end: Failure | None = None

    def setPreviousResponse(self, response: IResponse) -> None:
        self.previousResponse = response

    def deliverBody(self, protocol: Any) -> None:
        """Hand the body to ``protocol`` (an ``IProtocol``): ``makeConnection`` with a
        transport that has ``pauseProducing``/``resumeProducing``/``stopProducing``,
        the chunks buffered so far, then each chunk as it arrives, then
        ``connectionLost`` (``ResponseDone``, ``PotentialDataLoss`` or a failure)."""
        if self._receiver is not None:
            raise RuntimeError("the body was already delivered")
        self._receiver = protocol
        protocol.makeConnection(_BodyTransport(self))
        buffered, self._buffer = self._buffer, None
        for chunk in buffered or ():
            if self._receiver is not protocol:
                return  # it stopped the body while taking the buffered chunks
            protocol.dataReceived(chunk)
        if self._end is not None:
            self._finish_delivery()

    def _data(self, data: bytes) -> None:
        """A body chunk from the connection (the hot path: no copy)."""
        receiver = self._receiver
        if receiver is not None:
            receiver.dataReceived(data)
        elif self._buffer is not None:
            self._buffer.append(data)

    def _ended(self, reason: Failure) -> None:
        """The body ended (cleanly or not); the connection is done with us."""
        if self._end is not None:
            return
        self._end = reason
        self._connection = None
        if self._receiver is not None and self._buffer is None:
            self._finish_delivery()

    def _finish_delivery(self) -> None:
        receiver, self._receiver = self._receiver, False  # False: delivered and ended
        if receiver:
            assert self._end is not None
            receiver.connectionLost(self._end)


class _BodyTransport:
    """The transport a body protocol gets: flow control of the upstream connection."""

    __slots__ = ("_response",)

    def __init__(self, response: H1Response) -> None:
        self._response = response

    def pauseProducing(self) -> None:
        connection = self._response._connection
        if connection is not None and connection.transport is not None:
            connection.paused = True
            transport: Any = connection.transport  # an IPushProducer too
            transport.pauseProducing()

    def resumeProducing(self) -> None:
        connection = self._response._connection
        if connection is not None and connection.transport is not None:
            connection.paused = False
            transport: Any = connection.transport
            transport.resumeProducing()

    def abortConnection(self) -> None:
        """The same as :meth:`stopProducing`."""
        self.stopProducing()

    def stopProducing(self) -> None:
        """Nobody wants the rest: abort the upstream connection (never pooled)."""
        connection = self._response._connection
        if connection is not None:
            connection.abandon()


class AnswerHead:
    """One connection's reader of answer heads: llhttp's head callbacks (through
    ``httptools.HttpResponseParser``), the checks of the module doc, and the
    :class:`H1Response` of each final answer.

    It is the parser's protocol object, its callbacks attributes bound once per
    connection (the parser, made per request, reads them by name: no bound method is
    made per request): the head's are its own methods; the body's (``on_body``,
    ``on_message_complete``) are the connection's, called by the parser with no layer
    between (once per streamed event).

    :param connection: the connection the answers come on (each ``H1Response``'s flow
        control).
    :param on_body: called with each body chunk (bytes).
    :param on_message_complete: called when an answer ends as its framing says.
    :param answered: called with each final answer's ``H1Response`` once its head is
        read (before any body byte), and True when it has no body.
    :ivar chunked: the answer is chunked (a stream).
    :ivar closes: the answer says its connection closes after it.
    :ivar keep_alive: seconds the host keeps an idle connection open (the answer's
        ``Keep-Alive: timeout=N``), or None when it did not say.
    """

    __slots__ = (
        "on_message_begin", "on_status", "on_header", "on_headers_complete", "on_body", "on_message_complete",
        "chunked", "closes", "keep_alive", "_connection", "_answered", "_parser", "_method", "_final", "_phrase",
        "_headers", "_connection_values", "_length", "_encodings",
    )

    def __init__(self, connection: Upstream, on_body: Callable[[bytes], None], on_message_complete: Callable[[], None],
                 answered: Callable[[H1Response, bool], None]) -> None:
        self.on_message_begin = self._begin  # llhttp's callbacks, by the names httptools reads
        self.on_status = self._status
        self.on_header = self._header
        self.on_headers_complete = self._headers_complete
        self.on_body = on_body
        self.on_message_complete = on_message_complete
        self._connection = connection
        self._answered = answered
        self._parser: Any = None
        self._method = b""
        self._final = False
        self.chunked = False
        self.closes = False
        self.keep_alive: float | None = None
        self._phrase = b""
        self._headers = Headers()
        self._connection_values: list[bytes] = []
        self._length: Any = UNKNOWN_LENGTH
        self._encodings: list[bytes] = []

    def parser(self, method: bytes) -> Any:
        """A new parser (``httptools.HttpResponseParser``) for the answer to one
        ``method`` request."""
        self._method = method
        self._final = False
        self._parser = parser = httptools.HttpResponseParser(self)
        # Content-Length beside chunked: the chunked framing wins (RFC 9112 §6.3); a
        # space before a chunk extension's ";" is the BWS RFC 9112 §7.1.1 allows.
        parser.set_dangerous_leniencies(lenient_chunked_length=True, lenient_spaces_after_chunk_size=True)
        return parser

    def _begin(self) -> None:
        if self._final:
            raise UnsolicitedAnswer("bytes after a complete answer, with no request")
        self.keep_alive = None  # what this answer says (the last answer's word counts)
        self._phrase = b""
        self._headers = Headers()
        self._connection_values = []
        self._length = UNKNOWN_LENGTH
        self.chunked = False
        self._encodings = []

    def _status(self, phrase: bytes) -> None:
        self._phrase += phrase

    def _header(self, name: bytes, value: bytes) -> None:
        if self._final:
            return  # a trailer field: not relayed (its bytes count as framing)
        lower = name.lower()
        if lower in _CONNECTION_CONTROL and not (lower == b"content-length" and self._method == b"HEAD"):
            if lower == b"connection":
                self._connection_values.append(value)
            elif lower == b"content-length":
                self._length = int(value)  # llhttp checked it: digits, one value
            elif lower == b"transfer-encoding":
                self.chunked = True
                self._encodings.append(value)
            elif lower == b"keep-alive":
                self.keep_alive = _keep_alive(value)
            return
        self._headers.addRawHeader(name, value)

    def _headers_complete(self) -> None:
        parser = self._parser
        code = parser.get_status_code()
        phrase, self._phrase = self._phrase, b""
        if code == 101 or not 100 <= code <= 599:
            raise UnrelayableStatus(f"status code crossbar cannot relay: {code}")
        if code < 200:
            return  # an interim answer: skipped (its end starts the next message)
        if self.chunked and b",".join(self._encodings).strip().lower() != b"chunked":
            raise UnrelayableStatus("a transfer-coding other than chunked")  # as twisted.web refuses
        version = parser.get_http_version()
        if not version.startswith("1."):
            raise UnrelayableStatus(f"an HTTP version crossbar cannot relay: {version}")
        no_body = self._method == b"HEAD" or code in _NO_BODY_CODES
        if no_body or self.chunked:
            self._length = 0 if no_body else UNKNOWN_LENGTH
        self.closes = not parser.should_keep_alive() or any(
            b"close" in v.lower() for v in self._connection_values
        ) or (self.chunked and version == "1.0")  # faulty framing: close after (RFC 9112 §6.1)
        self._final = True
        self._answered(H1Response(code, phrase, self._headers, self._length, tuple(self._connection_values),
                                  self._connection), no_body)


def status_line_cr(data: bytes) -> bytes:
    """``data`` with any bare CR in its first (status) line made a space: twisted.web
    read such a reason phrase as text (and crossbar does not relay it, RFC 9112 §4)
    where llhttp refuses the answer; a CR there never ends the line (no header can be
    slipped in through it)."""
    end = data.find(b"\n")
    line_end = end - 1 if end > 0 and data[end - 1] == 13 else (end if end >= 0 else len(data))
    if data.find(b"\r", 0, line_end) < 0:
        return data
    return data[:line_end].replace(b"\r", b" ") + data[line_end:]


_KEEP_ALIVE_SEEN: dict[bytes, float | None] = {}


def _keep_alive(value: bytes) -> float | None:
    """:func:`keep_alive_timeout`, remembered per header value (a host sends the same
    one on every answer; a host that varies it cannot grow the memory past 64)."""
    try:
        return _KEEP_ALIVE_SEEN[value]
    except KeyError:
        pass
    if len(_KEEP_ALIVE_SEEN) >= 64:
        _KEEP_ALIVE_SEEN.clear()
    timeout = _KEEP_ALIVE_SEEN[value] = keep_alive_timeout(value)
    return timeout


def keep_alive_timeout(value: bytes) -> float | None:
    """The ``timeout`` parameter of a ``Keep-Alive`` header value (seconds, e.g.
    llama-server's ``timeout=5, max=100`` gives 5.0), or None when it has none or it is
    not a whole number."""
    for part in value.split(b","):
        name, _, number = part.partition(b"=")
        if name.strip().lower() == b"timeout":
            number = number.strip()
            return float(int(number)) if number.isdigit() and len(number) < 10 else None
    return None
