"""Requests waiting for a host with room (docs/design.md §Choosing a host, rule 4; §Access,
"Fair shares").

Each route has one queue. Nothing polls: whenever a slot frees, the health table
changes or the config is reloaded, :meth:`RouteQueues.wake` looks at the waiting
requests in fair order (:func:`~crossbar.state.fair.fair_order`: a key's priority, then
the key that holds the least of the fleet for its share, then arrival; within a key,
arrival order) and each one whose :meth:`Waiter.retry` finds a host (or learns that none
is left) leaves the queue. A later request for another model may pass one whose tier
is still full. Timeouts, a client that leaves and the drain remove a waiter through
:meth:`RouteQueues.remove`.

The queue is this process's (with workers or ``cluster.redis`` each process has its
own); the in-flight counts the fair order reads are the fleet's (:class:`Standing`).
A pass costs nothing more than before while at most one key waits on a route.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Generator, Protocol

from crossbar.state.fair import NO_KEY, Waiting, fair_turns

__all__ = ["RouteQueues", "Standing", "Waiter"]


class Waiter(Protocol):
    """A waiting request, as the queue sees it."""

    @property
    def route_name(self) -> str:
        """The route whose queue it is in."""

    @property
    def queued_at(self) -> float | None:
        """Reactor seconds when it first joined the queue."""

    @property
    def key(self) -> str:
        """The name of the client key it presented (:data:`~crossbar.state.fair.NO_KEY`: none)."""

    def retry(self) -> bool:
        """Try rules 1-3 again; True when the request left the queue's concern (it was
        dispatched, or answered because no host is left), False to keep waiting."""


class Standing(Protocol):
    """What the fair order reads about a route's client keys (docs/design.md §Access)."""

    def settings(self, route: str, key: str) -> tuple[int, float]:
        """The key's (``priority``, ``share``) under the current config; (0, 1.0) for
        :data:`~crossbar.state.fair.NO_KEY` or a key the config no longer has."""

    def requests(self, route: str, key: str) -> int:
        """The key's requests in flight or waiting, fleet-wide (every worker's and,
        with ``cluster.redis``, every instance's); 0 for :data:`~crossbar.state.fair.NO_KEY`."""

    def spent(self, route: str, key: str) -> int:
        """The tokens ``key`` spent in the last minute (0 for none)."""


class RouteQueues:
    """The queues of every route.

    :param now: reactor seconds (``reactor.seconds``), for the oldest wait.
    :ivar on_change: called with a route's name whenever its queue grew or shrank.
    :ivar standing: the keys' settings and counts for the fair order; None: every
        request is of one key (arrival order).
    """

    def __init__(self, now: Callable[[], float], standing: Standing | None = None) -> None:
        self._now = now
        self.on_change: Callable[[str], None] | None = None
        self.standing = standing
        self._queues: dict[str, dict[int, Waiter]] = {}
        self._keys: dict[str, Counter[str]] = {}
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

    def add(self, waiter: Waiter) -> None:
        """Put ``waiter`` at the end of its route's queue (the caller checked
        ``queue.max``)."""
        route = waiter.route_name
        self._queues.setdefault(route, {})[id(waiter)] = waiter
        self._keys.setdefault(route, Counter())[waiter.key] += 1
        if self.on_change is not None:
            self.on_change(route)

    def remove(self, waiter: Waiter) -> bool:
        """Take ``waiter`` out of its queue; False if it was not in it."""
        route = waiter.route_name
        queue = self._queues.get(route)
        if queue is None or queue.pop(id(waiter), None) is None:
            return False
        keys = self._keys[route]
        keys[waiter.key] -= 1
        if not keys[waiter.key]:
            del keys[waiter.key]
        if not queue:
            del self._queues[route]
            del self._keys[route]
        if self.on_change is not None:
            self.on_change(route)
        return True

    def waiters(self) -> list[Waiter]:
        """Every waiting request, route by route, each route in arrival order."""
        return [w for q in self._queues.values() for w in q.values()]

    def inflight(self, route: str, key: str) -> int:
        """The requests of ``key`` on ``route`` in flight, as the fair order counts
        them: the fleet's requests of the key in flight or waiting, less those waiting
        here (with workers, those waiting in another process count as in flight)."""
        if self.standing is None or key == NO_KEY:
            return 0
        waiting = self._keys.get(route)
        return max(0, self.standing.requests(route, key) - (waiting[key] if waiting else 0))

    def fair(self, route: str) -> list[Waiter]:
        """``route``'s waiting requests in fair order, as :meth:`wake` would try them
        were each placed (:func:`~crossbar.state.fair.fair_order`)."""
        n = self.queued(route)
        if not n:
            return []
        turns = self._turns(route)
        return [next(turns)] + [turns.send(True) for _ in range(n - 1)]

    def _turns(self, route: str) -> Generator[Waiter, bool, None]:
        """:func:`~crossbar.state.fair.fair_turns` over ``route``'s waiting requests,
        reading the standing only when two keys or more wait."""
        waiters = list(self._queues.get(route, {}).values())
        keys = self._keys.get(route, Counter())
        standing = self.standing
        if standing is None or len(keys) < 2:
            return fair_turns([Waiting(w) for w in waiters], {}, {})
        settings = {key: standing.settings(route, key) for key in keys}
        entries = [Waiting(w, w.key, *settings[w.key]) for w in waiters]
        inflight = {key: self.inflight(route, key) for key in keys}
        return fair_turns(entries, inflight, {key: standing.spent(route, key) for key in keys})

    def status(self, route: str) -> dict[str, dict[str, Any]]:
        """What waits on ``route`` here, per key (docs/design.md §Access): ``priority``,
        ``share``, ``queued`` (this process's) and ``inflight`` (as :meth:`inflight`)."""
        out: dict[str, dict[str, Any]] = {}
        for key, queued in sorted(self._keys.get(route, Counter()).items()):
            priority, share = self.standing.settings(route, key) if self.standing is not None else (0, 1.0)
            out[key] = {"priority": priority, "share": share, "queued": queued,
                        "inflight": self.inflight(route, key)}
        return out

    def wake(self) -> None:
        """Something may have freed room: retry the waiting requests, each route's in
        fair order (:meth:`fair`).

        Re-entrant calls (a dispatch that frees a slot at once) are folded into one
        more pass instead of recursing.
        """
        if not self._queues:
            return
        if self._waking:
            self._again = True
            return
        self._waking = True
        try:
            self._again = True
            while self._again:
                self._again = False
                for route in list(self._queues):
                    self._pass(route)
        finally:
            self._waking = False

    def _pass(self, route: str) -> None:
        """Retry ``route``'s waiters in fair order, telling the order which ones went."""
        turns = self._turns(route)
        try:
            waiter = next(turns)
            while True:
                went = self._is_queued(waiter) and waiter.retry()
                if went:
                    self.remove(waiter)
                waiter = turns.send(went)
        except StopIteration:
            pass

    def _is_queued(self, waiter: Waiter) -> bool:
        return id(waiter) in self._queues.get(waiter.route_name, {})
