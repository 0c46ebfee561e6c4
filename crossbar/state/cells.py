"""The counts crossbar shares, each of a :class:`Kind` that says where it lives and
builds its names: a worker's row of the box's shared memory
(:mod:`crossbar.state.worker_counts`) and an instance's fields in Redis
(:mod:`crossbar.state.cluster`) use the same names, built here and nowhere else;
:class:`~crossbar.state.counts.Counts` reads a kind's flags to decide whether a count is
this process's, the workers' or every instance's (docs/design.md §Workers, §"Several
crossbars").

Each name is a kind's short tag and its parts, joined by NUL (never in a config name's
text).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "AFFINITY", "CLUSTER_LOST", "CLUSTER_SLOW", "HOST_INFLIGHT", "KEY_INFLIGHT", "KINDS", "Kind", "QUEUED",
    "QUEUED_SINCE", "RESTARTS", "ROUTE_HOST_INFLIGHT", "TOKENS", "is_counter", "placement_cell",
    "placement_slot_cell", "token_cell",
]


class Kind(NamedTuple):
    """A kind of shared count.

    :ivar tag: its names' first part.
    :ivar instances: with ``cluster.redis`` it is shared with the other instances
        through Redis (room, least-busy and key limits need every instance's); else
        it is summed over this box's workers only.
    :ivar counter: it only grows over a process's life (a dead worker's share is kept by
        the supervisor, so the sum never goes down); else a count of the moment.
    """

    tag: str
    instances: bool = False
    counter: bool = False

    def cell(self, *parts: str) -> str:
        """The name of this kind's count for ``parts`` (e.g. a host, a route and a key)."""
        return "\0".join((self.tag, *parts)) if parts else self.tag


HOST_INFLIGHT = Kind("h", instances=True)
"""Requests in flight to a host (parts: host)."""
ROUTE_HOST_INFLIGHT = Kind("rh")
"""Requests of a route in flight to a host (parts: route, host; the metrics' series)."""
KEY_INFLIGHT = Kind("k", instances=True)
"""Requests of a client key in flight or waiting (parts: route, key)."""
QUEUED = Kind("q")
"""Requests waiting in a route's queue (parts: route)."""
QUEUED_SINCE = Kind("qt")
"""When the oldest request waiting in a route's queue joined it, POSIX ms (parts: route;
read as the smallest over the workers)."""
AFFINITY = Kind("a", counter=True)
"""Requests of a route dispatched with an affinity outcome (parts: route, outcome)."""
TOKENS = Kind("t", counter=True)
"""A token total (parts: ``h`` and a host, kinds prompt, cached, generated; or ``r`` and
a route, kinds prompt, cached). With ``cluster.redis`` the fleet's come from Redis
buckets (:mod:`crossbar.state.token_share`), not from instances' counts."""
RESTARTS = Kind("restarts")
"""Worker restarts, in the supervisor's row only (it grows, but no worker holds a share
of it for the supervisor to keep)."""
CLUSTER_LOST = Kind("cluster_lost", counter=True)
"""The times a worker's link to Redis was lost (``cluster.redis``; each worker is an
instance of its own): ``crossbar_cluster_lost_total`` is the sum."""
CLUSTER_SLOW = Kind("cluster_slow", counter=True)
"""A worker's single checks Redis did not answer within the bound:
``crossbar_cluster_slow_total`` is the sum."""

KINDS = {kind.tag: kind for kind in (
    HOST_INFLIGHT, ROUTE_HOST_INFLIGHT, KEY_INFLIGHT, QUEUED, QUEUED_SINCE, AFFINITY, TOKENS, RESTARTS,
    CLUSTER_LOST, CLUSTER_SLOW)}
"""Every kind of count, by tag."""


def token_cell(scope: str, name: str, kind: str) -> str:
    """A token total: ``scope`` "h" (a host; kinds prompt, cached, generated) or "r" (a
    route; prompt, cached)."""
    return TOKENS.cell(scope, name, kind)


def is_counter(name: str) -> bool:
    """Whether cell ``name`` is a counter (:attr:`Kind.counter`) rather than a count of
    the moment."""
    kind = KINDS.get(name.partition("\0")[0])
    return kind is not None and kind.counter


def placement_cell(kind: str, host: str, model: str) -> str:
    """A placement fact of ``model`` on ``host`` in Redis (docs/design.md §Where models
    live, rule 7): ``kind`` ``pm`` (requests in flight), ``pl`` (loading), ``pd``
    (unloading, rule 4), ``pu`` (last use).
    Not a count of a :class:`Kind`: :mod:`crossbar.state.placement_share` reads these
    facts (marks, latest uses) its own way."""
    return f"{kind}\0{host}\0{model}"


def placement_slot_cell(kind: str, host: str, slot: int) -> str:
    """The same in the workers' shared memory, for the models hashed to ``slot`` (model
    ids are not in the config, which alone names the workers' cells)."""
    return f"{kind}\0{host}\0{slot}"
