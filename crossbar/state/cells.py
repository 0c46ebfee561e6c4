"""The names of the counts crossbar shares: a worker's row of the box's shared memory
(:mod:`crossbar.state.worker_counts`) and an instance's fields in Redis
(:mod:`crossbar.state.cluster`) use the same names, built here and nowhere else
(docs/design.md §Workers, §"Several crossbars").

Each name is a short tag and its parts, joined by NUL (never in a config name's text).
"""

from __future__ import annotations

__all__ = [
    "CLUSTER_LOST", "CLUSTER_SLOW", "RESTARTS", "affinity_cell", "host_cell", "is_counter", "key_cell",
    "placement_cell", "placement_slot_cell", "queue_cell", "queue_oldest_cell", "route_host_cell", "token_cell",
]

RESTARTS = "restarts"
"""The cell, in the supervisor's row, counting worker restarts."""
CLUSTER_LOST = "cluster_lost"
"""The cell of the times a worker's link to Redis was lost (``cluster.redis``; each
worker is an instance of its own): ``crossbar_cluster_lost_total`` is the sum."""
CLUSTER_SLOW = "cluster_slow"
"""The cell of a worker's single checks Redis did not answer within the bound:
``crossbar_cluster_slow_total`` is the sum."""


def host_cell(host: str) -> str:
    """Requests in flight to ``host``."""
    return f"h\0{host}"


def route_host_cell(route: str, host: str) -> str:
    """Requests of ``route`` in flight to ``host``."""
    return f"rh\0{route}\0{host}"


def key_cell(route: str, key: str) -> str:
    """Requests of client key ``key`` of ``route`` in flight or waiting."""
    return f"k\0{route}\0{key}"


def queue_cell(route: str) -> str:
    """Requests waiting in ``route``'s queue."""
    return f"q\0{route}"


def queue_oldest_cell(route: str) -> str:
    """When the oldest request waiting in ``route``'s queue joined it (ms)."""
    return f"qt\0{route}"


def affinity_cell(route: str, outcome: str) -> str:
    """Requests of ``route`` dispatched with affinity ``outcome`` (a counter)."""
    return f"a\0{route}\0{outcome}"


def token_cell(scope: str, name: str, kind: str) -> str:
    """A token total (a counter): ``scope`` "h" (a host; kinds prompt, cached,
    generated) or "r" (a route; prompt, cached)."""
    return f"t{scope}\0{name}\0{kind}"


def is_counter(name: str) -> bool:
    """Whether cell ``name`` is a counter (it only grows over a process's life: affinity
    outcomes, token totals, Redis losses and slow checks) rather than a count of the moment."""
    return name in (CLUSTER_LOST, CLUSTER_SLOW) or name.startswith(("a\0", "th\0", "tr\0"))


def placement_cell(kind: str, host: str, model: str) -> str:
    """A placement fact of ``model`` on ``host`` in Redis (docs/design.md §Where models
    live, rule 7): ``kind`` ``pm`` (requests in flight), ``pl`` (loading), ``pu`` (last use)."""
    return f"{kind}\0{host}\0{model}"


def placement_slot_cell(kind: str, host: str, slot: int) -> str:
    """The same in the workers' shared memory, for the models hashed to ``slot`` (model
    ids are not in the config, which alone names the workers' cells)."""
    return f"{kind}\0{host}\0{slot}"

