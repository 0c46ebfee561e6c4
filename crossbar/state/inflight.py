"""In-flight requests per host: the one count that status, metrics and choosing read
(docs/design.md §Choosing a host, rule 2).

A request counts against its host from the moment the host is chosen (connecting
included) until its answer ends (streams included) or fails; a failover moves it.
:class:`Inflight` keeps the counts per (route, host) (for the metrics' labels) and per
host (for room and least-busy), never below zero; a :class:`Lease` is one request's
claim and is released exactly once, however the request ends.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Callable

from twisted.internet.defer import Deferred

from crossbar.state.cells import HOST_INFLIGHT, ROUTE_HOST_INFLIGHT
from crossbar.state.counts import Counts

if TYPE_CHECKING:
    from crossbar.state.placement_share import PlacementShare

__all__ = ["Inflight", "Lease"]


class Inflight:
    """Requests in flight, by host and by (route, host).

    :param on_release: called (no arguments) whenever a lease is released or moved
        away from a host: a slot freed (the route queues listen here).
    :param counts: where this process's counts go and the shared ones are read
        (:class:`~crossbar.state.counts.Counts`: the workers' with workers, every
        instance's with ``cluster.redis``).
    :ivar models_share: with workers or ``cluster.redis``, where the counts per (host,
        model) go and the others' come from (docs/design.md §Where models live, rule 7).
    """

    def __init__(self, on_release: Callable[[], None] | None = None, counts: Counts | None = None) -> None:
        self._by_host: Counter[str] = Counter()
        self._by_route_host: Counter[tuple[str, str]] = Counter()
        self._by_host_model: Counter[tuple[str, str]] = Counter()
        self.on_release = on_release
        self.counts = counts if counts is not None else Counts()
        self._names: dict[tuple[str, str], tuple[str, str]] = {}  # (route, host) -> its two count names
        self.models_share: PlacementShare | None = None

    def host(self, host: str) -> int:
        """Requests in flight to ``host`` over every route (0 for an unknown host),
        from every worker when there are several, from every instance with a cluster
        that answers (each worker is an instance of its own there). A count, not a
        guess (status shows it): room under a max_inflight is taken in Redis when a
        request goes (enter's ``limit``)."""
        own = self._by_host.get(host, 0)
        counts = self.counts
        return counts.read(HOST_INFLIGHT, HOST_INFLIGHT.cell(host), own) if counts.shared else own

    def publish(self) -> None:
        """Write every count of this process again (after a reload, or on joining a
        cluster), and to :attr:`models_share`."""
        if self.models_share is not None:
            for (host, model), n in self._by_host_model.items():
                self.models_share.publish_inflight(host, model, n)
        for host, n in self._by_host.items():
            self.counts.publish(HOST_INFLIGHT, HOST_INFLIGHT.cell(host), n)
        for (route, host), n in self._by_route_host.items():
            self.counts.publish(ROUTE_HOST_INFLIGHT, ROUTE_HOST_INFLIGHT.cell(route, host), n)

    def by_host(self) -> dict[str, int]:
        """host -> requests in flight to it (hosts with none may be absent)."""
        return {h: n for h, n in self._by_host.items() if n}

    def by_route_host(self) -> dict[tuple[str, str], int]:
        """(route, host) -> requests in flight, including pairs that went back to 0
        (so a metric once seen reads 0 rather than vanishing); fleet-wide with
        workers, for every pair of the config and any this process still counts (a
        worker that served none of a pair's requests still reports the others')."""
        fleet = self.counts.fleet
        if fleet is None:
            return dict(self._by_route_host)
        pairs = dict.fromkeys(fleet.pairs) | dict.fromkeys(self._by_route_host)
        return {(r, h): self.counts.read(ROUTE_HOST_INFLIGHT, ROUTE_HOST_INFLIGHT.cell(r, h),
                                         self._by_route_host.get((r, h), 0)) for r, h in pairs}

    def host_model(self, host: str, model: str) -> int:
        """Requests for ``model`` (the id the host lists it under) in flight to ``host``
        from every process (docs/design.md §Where models live: a model in use)."""
        share = self.models_share
        own = self._by_host_model.get((host, model), 0)
        return own if share is None else own + share.inflight(host, model)

    def use_model(self, lease: Lease, model: str) -> None:
        """Count ``lease``'s request as one for ``model`` (the id its router-mode host
        lists it under) until it is released (docs/design.md §Where models live)."""
        if lease.host is None or lease.model is not None:
            return
        lease.model = model
        key = (lease.host, model)
        self._by_host_model[key] += 1
        if self.models_share is not None:
            self.models_share.publish_inflight(lease.host, model, self._by_host_model[key])

    def enter(self, route: str, host: str, limit: int | None = None) -> Lease:
        """Count one request of ``route`` against ``host``; returns its lease. With a
        joined cluster and the host's ``max_inflight`` in force (``limit``), the place
        is taken in Redis (:meth:`Counts.take <crossbar.state.counts.Counts.take>`,
        docs/design.md §Several crossbars): the lease's
        :attr:`Lease.taken` says whether it may go (False: the fleet has the host full;
        release the lease and choose again)."""
        self._by_host[host] += 1
        self._by_route_host[(route, host)] += 1
        lease = Lease(self, route, host)
        counts = self.counts
        if not counts.shared:  # this process's counts are the counts: nothing to publish or take
            return lease
        pair, name = self._names_of(route, host)
        counts.publish(ROUTE_HOST_INFLIGHT, pair, self._by_route_host[(route, host)])
        if limit is not None:
            lease.taken = counts.take(HOST_INFLIGHT, name, self._by_host[host], limit)
        else:
            counts.publish(HOST_INFLIGHT, name, self._by_host[host])
        return lease

    def _names_of(self, route: str, host: str) -> tuple[str, str]:
        """The names of the counts of (``route``, ``host``) and of ``host`` (built once)."""
        names = self._names.get((route, host))
        if names is None:
            names = self._names[(route, host)] = (ROUTE_HOST_INFLIGHT.cell(route, host), HOST_INFLIGHT.cell(host))
        return names

    def _leave(self, route: str, host: str, model: str | None = None) -> None:
        if model is not None and self._by_host_model.get((host, model), 0) > 0:
            self._by_host_model[(host, model)] -= 1
            if self.models_share is not None:
                self.models_share.publish_inflight(host, model, self._by_host_model[(host, model)])
            if not self._by_host_model[(host, model)]:
                del self._by_host_model[(host, model)]
        if self._by_host.get(host, 0) > 0:
            self._by_host[host] -= 1
            if not self._by_host[host]:
                del self._by_host[host]
        if self._by_route_host.get((route, host), 0) > 0:
            self._by_route_host[(route, host)] -= 1
        counts = self.counts
        if counts.shared:
            pair, name = self._names_of(route, host)
            counts.publish(ROUTE_HOST_INFLIGHT, pair, self._by_route_host[(route, host)])
            counts.publish(HOST_INFLIGHT, name, self._by_host.get(host, 0))
        if self.on_release is not None:
            self.on_release()


class Lease:
    """One request's claim on a host; :meth:`release` is idempotent.

    :ivar taken: None, or while the place is being taken in Redis, a Deferred that
        fires True (the request may go) or False (refused); never fails.
    """

    def __init__(self, inflight: Inflight, route: str, host: str, model: str | None = None) -> None:
        self._inflight = inflight
        self.route = route
        self.host: str | None = host
        self.model = model
        """the model it counts for (:meth:`Inflight.use_model`), or None"""
        self.taken: Deferred[bool] | None = None

    def release(self) -> None:
        """Stop counting this request (its answer ended, or it failed)."""
        host, self.host = self.host, None
        if host is not None:
            self._inflight._leave(self.route, host, self.model)
