"""Fakes beside the real implementations, for unit tests of one rule at a time.

:class:`FakeProbe` implements :class:`~crossbar.hosts.poller.IHostProbe` like
:class:`~crossbar.hosts.poller.HTTPProbe` does, but each poll is a Deferred the test fires.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request
from zope.interface import implementer

from crossbar.hosts.poller import IHostProbe, PollCancelled, PollFailed

__all__ = ["FakeProbe"]


@implementer(IHostProbe)
class FakeProbe:
    """A probe whose polls stay pending until the test answers them.

    :ivar polls: every poll started, in order, as ``(url, deferred)``.
    :ivar slot_reads: every slots read started, in order, as ``(url, deferred)``.
    """

    def __init__(self) -> None:
        self.polls: list[tuple[str, Deferred[tuple[str, ...]]]] = []
        self.slot_reads: list[tuple[str, Deferred[int]]] = []
        self._phase: dict[int, str] = {}

    def slots(self, url: str) -> Deferred[int]:
        """Start a ``/props`` read of ``url`` (answered by the test through
        :attr:`slot_reads`)."""
        d: Deferred[int] = Deferred()
        self.slot_reads.append((url, d))
        return d

    def poll(self, url: str) -> Deferred[tuple[str, ...]]:
        """Start a poll of ``url``; it is in its ``health`` phase until :meth:`advance`.

        Cancelling it errbacks with :class:`PollCancelled` naming the current phase, as
        :class:`~crossbar.hosts.poller.HTTPProbe` does.
        """
        d: Deferred[tuple[str, ...]] = Deferred(lambda d: d.errback(PollCancelled(self._phase.pop(id(d), "health"))))
        self._phase[id(d)] = "health"
        self.polls.append((url, d))
        return d

    def advance(self, url: str) -> None:
        """Move the oldest pending poll of ``url`` on to its ``models`` phase."""
        self._phase[id(self.pending(url)[0])] = "models"

    def pending(self, url: str) -> list[Deferred[tuple[str, ...]]]:
        """The polls of ``url`` not answered yet."""
        return [d for u, d in self.polls if u == url and not d.called]

    def succeed(self, url: str, models: tuple[str, ...] = ()) -> None:
        """Answer the oldest pending poll of ``url`` as good, with ``models`` resident."""
        d = self.pending(url)[0]
        self._phase.pop(id(d), None)
        d.callback(tuple(models))

    def fail(self, url: str, reason: str = "health: HTTP 503") -> None:
        """Answer the oldest pending poll of ``url`` as failed with ``reason``."""
        d = self.pending(url)[0]
        self._phase.pop(id(d), None)
        d.errback(PollFailed(reason))


class HoldResource(Resource):
    """A leaf resource that keeps every request open (``NOT_DONE_YET``) in
    :attr:`requests`, for the test to answer or abandon."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []

    def render(self, request: Request) -> Any:
        self.requests.append(request)
        return NOT_DONE_YET
