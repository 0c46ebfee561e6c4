""""Wait until X": one helper instead of hand-written lists of waiters.

:class:`Condition` hands out Deferreds that fire once a predicate holds. Whoever changes
the facts the predicate reads calls :meth:`Condition.check`; nothing polls. crossbar
uses it for "every host's first poll is done", "no request in flight" and "listening".
"""

from __future__ import annotations

from typing import Callable

from twisted.internet.defer import Deferred, succeed

__all__ = ["Condition"]


class Condition:
    """Deferreds that fire (with None) once ``predicate()`` is true.

    :param predicate: read on :meth:`wait` and on every :meth:`check`; must not raise.
    """

    def __init__(self, predicate: Callable[[], bool]) -> None:
        self._predicate = predicate
        self._waiters: list[Deferred[None]] = []

    def wait(self) -> Deferred[None]:
        """A Deferred that fires once the predicate holds: at once if it holds now.

        Cancelling it just forgets the waiter (it errbacks with ``CancelledError``).
        """
        if self._predicate():
            return succeed(None)
        d: Deferred[None] = Deferred(self._forget)
        self._waiters.append(d)
        return d

    def check(self) -> None:
        """Re-read the predicate; if it holds, fire every waiter (call after a change)."""
        if self._waiters and self._predicate():
            waiters, self._waiters = self._waiters, []
            for d in waiters:
                if not d.called:  # a waiter's callback may have cancelled a later one
                    d.callback(None)

    def _forget(self, d: Deferred[None]) -> None:
        if d in self._waiters:
            self._waiters.remove(d)
