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
   it) is told of later pauses only, so the proxy must ask (DESIGN.md §Quality bar:
   memory per stream stays bounded).
"""

from __future__ import annotations

from twisted.web.server import Request

__all__ = ["BadRequestHook", "client_is_paused"]


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
