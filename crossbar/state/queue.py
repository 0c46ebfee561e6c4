"""Requests waiting for a host with room (docs/design.md §Choosing a host, rule 4).

Each route has one queue, in arrival order. Nothing polls: whenever a slot frees, the
health table changes or the config is reloaded, :meth:`RouteQueues.wake` looks at the
waiting requests in arrival order and each one whose :meth:`Waiter.retry` finds a host
(or learns that none is left) leaves the queue. A later request for another model may
pass one whose tier is still full. Timeouts, a client that leaves and the drain remove
a waiter through :meth:`RouteQueues.remove`.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Protocol

__all__ = ["RouteQueues", "Waiter"]


class Waiter(Protocol):
    """A waiting request, as the queue sees it."""

    @property
    def route_name(self) -> str:
        """The route whose queue it is in."""

    @property
    def queued_at(self) -> float | None:
        """Reactor seconds when it first joined the queue."""

    def retry(self) -> bool:
        """Try rules 1-3 again; True when the request left the queue's concern (it was
        dispatched, or answered because no host is left), False to keep waiting."""


class RouteQueues:
    """The queues of every route.

    :param now: reactor seconds (``reactor.seconds``), for the oldest wait.
    :ivar on_change: called with a route's name whenever its queue grew or shrank.
    """

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.on_change: Callable[[str], None] | None = None
        self._queues: dict[str, dict[int, Waiter]] = {}
        self._models: Counter[str] = Counter()
        self._waking = False
        self._again = False

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queued(self, route: str) -> int:
        """Requests waiting on ``route``."""
        return len(self._queues.get(route, ()))

    def oldest_since(self, route: str) -> float | None:
        """Reactor seconds since which the oldest waiting request of ``route`` waits."""
        queue = self._queues.get(route)
        return next(iter(queue.values())).queued_at if queue else None

    def oldest_wait(self, route: str) -> float | None:
        """Seconds the oldest waiting request of ``route`` has waited, or None."""
        queue = self._queues.get(route)
        if not queue:
            return None
        since = next(iter(queue.values())).queued_at
        return None if since is None else self._now() - since

    def waiting_for(self, model: str) -> int:
        """Requests waiting (on any route) that want ``model`` (a waiter's ``model``
        attribute, when it has one): docs/design.md §Where models live, a model wanted."""
        return self._models.get(model, 0)

    def add(self, waiter: Waiter) -> None:
        """Put ``waiter`` at the end of its route's queue (the caller checked
        ``queue.max``)."""
        model = getattr(waiter, "model", None)
        if isinstance(model, str):
            self._models[model] += 1
        self._queues.setdefault(waiter.route_name, {})[id(waiter)] = waiter
        if self.on_change is not None:
            self.on_change(waiter.route_name)

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out of its queue; False if it was not in it."""
        queue = self._queues.get(waiter.route_name)
        if queue is None or queue.pop(id(waiter), None) is None:
            return False
        model = getattr(waiter, "model", None)
        if isinstance(model, str) and self._models.get(model, 0) > 0:
            self._models[model] -= 1
            if not self._models[model]:
                del self._models[model]
        if not queue:
            del self._queues[waiter.route_name]
        if self.on_change is not None:
            self.on_change(waiter.route_name)
        return True

    def waiters(self) -> list[Waiter]:
        """Every waiting request, route by route, each route in arrival order."""
        return [w for q in self._queues.values() for w in q.values()]

    def wake(self) -> None:
        """Something may have freed room: retry the waiting requests in arrival order.

        Re-entrant calls (a dispatch that frees a slot at once) are folded into one
        more pass instead of recursing.
        """
        if self._waking:
            self._again = True
            return
        self._waking = True
        try:
            self._again = True
            while self._again:
                self._again = False
                for waiter in self.waiters():
                    if self._is_queued(waiter) and waiter.retry():
                        self.remove(waiter)
        finally:
            self._waking = False

    def _is_queued(self, waiter: Waiter) -> bool:
        return id(waiter) in self._queues.get(waiter.route_name, {})
