"""Cache affinity: which host of a tier a request with an affinity key goes to
(docs/design.md §"Cache affinity").

Weighted rendezvous hashing (highest random weight) ranks a tier's hosts for a key:
each host scores ``-weight / ln(h)`` with ``h`` a uniform (0, 1) hash of the key and the
host's name (blake2b, stable across processes and restarts; never Python's ``hash``),
highest first. A host's share of keys is its weight over the tier's total, and adding or
removing a host moves only the keys ranked first on it.

Bounded load: a host may take the request while it has room and its in-flight count is
below ``ceil(balance * (tier in-flight + 1) * weight / total weight)``; the first such
host in the ranking is chosen (``home`` when it is the first-ranked host, else
``spill``). Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal, NamedTuple, Sequence

__all__ = ["Candidate", "Pick", "bound", "pick", "rank", "score"]

_EPSILON = 1e-9  # float noise in balance * (n + 1) * w / W must not add a slot


def _uniform(key: str, host: str) -> float:
    """A uniform hash of (key, host) in the open interval (0, 1)."""
    digest = hashlib.blake2b(
        key.encode("utf-8", "surrogatepass") + b"\x00" + host.encode("utf-8", "surrogatepass"),
        digest_size=8,
    ).digest()
    top52 = int.from_bytes(digest, "big") >> 12
    return (2 * top52 + 1) / 2.0**53  # odd numerators: never 0, never 1, exact in a float


def score(key: str, host: str, weight: float) -> float:
    """The rendezvous score of ``host`` (with ``weight``, > 0) for ``key``: ``-weight /
    ln(h)``, h = blake2b(key, host) as a uniform (0, 1) number. Higher ranks first; a
    weight <= 0 scores 0 (ranked after every host with a positive weight)."""
    if weight <= 0:
        return 0.0
    return -weight / math.log(_uniform(key, host))


def rank(key: str, hosts: Sequence[tuple[str, float]]) -> list[str]:
    """The names of ``hosts`` (``(name, weight)`` pairs) ranked for ``key``, best first.

    The same key and hosts always give the same ranking, whatever the input order (ties,
    astronomically rare, go by name).
    """
    if len(hosts) == 1:  # one host: no hash to compute (a one-host route, per request)
        return [hosts[0][0]]
    return [name for _, name in sorted(((-score(key, name, weight), name) for name, weight in hosts))]


class Candidate(NamedTuple):
    """One host of the chosen tier: its ``name``, ``weight`` (> 0), ``inflight`` requests
    (an int >= 0, docs/design.md §"Choosing a host" rule 2) and whether it ``has_room``
    (in-flight below its ``max_inflight``). Made per host per keyed request: a named
    tuple, cheaper to make than a frozen dataclass."""

    name: str
    weight: float
    inflight: int
    has_room: bool


class Pick(NamedTuple):
    """The host chosen for a key and how: ``"home"`` (first-ranked) or ``"spill"``."""

    host: str
    outcome: Literal["home", "spill"]


def bound(balance: float, tier_inflight: int, weight: float, total_weight: float) -> int:
    """The in-flight count a host must stay below to take a keyed request:
    ``ceil(balance * (tier_inflight + 1) * weight / total_weight)`` (docs/design.md §"Cache
    affinity"). ``balance`` >= 1; ``total_weight`` > 0. Raises ValueError otherwise."""
    if balance < 1 or total_weight <= 0:
        raise ValueError(f"balance must be >= 1 and total weight > 0 (got {balance}, {total_weight})")
    return math.ceil(balance * (tier_inflight + 1) * weight / total_weight - _EPSILON)


def pick(key: str, candidates: Sequence[Candidate], balance: float) -> Pick | None:
    """The host of the tier (``candidates``) that takes a request with affinity ``key``.

    The first host in ``rank(key, ...)`` that has room and whose in-flight count is below
    its :func:`bound`: ``Pick(host, "home")`` if it is the first-ranked host, else
    ``Pick(host, "spill")``. None when no host may take it (none has room, or every host
    with room is at its bound; the caller then waits, docs/design.md rule 4). ``balance`` >= 1,
    else ValueError; an empty tier or one without positive weight gives None.
    """
    total_weight = sum(c.weight for c in candidates if c.weight > 0)
    if balance < 1:
        raise ValueError(f"balance must be >= 1 (got {balance})")
    if total_weight <= 0:
        return None
    # ceil(balance * (tier in-flight + 1) * weight / total weight), as bound() has it,
    # with the per-tier factor taken once (this runs for every keyed request)
    per_weight = balance * (sum(c.inflight for c in candidates) + 1) / total_weight
    if len(candidates) == 1:  # one host (a one-host route, per request): no hash to compute, as rank()
        ranked: Sequence[Candidate] = candidates
    else:
        ranked = sorted(candidates, key=lambda c: (-score(key, c.name, c.weight), c.name))  # = rank()
    for i, c in enumerate(ranked):
        if c.has_room and c.inflight < math.ceil(per_weight * c.weight - _EPSILON):
            return Pick(c.name, "home" if i == 0 else "spill")
    return None
