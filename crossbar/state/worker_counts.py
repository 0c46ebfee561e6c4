"""The counts the workers of one crossbar share (docs/design.md §Workers): what
``workers: N`` needs so that room, least-busy, the queue, key limits, status and
metrics see every worker's requests, not one process's.

(Not the "fleet" of docs/design.md, which is the hosts: this module counts requests of the
crossbar's own worker processes, on one machine.)

One process (``workers: 1``) counts for itself and :class:`WorkerCounts` is not used.
With workers, each worker publishes its own counts -- requests in flight per host and per
(route, host), requests waiting per route and since when, affinity outcomes, requests
per client key -- into
its row of a :class:`~crossbar.state.shared.SharedCounts`, and reads every worker's totals from
it: room, least-busy, the queue, a key's ``max_inflight``, status and metrics then see
every worker's requests (a limit may be exceeded by at most N - 1: two workers may take
the last slot at the same moment). A key's ``limits`` are counted alike, in a file of
their own (:class:`~crossbar.state.box_limits.BoxLimits`).
"""

from __future__ import annotations

from crossbar.config import Config, ConfigError
from crossbar.state.box_limits import BoxLimits
from crossbar.state.cells import (
    CLUSTER_LOST, CLUSTER_SLOW, RESTARTS, affinity_cell, host_cell, is_counter, key_cell, queue_cell, queue_oldest_cell,
    route_host_cell, token_cell,
)
from crossbar.state.placement_share import share_names
from crossbar.state.shared import CELLS, SharedCounts, cell_map

__all__ = ["AFFINITY_OUTCOMES", "CLUSTER_LOST", "CLUSTER_SLOW", "RESTARTS", "WorkerCounts", "check_capacity", "token_cell"]

AFFINITY_OUTCOMES = ("home", "spill", "none")


def _names(config: Config) -> list[str]:
    names = [RESTARTS, CLUSTER_LOST, CLUSTER_SLOW]
    names += [host_cell(h) for h in config.hosts]
    names += [token_cell("h", h, k) for h in config.hosts for k in ("prompt", "cached", "generated")]
    names += [token_cell("r", r, k) for r in config.routes for k in ("prompt", "cached")]
    for route in config.routes.values():
        names += [queue_cell(route.name), queue_oldest_cell(route.name)]
        names += [route_host_cell(route.name, h) for h in route.hosts]
        names += [affinity_cell(route.name, o) for o in AFFINITY_OUTCOMES]
        names += [key_cell(route.name, key) for key in route.keys]
    placed = {h: None for r in config.routes.values() if r.placement is not None for h in r.hosts}
    names += share_names(list(placed))  # docs/design.md §Where models live, rule 7
    return names


def check_capacity(config: Config) -> None:
    """With workers, every count of ``config`` needs a shared cell.

    :raises ConfigError: more counts (hosts, routes x their hosts, queues, affinity
        outcomes, client keys) than :data:`~crossbar.state.shared.CELLS`.
    """
    needed = len(set(_names(config)))
    if needed > CELLS:
        raise ConfigError(config.source, "workers", f"this config needs {needed} shared counters and workers "
                          f"have {CELLS}: list fewer hosts per route (or fewer routes or keys), or use workers: 1")


class WorkerCounts:
    """Publishes this process's counts into its row of the shared counters and reads
    every worker's totals (the supervisor has a row too: restarts, and the affinity
    counts of workers that died).

    :param shared: the shared counters (this worker's row is ``shared.row``).
    :param config: the config whose names are counted (see :meth:`configure`).
    :param limits: in a worker, the client keys' limits counted for the box (the
        supervisor, which admits no request, has none).
    """

    def __init__(self, shared: SharedCounts, config: Config, limits: BoxLimits | None = None) -> None:
        self.shared = shared
        self.limits = limits
        self._cells: dict[str, int] = {}
        self.pairs: tuple[tuple[str, str], ...] = ()
        """Every (route, host) pair of the config: the in-flight series each worker
        reports, whichever requests it has seen itself."""
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Use the names of ``config`` (a reload); this worker's row is cleared: its
        owners publish again (:meth:`Runtime.republish <crossbar.state.runtime.Runtime.republish>`)."""
        self._cells = cell_map(_names(config))
        self.pairs = tuple((route.name, h) for route in config.routes.values() for h in route.hosts)
        self.shared.clear_row()
        if self.limits is not None:
            self.limits.configure(config)  # their counts stay: they are counts of the past minute and day

    def cell(self, name: str) -> int | None:
        """The shared cell of ``name`` (a name :func:`_names` derives from the config), or None."""
        return self._cells.get(name)

    def _set(self, name: str, value: int) -> None:
        cell = self._cells.get(name)
        if cell is not None:
            self.shared.set(cell, value)

    def _total(self, name: str) -> int:
        cell = self._cells.get(name)
        return self.shared.total(cell) if cell is not None else 0

    def publish_inflight(self, route: str, host: str, pair: int, host_total: int) -> None:
        """This worker has ``pair`` requests of ``route`` and ``host_total`` in all in
        flight to ``host``."""
        self._set(route_host_cell(route, host), pair)
        self._set(host_cell(host), host_total)

    def host(self, host: str) -> int:
        """Requests in flight to ``host`` from every worker."""
        return self._total(host_cell(host))

    def route_host(self, route: str, host: str) -> int:
        """Requests of ``route`` in flight to ``host`` from every worker."""
        return self._total(route_host_cell(route, host))

    def publish_queue(self, route: str, queued: int, oldest_ms: int) -> None:
        """This worker has ``queued`` requests waiting on ``route``, the oldest since
        ``oldest_ms`` (POSIX milliseconds, 0 for none)."""
        self._set(queue_cell(route), queued)
        self._set(queue_oldest_cell(route), oldest_ms)

    def queued(self, route: str) -> int:
        """Requests waiting on ``route`` in every worker."""
        return self._total(queue_cell(route))

    def oldest_queued_ms(self, route: str) -> int | None:
        """POSIX milliseconds since which the oldest waiting request (of any worker) of
        ``route`` waits, or None."""
        cell = self._cells.get(queue_oldest_cell(route))
        return self.shared.smallest(cell) if cell is not None else None

    def publish_affinity(self, route: str, outcome: str, count: int) -> None:
        """This worker dispatched ``count`` requests of ``route`` with ``outcome``."""
        self._set(affinity_cell(route, outcome), count)

    def affinity(self, route: str, outcome: str) -> int:
        """Requests of ``route`` dispatched with ``outcome`` by every worker."""
        return self._total(affinity_cell(route, outcome))

    def affinity_of_row(self, route: str, outcome: str, row: int) -> int:
        """What the process of ``row`` published for ``route`` and ``outcome`` (the
        supervisor keeps a dead worker's share of this counter)."""
        cell = self._cells.get(affinity_cell(route, outcome))
        return self.shared.get(cell, row) if cell is not None else 0

    def publish_key(self, route: str, key: str, count: int) -> None:
        """This worker has ``count`` requests of client key ``key`` on ``route`` in
        flight or waiting (docs/design.md §Access: a key's ``max_inflight``)."""
        self._set(key_cell(route, key), count)

    def key(self, route: str, key: str) -> int:
        """Requests of client key ``key`` on ``route`` in flight or waiting in every
        worker."""
        return self._total(key_cell(route, key))

    def publish_tokens(self, name: str, total: int) -> None:
        """This worker's token total of cell ``name`` (:func:`token_cell`) is ``total``."""
        self._set(name, total)

    def tokens(self, name: str) -> int:
        """The token total of cell ``name`` over every worker."""
        return self._total(name)

    def counter_cells(self) -> list[str]:
        """The names of the cells that are counters (:func:`_is_counter`): when a worker
        dies the supervisor keeps its share of each (:meth:`of_row`, :meth:`publish_counter`),
        so no counter goes down with it."""
        return [name for name in self._cells if is_counter(name)]

    def of_row(self, name: str, row: int) -> int:
        """What the process of ``row`` published in cell ``name`` (0 for a name not counted)."""
        cell = self._cells.get(name)
        return self.shared.get(cell, row) if cell is not None else 0

    def publish_counter(self, name: str, value: int) -> None:
        """This process's counter ``name`` (e.g. :data:`CLUSTER_LOST`) is ``value``."""
        self._set(name, value)

    def counter(self, name: str) -> int:
        """Counter ``name`` summed over every process (the supervisor's row included:
        the shares of workers that died)."""
        return self._total(name)

    def restarts(self) -> int:
        """Worker restarts, as the supervisor counted them."""
        return self._total(RESTARTS)

    def publish_restarts(self, count: int) -> None:
        """The supervisor has restarted ``count`` workers (it writes its own row)."""
        self._set(RESTARTS, count)
