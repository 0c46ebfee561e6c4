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
their own (:class:`~crossbar.state.box_limits.BoxLimits`). Which counts go where, and
what is read, is decided by :class:`~crossbar.state.counts.Counts`; this module only
holds the names (:func:`_names`, from the config) and their cells.
"""

from __future__ import annotations

from crossbar.config import Config, ConfigError
from crossbar.state.box_limits import BoxLimits
from crossbar.state.cells import (
    AFFINITY, CLUSTER_LOST, CLUSTER_SLOW, HOST_INFLIGHT, KEY_INFLIGHT, QUEUED, QUEUED_SINCE, RESTARTS,
    ROUTE_HOST_INFLIGHT, is_counter, token_cell,
)
from crossbar.state.placement_share import share_names
from crossbar.state.shared import CELLS, SharedCounts, cell_map

__all__ = ["AFFINITY_OUTCOMES", "WorkerCounts", "check_capacity"]

AFFINITY_OUTCOMES = ("home", "spill", "none")


def _names(config: Config) -> list[str]:
    names = [RESTARTS.cell(), CLUSTER_LOST.cell(), CLUSTER_SLOW.cell()]
    names += [HOST_INFLIGHT.cell(h) for h in config.hosts]
    names += [token_cell("h", h, k) for h in config.hosts for k in ("prompt", "cached", "generated")]
    names += [token_cell("r", r, k) for r in config.routes for k in ("prompt", "cached")]
    for route in config.routes.values():
        names += [QUEUED.cell(route.name), QUEUED_SINCE.cell(route.name)]
        names += [ROUTE_HOST_INFLIGHT.cell(route.name, h) for h in route.hosts]
        names += [AFFINITY.cell(route.name, o) for o in AFFINITY_OUTCOMES]
        names += [KEY_INFLIGHT.cell(route.name, key) for key in route.keys]
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

    def publish(self, name: str, value: int) -> None:
        """This process's count ``name`` (a name :func:`_names` derives from the config;
        others are ignored) is ``value``."""
        cell = self._cells.get(name)
        if cell is not None:
            self.shared.set(cell, value)

    def total(self, name: str) -> int:
        """Count ``name`` summed over every process (0 for a name not counted); for a
        counter the supervisor's row holds the shares of workers that died."""
        cell = self._cells.get(name)
        return self.shared.total(cell) if cell is not None else 0

    def smallest(self, name: str) -> int | None:
        """The smallest non-zero value of ``name`` over every process, or None."""
        cell = self._cells.get(name)
        return self.shared.smallest(cell) if cell is not None else None

    def of_row(self, name: str, row: int) -> int:
        """What the process of ``row`` published in cell ``name`` (0 for a name not counted)."""
        cell = self._cells.get(name)
        return self.shared.get(cell, row) if cell is not None else 0

    def counter_cells(self) -> list[str]:
        """The names of the cells that are counters (:func:`~crossbar.state.cells.is_counter`):
        when a worker dies the supervisor keeps its share of each (:meth:`of_row`,
        :meth:`publish`), so no counter goes down with it."""
        return [name for name in self._cells if is_counter(name)]
