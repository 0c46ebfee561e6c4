"""The counts workers share (docs/design.md §Workers): :class:`SharedCounts` rows in one
mapped file, :func:`cell_map` naming cells the same in every process, and
:class:`WorkerCounts` publishing one worker's counts and reading the fleet's."""

from __future__ import annotations

import os
import random

from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import parse_config
from crossbar.state.cells import (
    AFFINITY, HOST_INFLIGHT, KEY_INFLIGHT, QUEUED, QUEUED_SINCE, RESTARTS, ROUTE_HOST_INFLIGHT,
)
from crossbar.state.counts import Counts
from crossbar.state.worker_counts import WorkerCounts
from crossbar.state.inflight import Inflight
from crossbar.state.shared import CELLS, SharedCounts, cell_map

_CONFIG = """
listen: "tcp:0"
workers: 2
hosts:
  a: http://127.0.0.1:1
  b: http://127.0.0.1:2
routes:
  r:
    hosts: [a, b]
  s:
    hosts: [b]
    keys:
      ci: {secret: ci-s3cret-0123456789, max_inflight: 2}
"""


class CellMapTests(SynchronousTestCase):
    def test_same_names_same_cells_in_any_order(self) -> None:
        names = [f"h\0host-{i}" for i in range(300)] + [f"q\0route-{i}" for i in range(100)]
        first = cell_map(names)
        shuffled = list(names) * 2  # duplicates too
        random.Random(7).shuffle(shuffled)
        self.assertEqual(cell_map(shuffled), first)
        self.assertEqual(sorted(first), sorted(set(names)))

    def test_distinct_cells_in_range(self) -> None:
        names = [f"n{i}" for i in range(CELLS)]  # every cell taken: collisions must probe
        cells = cell_map(names)
        self.assertEqual(len(set(cells.values())), CELLS)
        self.assertTrue(all(0 <= c < CELLS for c in cells.values()))

    def test_too_many_names(self) -> None:
        with self.assertRaises(ValueError):
            cell_map(f"n{i}" for i in range(CELLS + 1))


class SharedCountsTests(SynchronousTestCase):
    def _rows(self, rows: int) -> list[SharedCounts]:
        path = os.path.join(self.mktemp() + "-counts")
        SharedCounts.create(path, rows)
        return [SharedCounts(path, rows, r) for r in range(rows)]

    def test_each_row_writes_its_own_and_totals_sum_rows(self) -> None:
        a, b, c = self._rows(3)
        a.set(5, 2)
        b.set(5, 3)
        c.set(6, 7)
        for view in (a, b, c):  # every process sees every row
            self.assertEqual(view.total(5), 5)
            self.assertEqual(view.total(6), 7)
            self.assertEqual(view.total(7), 0)
        self.assertEqual(a.get(5), 2)
        self.assertEqual(a.get(5, row=1), 3)
        b.set(5, 0)
        self.assertEqual(c.total(5), 2)

    def test_clear_row(self) -> None:
        a, b = self._rows(2)
        a.set(1, 4)
        a.set(CELLS - 1, 9)
        b.set(1, 6)
        a.clear_row(1)  # the supervisor clears a dead worker's row
        self.assertEqual(a.total(1), 4)
        a.clear_row()
        self.assertEqual(b.total(1), 0)
        self.assertEqual(b.total(CELLS - 1), 0)

    def test_smallest_ignores_zero(self) -> None:
        a, b, c = self._rows(3)
        self.assertIsNone(a.smallest(3))
        b.set(3, 1500)
        c.set(3, 900)
        self.assertEqual(a.smallest(3), 900)
        c.set(3, 0)
        self.assertEqual(a.smallest(3), 1500)

    def test_create_clears(self) -> None:
        path = os.path.join(self.mktemp() + "-counts")
        SharedCounts.create(path, 2)
        SharedCounts(path, 2, 1).set(0, 11)
        SharedCounts.create(path, 2)
        self.assertEqual(SharedCounts(path, 2, 0).total(0), 0)

    def test_row_out_of_range(self) -> None:
        path = os.path.join(self.mktemp() + "-counts")
        SharedCounts.create(path, 2)
        with self.assertRaises(ValueError):
            SharedCounts(path, 2, 2)


class FleetTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.config = parse_config(_CONFIG, "test.yaml")
        path = os.path.join(self.mktemp() + "-counts")
        SharedCounts.create(path, 3)
        self.one = WorkerCounts(SharedCounts(path, 3, 0), self.config)
        self.two = WorkerCounts(SharedCounts(path, 3, 1), self.config)
        self.supervisor = WorkerCounts(SharedCounts(path, 3, 2), self.config)

    def test_inflight_summed_over_workers(self) -> None:
        one, two, supervisor = (_counts(f) for f in (self.one, self.two, self.supervisor))
        for counts, route, pair, total in ((one, "r", 1, 2), (one, "s", 1, 2), (two, "r", 3, 3)):
            counts.publish(ROUTE_HOST_INFLIGHT, ROUTE_HOST_INFLIGHT.cell(route, "b"), pair)
            counts.publish(HOST_INFLIGHT, HOST_INFLIGHT.cell("b"), total)
        self.assertEqual(supervisor.read(HOST_INFLIGHT, HOST_INFLIGHT.cell("b"), 0), 5)
        self.assertEqual(one.read(ROUTE_HOST_INFLIGHT, ROUTE_HOST_INFLIGHT.cell("r", "b"), 0), 4)
        self.assertEqual(two.read(ROUTE_HOST_INFLIGHT, ROUTE_HOST_INFLIGHT.cell("s", "b"), 0), 1)
        self.assertEqual(one.read(HOST_INFLIGHT, HOST_INFLIGHT.cell("a"), 0), 0)
        self.assertEqual(one.read(HOST_INFLIGHT, HOST_INFLIGHT.cell("unknown"), 7), 0)  # no cell: none shared

    def test_inflight_series_of_a_worker_that_served_none(self) -> None:
        """The kernel may hand every connection to one worker: the other's metrics
        still report the fleet's in-flight requests, for every pair of the config."""
        busy, idle = Inflight(counts=_counts(self.one)), Inflight(counts=_counts(self.two))
        busy.enter("r", "a")
        busy.enter("r", "a")
        self.assertEqual(idle.by_route_host(), {("r", "a"): 2, ("r", "b"): 0, ("s", "b"): 0})
        self.assertEqual(idle.host("a"), 2)

    def test_queue_and_oldest(self) -> None:
        one, two = _counts(self.one), _counts(self.two)
        for counts, queued, since in ((one, 2, 5000), (two, 1, 4000)):
            counts.publish(QUEUED, QUEUED.cell("r"), queued)
            counts.publish(QUEUED_SINCE, QUEUED_SINCE.cell("r"), since)
        self.assertEqual(one.read(QUEUED, QUEUED.cell("r"), 0), 3)
        self.assertEqual(one.smallest(QUEUED_SINCE, QUEUED_SINCE.cell("r"), None), 4000)
        two.publish(QUEUED_SINCE, QUEUED_SINCE.cell("r"), 0)
        self.assertEqual(two.smallest(QUEUED_SINCE, QUEUED_SINCE.cell("r"), None), 5000)
        self.assertIsNone(two.smallest(QUEUED_SINCE, QUEUED_SINCE.cell("s"), None))

    def test_affinity_and_restarts(self) -> None:
        one, two, supervisor = (_counts(f) for f in (self.one, self.two, self.supervisor))
        one.publish(AFFINITY, AFFINITY.cell("r", "home"), 4)
        two.publish(AFFINITY, AFFINITY.cell("r", "home"), 1)
        two.publish(AFFINITY, AFFINITY.cell("r", "spill"), 2)
        self.assertEqual(supervisor.read(AFFINITY, AFFINITY.cell("r", "home"), 0), 5)
        self.assertEqual(supervisor.read(AFFINITY, AFFINITY.cell("r", "spill"), 0), 2)
        self.supervisor.publish(RESTARTS.cell(), 3)
        self.assertEqual(one.read(RESTARTS, RESTARTS.cell(), 0), 3)

    def test_client_keys_summed_over_workers(self) -> None:
        one, two, supervisor = (_counts(f) for f in (self.one, self.two, self.supervisor))
        one.publish(KEY_INFLIGHT, KEY_INFLIGHT.cell("s", "ci"), 1)
        two.publish(KEY_INFLIGHT, KEY_INFLIGHT.cell("s", "ci"), 2)
        self.assertEqual(supervisor.read(KEY_INFLIGHT, KEY_INFLIGHT.cell("s", "ci"), 0), 3)
        self.assertEqual(one.read(KEY_INFLIGHT, KEY_INFLIGHT.cell("r", "ci"), 0), 0)  # not a key of route r: no cell

    def test_dead_worker_row_cleared(self) -> None:
        self.one.publish(HOST_INFLIGHT.cell("a"), 2)
        self.two.publish(HOST_INFLIGHT.cell("a"), 1)
        self.supervisor.shared.clear_row(0)
        self.assertEqual(self.two.total(HOST_INFLIGHT.cell("a")), 1)

    def test_reload_same_names_same_cells(self) -> None:
        """Two workers that loaded the same file in either order address the same
        cells; a reload clears only this worker's row (it publishes again)."""
        a = HOST_INFLIGHT.cell("a")
        self.one.publish(a, 1)
        self.two.publish(a, 1)
        reordered = parse_config(_CONFIG.replace("  a: http://127.0.0.1:1\n  b: http://127.0.0.1:2\n",
                                                 "  b: http://127.0.0.1:2\n  a: http://127.0.0.1:1\n"), "test.yaml")
        self.two.configure(reordered)
        self.assertEqual(self.one.total(a), 1)
        self.two.publish(a, 1)
        self.assertEqual(self.one.total(a), 2)


def _counts(fleet: WorkerCounts) -> Counts:
    """A worker's way to the shared counts (:class:`~crossbar.state.counts.Counts`)."""
    counts = Counts()
    counts.fleet = fleet
    return counts
