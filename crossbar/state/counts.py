"""Where a count lives, decided in one place (docs/design.md §Workers, §"Several
crossbars").

Every count crossbar shares -- requests in flight per host, per (route, host) and per
client key, requests waiting per route and since when, affinity outcomes, token totals,
this process's own counters -- is this process's own number, published and read
through one :class:`Counts`:

- one process (no workers, no ``cluster``): the count is its own;
- with workers: each worker publishes its own into its row of the box's shared memory
  and reads the sum over every row (:class:`~crossbar.state.worker_counts.WorkerCounts`);
- with ``cluster.redis``, a count of a kind shared by instances
  (:attr:`~crossbar.state.cells.Kind.instances`: in flight per host and per key) also
  goes to Redis, and while the instance is joined it reads its own plus every other
  instance's (each worker is an instance there); alone, it reads as without ``cluster``.

The kind (:class:`~crossbar.state.cells.Kind`) builds the count's name; nothing else
decides where it lives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisted.internet.defer import Deferred

from crossbar.state.cells import Kind

if TYPE_CHECKING:
    from crossbar.state.cluster import ClusterView
    from crossbar.state.worker_counts import WorkerCounts

__all__ = ["Counts"]


class Counts:
    """This process's way to its shared counts.

    :ivar fleet: with workers, the box's shared counts; else None.
    :ivar cluster: with ``cluster.redis``, the instances' counts; else None.
    """

    def __init__(self) -> None:
        self.fleet: WorkerCounts | None = None
        self.cluster: ClusterView | None = None

    @property
    def shared(self) -> bool:
        """Whether counts go anywhere but this process (workers, or ``cluster.redis``):
        without, publishing does nothing and a count read is this process's own."""
        return self.fleet is not None or self.cluster is not None

    def publish(self, kind: Kind, name: str, value: int) -> None:
        """This process's count ``name`` (of ``kind``: ``kind.cell(...)``) is ``value``."""
        if self.fleet is not None:
            self.fleet.publish(name, value)
        if kind.instances and self.cluster is not None:
            self.cluster.set(name, value)

    def read(self, kind: Kind, name: str, own: int) -> int:
        """Count ``name`` of ``kind``, this process's being ``own``: every instance's while
        joined to a cluster (for a kind instances share), else every worker's with
        workers, else ``own``."""
        cluster = self.cluster
        if kind.instances and cluster is not None and cluster.joined:
            return own + cluster.others(name)
        if self.fleet is not None:
            return self.fleet.total(name)
        return own

    def smallest(self, kind: Kind, name: str, own: float | None) -> float | None:
        """The smallest non-zero value of count ``name`` over every worker (``own``, this
        process's, without workers), or None: when the oldest of something began."""
        if kind.instances:
            raise ValueError(f"{kind.tag}: the smallest is read over workers only")
        if self.fleet is not None:
            return self.fleet.smallest(name)
        return own or None

    def take(self, kind: Kind, name: str, value: int, limit: int) -> Deferred[bool] | None:
        """Publish ``value`` for ``name``, and with a joined cluster take it there only
        while every instance's together stay under ``limit`` (docs/design.md §Several
        crossbars: room is taken, not guessed): the Deferred fires True when taken,
        False when refused. None when there is nothing to take (no cluster joined)."""
        cluster = self.cluster
        if not (kind.instances and cluster is not None and cluster.joined):
            self.publish(kind, name, value)
            return None
        if self.fleet is not None:
            self.fleet.publish(name, value)
        return cluster.take(name, value, limit)
