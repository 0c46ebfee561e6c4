"""Every place crossbar touches a private Twisted name, fenced in one module.

Each touchpoint says why it is needed; no public API does the same. They were checked
against Twisted 25.5 through 26.10 (the version pinned in ``.ci/constraints.txt``), and
``tests/test_twisted_private.py`` fails loudly if a Twisted release moves any of them:
take a new Twisted on purpose, after that test and the suite pass.

1. :class:`ClientProtocol` (the health poller's client; the proxy path uses its own
   client, :mod:`crossbar.upstream.h1client`) subclasses ``twisted.web._newclient.HTTP11ClientProtocol``
   and reads its parser (``_parser``, its ``statusReceived``, ``connHeaders``,
   ``response``, ``state`` with the ``STATUS``/``HEADER`` states, and ``_giveUp``):
   - the answer's ``Connection`` header, which Twisted keeps out of
     ``IResponse.headers``, names headers the proxy must drop (DESIGN.md §The proxy,
     rule 6);
   - Twisted bounds each head line but not how many there are, so a host could make
     crossbar read an endless head (rule 9): :data:`MAX_RESPONSE_HEAD`;
   - Twisted accepts any integer status, and skips ``101`` as an interim answer then
     parses the next protocol's bytes as HTTP: such answers are refused as a failed
     request (rule 7).
2. :func:`quiet_pool` sets ``HTTPConnectionPool._factory`` so the pool builds
   :class:`ClientProtocol` (there is no public way to choose the protocol of an
   ``Agent``'s connections) and does not log every connection it opens.
3. :class:`BadRequestHook` overrides ``HTTPChannel._respondToBadRequestAndDisconnect``:
   Twisted's answer to a request it cannot parse is a bare ``400``; crossbar's errors
   are JSON and logged (rules 8-9).
4. :func:`client_is_paused` reads ``HTTPChannel._waitingForTransport``: a producer
   registered on a request whose connection is already full (a pipelined answer before
   it) is told of later pauses only, so the proxy must ask (DESIGN.md §Quality bar:
   memory per stream stays bounded).
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool
from twisted.web.client import _HTTP11ClientFactory
from twisted.web._newclient import HEADER, STATUS, HTTP11ClientProtocol, ParseError
from twisted.web.server import Request

from crossbar.upstream.tcp import no_delay

__all__ = [
    "MAX_RESPONSE_HEAD", "BadRequestHook", "ClientProtocol", "ResponseHeadTooLarge", "client_is_paused",
    "quiet_pool",
]

MAX_RESPONSE_HEAD = 64 * 1024
"""The most bytes of an upstream answer's head (status lines and headers, interim
``1xx`` answers included) crossbar reads before giving up on it (DESIGN.md §The proxy,
rule 9)."""


class ResponseHeadTooLarge(Exception):
    """An upstream answer's head went over :data:`MAX_RESPONSE_HEAD` bytes."""


class ClientProtocol(HTTP11ClientProtocol):
    """Twisted's client protocol, also telling the proxy the answer's ``Connection``
    header (touchpoint 1). Each response gets the attribute ``upstream_connection``:
    the raw ``Connection`` values (a tuple of bytes).

    It refuses answers crossbar cannot relay as a failed request (so the proxy marks
    the host down and answers 502): a head over :data:`MAX_RESPONSE_HEAD` bytes, a
    status code outside 100-599, and ``101 Switching Protocols``."""

    _head_bytes = 0

    def connectionMade(self) -> None:
        super().connectionMade()
        no_delay(self.transport)

    def request(self, request: Any) -> Deferred[Any]:
        d = super().request(request)
        parser = self._parser
        self._head_bytes = 0
        if parser is not None:
            parse_status = parser.statusReceived

            def status_received(line: bytes) -> None:
                parse_status(line)
                code = parser.response.code
                if code == 101 or not 100 <= code <= 599:
                    raise ParseError("status code crossbar cannot relay", line[:100])

            parser.statusReceived = status_received  # type: ignore[method-assign]

        def keep(response: Any) -> Any:
            values = parser.connHeaders.getRawHeaders(b"connection", ()) if parser is not None else ()
            response.upstream_connection = tuple(values)
            return response

        d.addCallback(keep)
        return d

    def dataReceived(self, bytes: bytes) -> None:
        parser = self._parser
        if parser is None or parser.state not in (STATUS, HEADER):
            super().dataReceived(bytes)
            return
        self._head_bytes += len(bytes)
        super().dataReceived(bytes)
        # Still in the head after all of it: every byte counted was head.
        if self._parser is parser and parser.state in (STATUS, HEADER) and self._head_bytes > MAX_RESPONSE_HEAD:
            self._giveUp(Failure(ResponseHeadTooLarge(f"response head over {MAX_RESPONSE_HEAD} bytes")))
            transport: Any = self.transport  # an ITCPTransport
            transport.abortConnection()  # never wait to flush to a host we gave up on


class _QuietFactory(_HTTP11ClientFactory):
    noisy = False  # no "Starting factory" line per upstream connection

    def buildProtocol(self, addr: Any) -> HTTP11ClientProtocol:
        return ClientProtocol(self._quiescentCallback)


def quiet_pool(reactor: IReactorTime, persistent: bool) -> HTTPConnectionPool:
    """An ``HTTPConnectionPool`` of :class:`ClientProtocol` connections that does not
    log every connection it opens (touchpoint 2)."""
    pool = HTTPConnectionPool(reactor, persistent=persistent)
    pool._factory = _QuietFactory
    return pool


class BadRequestHook:
    """Mix into an ``HTTPChannel`` subclass and define :meth:`respond_to_bad_request`
    (touchpoint 3): it is called instead of Twisted's bare ``400``, and must answer and
    close the connection."""

    def respond_to_bad_request(self) -> None:
        raise NotImplementedError

    def _respondToBadRequestAndDisconnect(self) -> None:
        self.respond_to_bad_request()


def client_is_paused(request: Request) -> bool:
    """Whether the client connection of ``request`` is already full, i.e. a producer
    registered now would not be told to pause (touchpoint 4)."""
    return bool(getattr(request.channel, "_waitingForTransport", False))
