"""Choosing a host for a request (docs/design.md §Choosing a host, rules 1-3 and 5; §Cache
affinity).

:func:`choose` is pure: it reads the route's config, the hosts' health records and the
in-flight counts it is given, and answers with a :class:`Chosen` host (and why), or
:data:`Verdict.BUSY` (the best tier has no room: wait, rule 4) or
:data:`Verdict.NO_HOST` (no healthy host left to try). The only state is the
round-robin position that breaks exact ties (:class:`Rotation`).
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, Collection, Iterable, Mapping, NamedTuple

from crossbar.hosts import affinity
from crossbar.config import Host, Route
from crossbar.hosts.health import HostStatus
from crossbar.hosts.placement import Placing, load_tier

__all__ = ["Chosen", "Fit", "Rotation", "Verdict", "awaits_first_poll", "choose", "fit_tier", "has_room", "limit_in_force", "lists"]


class Fit(Enum):
    """How well the hosts of a tier fit the wanted model (rule 1), best first."""

    LOADED = "loaded"
    LOADING = "loading"
    AVAILABLE = "available"
    FALLBACK = "fallback"


class Verdict(Enum):
    """No host was chosen."""

    BUSY = "busy"
    """The best tier has no host with room, or no healthy host lists the model (or
    none is healthy) but a host of the route has not been polled yet (new, or reset by
    a reload): wait in the route's queue (rule 4)."""
    NO_HOST = "no_host"
    """No healthy host of the route is left to try, and every untried one has had its
    first poll."""
    NO_MODEL = "no_model"
    """Every healthy host of the route is in router mode and none lists the model, and
    every host has had its first poll: 404 ``model not found`` (docs/design.md
    §Choosing a host rule 1)."""


class Chosen(NamedTuple):
    """The host a request goes to, and why (rule 5); one per request, so a named tuple
    (cheaper to make than a frozen dataclass).

    :ivar host: the host's name.
    :ivar fit: the tier it was chosen from.
    :ivar pick: ``primary`` or ``least-busy``; "" when the affinity ranking chose.
    :ivar affinity: ``home``, ``spill`` or ``none`` (§Cache affinity).
    :ivar load: on a route with ``placement``: ``load`` when the request makes the host
        load its model, ``spread`` when it does so after waiting ``spread_after``
        (§Where models live, rules 3 and 7); else "".
    :ivar model: the id the chosen router-mode host lists the request's model under
        (its requests in flight per model, §Where models live), else None.
    """

    host: str
    fit: Fit
    pick: str
    affinity: str = "none"
    load: str = ""
    model: str | None = None

    @property
    def why(self) -> str:
        """The reason for the log line, e.g. ``loaded least-busy affinity=none``,
        ``loaded affinity=home`` or ``available load least-busy affinity=none``."""
        return " ".join(p for p in (self.fit.value, self.load, self.pick, f"affinity={self.affinity}") if p)


class Rotation:
    """Round-robin among exact ties, per route: the host after the one last chosen,
    in route order, so idle equal hosts take turns (rule 3)."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def next(self, route: Route, tied: list[str]) -> str:
        """One of ``tied`` (non-empty, in route order) for ``route``."""
        last = self._last.get(route.name)
        order = route.hosts
        after = order.index(last) if last in order else -1
        host = next((h for h in tied if order.index(h) > after), tied[0])
        self._last[route.name] = host
        return host


def limit_in_force(host: Host, status: HostStatus | None) -> tuple[int | None, str | None]:
    """Rule 2: the ``max_inflight`` in force for ``host`` and where it came from:
    ``(n, "config")``, ``(slots, "slots")`` once the host reported its slots (``None``
    until then: no limit), or ``(None, None)`` for no limit configured."""
    if host.max_inflight_slots:
        return (status.slots if status is not None and not status.router else None), "slots"
    if host.max_inflight is None:
        return None, None
    return host.max_inflight, "config"


def has_room(host: Host, inflight: int, status: HostStatus | None = None) -> bool:
    """Rule 2: a host has room while its in-flight count is below the ``max_inflight``
    in force (:func:`limit_in_force`; ``status`` carries the slots it reported)."""
    if host.max_inflight_slots:
        limit = limit_in_force(host, status)[0]
        return limit is None or inflight < limit
    return host.max_inflight is None or inflight < host.max_inflight


def lists(status: HostStatus, model: str, field: str) -> bool:
    """Whether ``status`` has ``model`` in its ``field`` (``loaded``, ``loading`` or
    ``available``), by id or by an alias the host reported for an id there (rule 1)."""
    ids = getattr(status, field)
    return model in ids or status.aliases.get(model, "") in ids


def loadable(names: Iterable[str], model: str, statuses: Mapping[str, HostStatus]) -> list[str]:
    """Of ``names``, the hosts that list ``model`` available (router mode will load it)
    and are not unloading it (§Where models live rule 4: a request sent into the host's
    unload of the model would be cut, so none goes there until the unload is over)."""
    return [h for h in names if lists(statuses[h], model, "available") and not lists(statuses[h], model, "unloading")]


def fit_tier(
    candidates: Iterable[str], model: str | None, statuses: Mapping[str, HostStatus]
) -> tuple[Fit, list[str]]:
    """Rule 1: the best non-empty tier of ``candidates`` (healthy, untried, in route
    order) for ``model``: those that list it loaded, else loading, else available, else
    every candidate that is not in router mode (the fallback: a single-model host may
    serve the model under another name; a router-mode host would answer 400). With no
    model every candidate is the fallback. Load never enters into it. The tier may be
    empty: every candidate is in router mode and none lists the model."""
    names = list(candidates)
    if model is None:
        return Fit.FALLBACK, names
    for fit, field in ((Fit.LOADED, "loaded"), (Fit.LOADING, "loading"), (Fit.AVAILABLE, "available")):
        tier = [h for h in names if lists(statuses[h], model, field)]
        if tier:
            return fit, tier
    return Fit.FALLBACK, [h for h in names if not statuses[h].router]


def awaits_first_poll(
    route: Route, hosts: Mapping[str, Host], statuses: Mapping[str, HostStatus], exclude: Collection[str] = ()
) -> bool:
    """Whether a host of ``route`` not in ``exclude`` has not had its first poll yet (a
    new or restarted worker or instance, or a host a reload reset): until it has, no
    request of the route is answered ``model not found`` or ``no healthy host``; it
    waits for that poll in the route's queue (docs/design.md §Several crossbars, last
    bullet; §Choosing a host rule 4)."""
    return any(
        h not in exclude and h in hosts and h in statuses and not statuses[h].polled for h in route.hosts
    )


def choose(
    route: Route,
    hosts: Mapping[str, Host],
    statuses: Mapping[str, HostStatus],
    inflight: Callable[[str], int],
    model: str | None,
    key: str | None,
    rotation: Rotation,
    exclude: Iterable[str] = (),
    draining: Collection[str] = (),
    placement: Placing | None = None,
) -> Chosen | Verdict:
    """Choose a host of ``route`` for a request wanting ``model`` with affinity ``key``
    (docs/design.md §Choosing a host, rules 1-3, and §Cache affinity).

    :param hosts: the config's hosts (weights, limits).
    :param statuses: the health table's records.
    :param inflight: host name -> requests in flight to it.
    :param key: the request's affinity key, or None; ignored when the route's
        ``affinity.key`` is ``none``.
    :param exclude: hosts already tried for this request.
    :param draining: hosts being drained (docs/design.md §Operations): they take no new
        request, as if they had no room, and pin no tier; a request whose only healthy
        hosts are draining waits (:data:`Verdict.BUSY`) for another host.
    A host unloading the model (its status's ``unloading``: crossbar's own unload,
    §Where models live rule 4) is left out of the available tier; when that leaves it
    empty the request waits (:data:`Verdict.BUSY`) rather than load the model into the
    unload.
    :param placement: for a route with ``placement`` (§Where models live): the available
        tier keeps only the hosts rule 2 lets load the model (none: wait), and a request
        that waited ``spread_after`` while its loaded tier has no room goes to a copy
        under way with room, or, when none is under way, to such a host (rule 3; one
        load of a model at a time, rule 1).
    """
    skip = set(exclude)
    candidates = [
        h for h in route.hosts
        if h not in skip and h in hosts and h in statuses and statuses[h].healthy
    ]
    if not candidates:
        # A host not polled yet (new, or reset by a reload: URL, tls or api_key changed)
        # may be healthy in a moment: wait for its first poll rather than answer 503.
        return Verdict.BUSY if awaits_first_poll(route, hosts, statuses, skip) else Verdict.NO_HOST
    if draining:
        candidates = [h for h in candidates if h not in draining]
        if not candidates:
            return Verdict.BUSY
    fit, tier = fit_tier(candidates, model, statuses)
    if not tier:
        # The hosts polled so far (router-mode ones) do not list the model; one not
        # polled yet may serve it: a restarted worker waits for it rather than 404.
        if awaits_first_poll(route, hosts, statuses, skip):
            return Verdict.BUSY
        return Verdict.NO_HOST if skip else Verdict.NO_MODEL
    if model is not None and fit is Fit.AVAILABLE:
        tier = loadable(tier, model, statuses)
        if not tier:
            return Verdict.BUSY  # its only hosts are unloading it: wait for the unload to end
    placed = ""
    if placement is not None and model is not None and fit is Fit.AVAILABLE:
        tier = load_tier(tier, hosts, statuses, placement.in_use, placement.last_use, placement.kept,
                          placement.waiting)
        if not tier:
            return Verdict.BUSY  # rule 2: no model in use is evicted; wait for a place
        placed = "load"
    load = {h: inflight(h) for h in tier}
    roomy = [h for h in tier if has_room(hosts[h], load[h], statuses[h])]
    if not roomy and placement is not None and placement.spread and model is not None and fit is Fit.LOADED:
        # Rule 3 under rule 1: a copy already under way takes the spread (when it has
        # room) and, while one is under way, no other host starts another.
        copies = [h for h in candidates if lists(statuses[h], model, "loading")]
        if copies:
            fit, tier = Fit.LOADING, copies
        else:
            tier = load_tier(loadable(candidates, model, statuses), hosts, statuses,
                             placement.in_use, placement.last_use, placement.kept, placement.waiting)
            fit, placed = Fit.AVAILABLE, "spread"
        load = {h: inflight(h) for h in tier}
        roomy = [h for h in tier if has_room(hosts[h], load[h], statuses[h])]
    if not roomy:
        return Verdict.BUSY
    if route.primary is not None and route.primary in roomy:
        return Chosen(route.primary, fit, "primary", load=placed)
    if key is not None and route.affinity.key != "none":
        pick = affinity.pick(
            key,
            [affinity.Candidate(h, hosts[h].weight, load[h], h in roomy) for h in tier],
            route.affinity.balance,
        )
        if pick is not None:
            return Chosen(pick.host, fit, "", pick.outcome, placed)
        # Every host with room is at its bound: the least busy of them takes it.
        return Chosen(_least_busy(route, roomy, hosts, load, rotation), fit, "least-busy", "spill", placed)
    return Chosen(_least_busy(route, roomy, hosts, load, rotation), fit, "least-busy", load=placed)


def _least_busy(
    route: Route, roomy: list[str], hosts: Mapping[str, Host], load: Mapping[str, int], rotation: Rotation
) -> str:
    """Rule 3: the host with the lowest (in-flight + 1) / weight; exact ties rotate."""
    scores = {h: (load[h] + 1) / hosts[h].weight for h in roomy}
    best = min(scores.values())
    return rotation.next(route, [h for h in roomy if scores[h] == best])
