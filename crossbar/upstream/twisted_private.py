"""Every place crossbar touches a private Twisted name, fenced in one module.

Each touchpoint says why it is needed; no public API does the same. They were checked
against Twisted 25.5 through 26.10 (the version pinned in ``.ci/constraints.txt``), and
``tests/test_twisted_private.py`` fails loudly if a Twisted release moves any of them:
take a new Twisted on purpose, after that test and the suite pass.

1. :class:`BadRequestHook` overrides ``HTTPChannel._respondToBadRequestAndDisconnect``:
   Twisted's answer to a request it cannot parse is a bare ``400``; crossbar's errors
   are JSON and logged (rules 8-9).
2. :func:`client_is_paused` reads ``HTTPChannel._waitingForTransport``: a producer
   registered on a request whose connection is already full (a pipelined answer before
   it) is told of later pauses only, so the proxy must ask (docs/design.md §Quality bar:
   memory per stream stays bounded).
3. :func:`wrap_port_logger` replaces a listening ``tcp.Port``'s ``_logger`` (a class
   attribute, read in ``doRead``): Twisted logs one line per connection it could not
   accept (``EMFILE``: 350 KB of log in 45 s under a descriptor shortage), and no
   public API filters one port's events (docs/design.md §The proxy, rule 9: at most once a
   minute).
4. :func:`pending_write_bytes` reads ``FileDescriptor.dataBuffer``, ``offset`` and
   ``_tempDataLen`` of the client's TCP transport: whether a client took any byte of
   what crossbar holds for it (``timeouts.client_stall``, docs/design.md §The proxy rule 7).
   Twisted tells a producer only when its buffer is empty again, so a slow client that
   keeps reading would look stalled for as long as one buffer takes to drain.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.logger import Logger
from twisted.web.server import Request

__all__ = ["BadRequestHook", "client_is_paused", "pending_write_bytes", "wrap_port_logger"]


class BadRequestHook:
    """Mix into an ``HTTPChannel`` subclass and define :meth:`respond_to_bad_request`
    (touchpoint 1): it is called instead of Twisted's bare ``400``, and must answer and
    close the connection."""

    def respond_to_bad_request(self) -> None:
        raise NotImplementedError

    def _respondToBadRequestAndDisconnect(self) -> None:
        self.respond_to_bad_request()


def client_is_paused(request: Request) -> bool:
    """Whether the client connection of ``request`` is already full, i.e. a producer
    registered now would not be told to pause (touchpoint 2)."""
    return bool(getattr(request.channel, "_waitingForTransport", False))


def wrap_port_logger(port: object, wrap: Callable[[Any], Any]) -> bool:
    """Send the log events of the listening ``port`` (a ``twisted.internet.tcp.Port``)
    through ``wrap(its observer)`` (touchpoint 3); returns False, changing nothing, for
    a port without a ``_logger`` (another kind of listener)."""
    logger = getattr(port, "_logger", None)
    if not isinstance(logger, Logger):
        return False
    setattr(port, "_logger", Logger(namespace=logger.namespace, source=logger.source, observer=wrap(logger.observer)))
    return True


def pending_write_bytes(request: Request) -> int | None:
    """Bytes written to the client connection of ``request`` that its transport still
    holds (not yet taken by the kernel), or None when the transport does not say
    (touchpoint 4). A TLS connection's bytes are counted on the TCP transport under it."""
    transport: Any = getattr(request.channel, "transport", None)
    for _ in range(3):  # the channel's transport, or a TLS protocol's TCP transport
        if transport is None:
            return None
        data = getattr(transport, "dataBuffer", None)
        if isinstance(data, bytes):
            return len(data) - int(transport.offset) + int(transport._tempDataLen)
        transport = getattr(transport, "transport", None)
    return None
