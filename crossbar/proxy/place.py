"""One request's place in its route's queue (docs/design.md §Choosing a host, rule 4).

A :class:`QueuePlace` is the :class:`~crossbar.state.queue.Waiter` the route's queue
sees: it joins the queue with its ``queue.timeout``, leaves it (dispatched, answered,
gone), and counts each wait in the request's :class:`~crossbar.proxy.tally.Tally`. What
to do when room may have freed, or when the time is up, is the exchange's (the two
callbacks).
"""

from __future__ import annotations

from typing import Callable

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from crossbar.config import Route
from crossbar.proxy.policy import queue_refusal
from crossbar.proxy.tally import Tally
from crossbar.state.queue import RouteQueues

__all__ = ["QueuePlace"]


class QueuePlace:
    """A request's place in ``route_name``'s queue.

    :param retry: called when room may have freed; True once the request left the
        queue's concern (dispatched, or answered because no host is left).
    :param timed_out: called once ``queue.timeout`` passed in the queue (the place
        left it first).
    """

    def __init__(self, queues: RouteQueues, clock: IReactorTime, tally: Tally,
                 retry: Callable[[], bool], timed_out: Callable[[], None]) -> None:
        self.queues, self.clock, self.tally, self.route_name = queues, clock, tally, ""
        self.retry = retry
        self.timed_out = timed_out
        self.timer: IDelayedCall | None = None

    @property
    def queued_at(self) -> float | None:
        """Reactor seconds when the request first joined its queue (the oldest wait)."""
        return self.tally.queued_at

    @property
    def key(self) -> str:
        """The client key the request presented ("" for none): the fair order's unit
        (docs/design.md §Access, "Fair shares")."""
        return self.tally.head.key

    def join(self, route: Route, preflight: bool) -> str | None:
        """Wait at the end of ``route``'s queue for at most its ``queue.timeout`` seconds,
        or say why the request may not wait (:func:`~crossbar.proxy.policy.queue_refusal`:
        a 503's message; ``preflight``: a keyless request on a keyed route)."""
        refusal = queue_refusal(route.queue.max, preflight, self.queues.queued(route.name))
        if refusal is not None:
            return refusal
        self.route_name = route.name
        self.tally.joined_queue()
        self.queues.add(self)
        self.timer = self.clock.callLater(route.queue.timeout, self._time_is_up)
        return None

    def leave(self) -> None:
        """Out of the queue (if in it): stop the timer, count the wait."""
        timer, self.timer = self.timer, None
        if timer is not None and timer.active():
            timer.cancel()
        if self.queues.remove(self):
            self.tally.left_queue(self.route_name)

    def _time_is_up(self) -> None:
        self.timer = None
        self.leave()
        self.timed_out()
