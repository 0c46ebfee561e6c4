"""Fakes beside the real implementations, for unit tests of one rule at a time.

:class:`FakeProbe` implements :class:`~crossbar.poller.IHostProbe` like
:class:`~crossbar.poller.HTTPProbe` does, but each poll is a Deferred the test fires.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred
from zope.interface import implementer

from crossbar.poller import IHostProbe, PollCancelled, PollFailed

__all__ = ["FakeProbe"]


@implementer(IHostProbe)
class FakeProbe:
    """A probe whose polls stay pending until the test answers them.

    :ivar polls: every poll started, in order, as ``(url, deferred)``.
    """

    def __init__(self) -> None:
        self.polls: list[tuple[str, Deferred[tuple[str, ...]]]] = []

    def poll(self, url: str) -> Deferred[tuple[str, ...]]:
        d: Deferred[tuple[str, ...]] = Deferred(lambda d: d.errback(PollCancelled("health")))
        self.polls.append((url, d))
        return d

    def pending(self, url: str) -> list[Deferred[tuple[str, ...]]]:
        """The polls of ``url`` not answered yet."""
        return [d for u, d in self.polls if u == url and not d.called]

    def succeed(self, url: str, models: tuple[str, ...] = ()) -> None:
        """Answer the oldest pending poll of ``url`` as good, with ``models`` resident."""
        self.pending(url)[0].callback(tuple(models))

    def fail(self, url: str, reason: str = "health: HTTP 503") -> None:
        """Answer the oldest pending poll of ``url`` as failed with ``reason``."""
        self.pending(url)[0].errback(PollFailed(reason))
