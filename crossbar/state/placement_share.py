"""What placement shares with the other workers and instances (docs/design.md §Where models
live, rule 7: rule 1's "loading", rule 4's "unloading" and the last uses are shared like
the in-flight counts; §Workers, §Several crossbars).

Four facts per (host, model id): this process's requests in flight for the model there
(summed over processes: a model in use anywhere is in use), whether this process made
the host load it and no poll settled it yet (rule 1: any process's load counts), whether
this process told the host to unload it and no poll showed it gone yet (rule 4: any
process's unload counts), and the clock second of its last request there (the latest
over processes). A :class:`PlacementShare` publishes this process's and reads the
others'. A process that dies takes its facts with it: the supervisor clears a dead
worker's row, Redis expires an instance's counts (:data:`~crossbar.state.cluster.TTL`).

- :class:`WorkerShare` (``workers: N``): cells of the workers' shared counts
  (:class:`~crossbar.state.shared.SharedCounts`, one row per process). Cell names come
  from the config alone (``pm``/``pl``/``pd``/``pu`` + host + slot, :func:`share_names`),
  a model id is hashed to one of :data:`SLOTS` slots per host: in-flight counts of two
  models on one slot add up (such a model looks in use: never evicted wrongly); a mark
  and a last use carry the model's 31-bit fingerprint in their high half, so only the
  model's own count (one per slot and process: the latest wins; a mark that ends shows
  this process's other mark of the slot, if any).
- :class:`ClusterShare` (``cluster.redis``): counts of the cluster's view
  (:class:`~crossbar.state.cluster.RedisCluster`) named ``pm\\0host\\0model`` (in
  flight, summed), ``pl\\0host\\0model`` (1 while loading), ``pd\\0host\\0model`` (1
  while unloading) and ``pu\\0host\\0model`` (last use, POSIX seconds: the latest of
  the others, :meth:`RedisCluster.largest`).
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Protocol

from twisted.internet.defer import Deferred, succeed

from crossbar.state.cells import placement_cell, placement_slot_cell

if TYPE_CHECKING:
    from crossbar.state.cluster import ClusterView
    from crossbar.state.shared import SharedCounts

__all__ = ["KINDS", "SLOTS", "Cells", "ClusterShare", "PlacementShare", "WorkerShare", "fingerprint", "share_names"]

SLOTS = 16
"""Cells per host and fact for the workers' share (model ids hash to them)."""

KINDS = ("pm", "pl", "pd", "pu")
"""The facts' tags: in flight, loading (rule 1), unloading (rule 4), last use."""

_LOW = 0xFFFFFFFF


def fingerprint(model: str) -> int:
    """A model id's 31-bit fingerprint (CRC-32 of its UTF-8, the sign bit of a cell clear)."""
    return zlib.crc32(model.encode("utf-8", "surrogatepass")) & 0x7FFFFFFF


def _slot(model: str) -> int:
    return fingerprint(model) % SLOTS


def share_names(hosts: list[str]) -> list[str]:
    """The workers' cell names for ``hosts`` (the router-mode hosts of ``placement`` routes)."""
    return [placement_slot_cell(kind, h, i) for h in hosts for kind in KINDS for i in range(SLOTS)]


class Cells(Protocol):
    """What :class:`WorkerShare` needs of the workers' counts
    (:class:`~crossbar.state.worker_counts.WorkerCounts`)."""

    shared: SharedCounts

    def cell(self, name: str) -> int | None:
        """The shared cell of ``name``, or None."""


class PlacementShare(Protocol):
    """This process's placement facts out, the other processes' in."""

    def publish_inflight(self, host: str, model: str, count: int) -> None:
        """This process has ``count`` requests for ``model`` in flight to ``host``."""

    def publish_loading(self, host: str, model: str, loading: bool) -> None:
        """This process made ``host`` load ``model`` (``loading``), or that load settled."""

    def publish_unloading(self, host: str, model: str, unloading: bool) -> None:
        """This process told ``host`` to unload ``model`` (``unloading``, rule 4), or that
        unload ended (failed, shown gone by a poll, or past ``timeouts.first_byte``)."""

    def publish_use(self, host: str, model: str, seconds: float) -> None:
        """This process sent a request for ``model`` to ``host`` at POSIX ``seconds``."""

    def claim_unloading(self, host: str, model: str) -> Deferred[bool]:
        """Publish this process's unload of ``model`` on ``host`` if no other process has
        one under way, as one step (rule 4: one unload of a model at a time): fires
        True (claimed, published) or False (another process is unloading it). Never
        fails."""

    def inflight(self, host: str, model: str) -> int:
        """Requests for ``model`` in flight to ``host`` from the other processes."""

    def loading(self, host: str, model: str) -> bool:
        """Another process made ``host`` load ``model`` and no poll of its settled it."""

    def unloading(self, host: str, model: str) -> bool:
        """Another process told ``host`` to unload ``model`` and no poll of its showed it
        gone yet (rule 4)."""

    def last_use(self, host: str, model: str) -> float | None:
        """The latest request of the other processes for ``model`` on ``host``, or None."""


class WorkerShare:
    """:class:`PlacementShare` over the workers' shared counts (see the module doc).

    :param fleet: this worker's :class:`~crossbar.state.worker_counts.WorkerCounts`.
    """

    def __init__(self, fleet: Cells) -> None:
        self.fleet = fleet
        self._inflight: dict[tuple[str, int], dict[str, int]] = {}
        self._marks: dict[tuple[str, str, int], list[str]] = {}

    def _cell(self, kind: str, host: str, model: str) -> int | None:
        return self.fleet.cell(placement_slot_cell(kind, host, _slot(model)))

    def publish_inflight(self, host: str, model: str, count: int) -> None:
        """See :class:`PlacementShare`: the slot holds this worker's sum over its models."""
        cell = self._cell("pm", host, model)
        if cell is None:
            return
        per_model = self._inflight.setdefault((host, cell), {})
        if count:
            per_model[model] = count
        else:
            per_model.pop(model, None)
        self.fleet.shared.set(cell, sum(per_model.values()))

    def publish_loading(self, host: str, model: str, loading: bool) -> None:
        """See :class:`PlacementShare`."""
        self._mark("pl", host, model, loading)

    def publish_unloading(self, host: str, model: str, unloading: bool) -> None:
        """See :class:`PlacementShare`."""
        self._mark("pd", host, model, unloading)

    def claim_unloading(self, host: str, model: str) -> Deferred[bool]:
        """See :class:`PlacementShare`: the workers' cells are one box's memory, read
        and written in the same turn of this worker's reactor (two workers deciding in
        the same microsecond may both claim)."""
        if self.unloading(host, model):
            return succeed(False)
        self.publish_unloading(host, model, True)
        return succeed(True)

    def _mark(self, kind: str, host: str, model: str, on: bool) -> None:
        """Set or end this worker's mark ``kind`` of ``model`` on ``host``: the slot shows
        its latest model still marked (two of one slot: the other's mark comes back when
        one ends), else 0."""
        marked = self._marks.setdefault((kind, host, _slot(model)), [])
        if model in marked:
            marked.remove(model)
        if on:
            marked.append(model)
        cell = self._cell(kind, host, model)
        if cell is not None:
            self.fleet.shared.set(cell, (fingerprint(marked[-1]) << 32) | 1 if marked else 0)

    def _marked(self, kind: str, host: str, model: str) -> bool:
        """Whether another worker's mark ``kind`` of ``model`` on ``host`` is set."""
        fp = fingerprint(model)
        cell = self.fleet.cell(placement_slot_cell(kind, host, fp % SLOTS))
        mark = (fp << 32) | 1
        return cell is not None and any(v == mark for v in self._others(cell))

    def publish_use(self, host: str, model: str, seconds: float) -> None:
        """See :class:`PlacementShare`."""
        cell = self._cell("pu", host, model)
        if cell is not None:
            self.fleet.shared.set(cell, (fingerprint(model) << 32) | (int(seconds) & _LOW))

    def _others(self, cell: int) -> list[int]:
        shared = self.fleet.shared
        return [shared.get(cell, row) for row in range(shared.rows) if row != shared.row]

    def inflight(self, host: str, model: str) -> int:
        """See :class:`PlacementShare` (models of one slot add up)."""
        cell = self._cell("pm", host, model)
        return 0 if cell is None else sum(v for v in self._others(cell) if v > 0)

    def loading(self, host: str, model: str) -> bool:
        """See :class:`PlacementShare`."""
        return self._marked("pl", host, model)

    def unloading(self, host: str, model: str) -> bool:
        """See :class:`PlacementShare`."""
        return self._marked("pd", host, model)

    def last_use(self, host: str, model: str) -> float | None:
        """See :class:`PlacementShare` (whole seconds)."""
        cell = self._cell("pu", host, model)
        if cell is None:
            return None
        fp = fingerprint(model)
        seen = [v & _LOW for v in self._others(cell) if v > 0 and v >> 32 == fp]
        return float(max(seen)) if seen else None


class ClusterShare:
    """:class:`PlacementShare` through ``cluster.redis`` (see the module doc).

    :param cluster: this instance's view of the cluster (a
        :class:`~crossbar.state.cluster.RedisCluster`; one without ``largest`` shares no
        last uses).
    """

    def __init__(self, cluster: ClusterView) -> None:
        self.cluster = cluster

    def publish_inflight(self, host: str, model: str, count: int) -> None:
        """See :class:`PlacementShare`."""
        self.cluster.set(placement_cell("pm", host, model), count)

    def publish_loading(self, host: str, model: str, loading: bool) -> None:
        """See :class:`PlacementShare`."""
        self.cluster.set(placement_cell("pl", host, model), 1 if loading else 0)

    def publish_unloading(self, host: str, model: str, unloading: bool) -> None:
        """See :class:`PlacementShare`."""
        self.cluster.set(placement_cell("pd", host, model), 1 if unloading else 0)

    def claim_unloading(self, host: str, model: str) -> Deferred[bool]:
        """See :class:`PlacementShare`: one atomic take of the ``pd`` count with a limit
        of 1 over every live instance (:meth:`~crossbar.state.cluster.RedisCluster.take`;
        Redis not answering within its bound: this instance's view decides)."""
        return self.cluster.take(placement_cell("pd", host, model), 1, 1)

    def publish_use(self, host: str, model: str, seconds: float) -> None:
        """See :class:`PlacementShare`."""
        self.cluster.set(placement_cell("pu", host, model), int(seconds))

    def inflight(self, host: str, model: str) -> int:
        """See :class:`PlacementShare`."""
        return self.cluster.others(placement_cell("pm", host, model))

    def loading(self, host: str, model: str) -> bool:
        """See :class:`PlacementShare`."""
        return self.cluster.others(placement_cell("pl", host, model)) > 0

    def unloading(self, host: str, model: str) -> bool:
        """See :class:`PlacementShare`."""
        return self.cluster.others(placement_cell("pd", host, model)) > 0

    def last_use(self, host: str, model: str) -> float | None:
        """See :class:`PlacementShare`."""
        largest = getattr(self.cluster, "largest", None)
        latest = largest(placement_cell("pu", host, model)) if largest is not None else 0
        return float(latest) if latest > 0 else None
