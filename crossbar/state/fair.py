"""The order in which waiting requests are looked at (docs/design.md §Access, "Fair
shares"; §Choosing a host, rule 4).

:func:`fair_order` is pure: given a route's waiting requests in arrival order, each with
its client key's ``priority`` and ``share``, the requests each key has in flight and the
tokens each spent in the last minute, it answers with the order in which they should be
tried. It is the order in which a dispatcher that always serves the key whose turn it
is would send them, had every one a host with room:

1. the highest ``priority`` first;
2. among keys of one priority, the key with the fewest requests in flight divided by
   its ``share`` (a request placed counts as in flight for the next pick, so equal keys
   alternate);
3. ties: fewer tokens spent in the last minute, then the earlier arrival of the key's
   next waiting request;
4. within a key, arrival order.

Requests without a key are one key per route (``""``: priority 0, share 1).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generator, Generic, Mapping, NamedTuple, Sequence, TypeVar

__all__ = ["NO_KEY", "Waiting", "fair_order", "fair_turns"]

T = TypeVar("T")

NO_KEY = ""
"""The key of requests that present none: one key per route, priority 0, share 1."""


class Waiting(NamedTuple, Generic[T]):
    """One waiting request as :func:`fair_order` sees it.

    :ivar item: the request (returned as is).
    :ivar key: its client key's name (:data:`NO_KEY` for none).
    :ivar priority: the key's ``priority`` (an integer; higher goes first).
    :ivar share: the key's ``share`` (a positive number).
    """

    item: T
    key: str = NO_KEY
    priority: int = 0
    share: float = 1.0


def fair_order(waiting: Sequence[Waiting[T]], inflight_by_key: Mapping[str, int],
               spent_by_key: Mapping[str, int]) -> list[T]:
    """The fair order of ``waiting`` (see the module docstring), every request taken as
    placed: :func:`fair_turns` with each one sent back True.

    :param waiting: one route's waiting requests, in arrival order. A key's priority and
        share are taken from its first request.
    :param inflight_by_key: key name -> requests in flight (fleet-wide where the counts
        are shared); absent: 0.
    :param spent_by_key: key name -> tokens spent in the last minute; absent: 0.
    :returns: every ``item`` of ``waiting`` exactly once, in the order to try them.

    Costs O(n log k) for n requests of k keys; one key (or none waiting) returns the
    arrival order at once.
    """
    if not waiting:
        return []
    turns = fair_turns(waiting, inflight_by_key, spent_by_key)
    order = [next(turns)]
    for _ in range(len(waiting) - 1):
        order.append(turns.send(True))
    return order


def fair_turns(waiting: Sequence[Waiting[T]], inflight_by_key: Mapping[str, int],
               spent_by_key: Mapping[str, int]) -> Generator[T, bool, None]:
    """The requests of ``waiting`` one at a time in fair order, as they are tried: the
    first from ``next()``, each next one from ``send(placed)``, ``placed`` saying whether
    the previous one went to a host (it then counts as in flight for its key's next
    turn) or stays waiting (its model's hosts are full: its key's rank is unchanged, and
    a later request of any key may pass it). Parameters as :func:`fair_order`; every
    item is yielded exactly once.
    """
    if not waiting:
        return
    first_key = waiting[0].key
    if all(w.key == first_key for w in waiting):
        for w in waiting:
            yield w.item
        return
    queues: dict[str, deque[tuple[int, T]]] = {}
    settings: dict[str, tuple[int, float]] = {}
    for arrival, w in enumerate(waiting):
        queue = queues.get(w.key)
        if queue is None:
            queue = queues[w.key] = deque()
            settings[w.key] = (w.priority, w.share)
        queue.append((arrival, w.item))
    inflight = {key: inflight_by_key.get(key, 0) for key in queues}
    heap: list[tuple[int, float, int, int, str]] = []
    for key, queue in queues.items():
        priority, share = settings[key]
        heap.append((-priority, inflight[key] / share, spent_by_key.get(key, 0), queue[0][0], key))
    heapq.heapify(heap)
    while heap:
        neg_priority, _, spent, _, key = heapq.heappop(heap)
        queue = queues[key]
        placed = yield queue.popleft()[1]
        if queue:
            if placed:
                inflight[key] += 1
            heapq.heappush(heap, (neg_priority, inflight[key] / settings[key][1], spent, queue[0][0], key))
