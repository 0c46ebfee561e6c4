"""Where models live on router-mode hosts: the decisions (docs/design.md §Where models live).

Pure functions, like :func:`crossbar.hosts.balance.choose`: they read the config, the
health records (with crossbar's own loads already counted as loading, rule 1:
:func:`with_loading`) and the uses they are given, and answer which hosts may load a
model (rule 2), which models fall idle (rule 4) and where a kept model goes (rule 5).
No I/O, no clock: ``now`` is a parameter.

A *use* is a request crossbar sent: ``in_use(host, model)`` counts those in flight,
``last_use(host, model)`` is the clock second the last one was sent (None: never, or
for idleness the first time crossbar saw the model loaded there).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Collection, Iterable, Mapping, NamedTuple

from crossbar.config import Host, Route
from crossbar.hosts.health import HostStatus

__all__ = [
    "InUse", "LastUse", "Placing", "evicted", "has_free_place", "idle_models", "keep_targets", "kept_ids", "least_recent",
    "lists_at_all", "load_tier", "model_id", "unlisted_keeps", "with_loading",
]

InUse = Callable[[str, str], int]
"""(host, model id) -> requests crossbar has in flight to that model there."""
LastUse = Callable[[str, str], "float | None"]
"""(host, model id) -> clock seconds of the last request crossbar sent it there, or None."""


class Placing(NamedTuple):
    """What :func:`~crossbar.hosts.balance.choose` needs for a request of a route with
    ``placement`` (rules 2 and 3).

    :ivar in_use: requests in flight per (host, model id).
    :ivar last_use: the last request sent per (host, model id).
    :ivar spread: the request has waited ``spread_after`` for its loaded or loading
        tier: it may go to a host of the available tier (rule 3).
    :ivar kept: the route's ``keep_loaded`` models: never the eviction a load causes.
    :ivar waiting: model -> requests waiting in crossbar's queues for it: such a model
        is wanted, not idle, and never the eviction a load causes.
    """

    in_use: InUse
    last_use: LastUse
    spread: bool = False
    kept: Collection[str] = ()
    waiting: Callable[[str], int] | None = None


def model_id(status: HostStatus, model: str) -> str:
    """The id ``status`` lists ``model`` under: itself, or the id of the entry that
    reports it as an alias (§Model names); ``model`` when the host lists neither."""
    if model in status.loaded or model in status.loading or model in status.available:
        return model
    return status.aliases.get(model, model)


def with_loading(status: HostStatus, models: Collection[str], evicting: Collection[str] = (),
                 unloading: Collection[str] = ()) -> HostStatus:
    """Rules 1 and 4: ``status`` with each of ``models`` (ids crossbar made the host load)
    that it lists as available counted as loading instead, each of ``evicting`` (the
    models those loads make the host unload) that it lists as loaded counted as
    available, and each of ``unloading`` (ids crossbar told it to unload) that it lists
    as loaded counted as available and kept in its ``unloading`` (no request for them
    goes there until the unload is over) (a copy; ``status`` is frozen)."""
    moved = [m for m in models if m in status.available]
    stopping = [m for m in unloading if m in status.loaded]
    gone = [m for m in evicting if m in status.loaded and m not in stopping] + stopping
    if not moved and not gone:
        return status
    return replace(
        status,
        loaded=tuple(m for m in status.loaded if m not in gone),
        loading=tuple(sorted((*status.loading, *moved))),
        available=tuple(sorted((*(m for m in status.available if m not in moved), *gone))),
        unloading=tuple(sorted({*status.unloading, *stopping})),
    )


def evicted(name: str, host: Host, status: HostStatus, last_use: LastUse) -> str | None:
    """The model host ``name`` unloads to load another: none with a free place, else its
    least recently used loaded model (llama-server's own choice: the last request)."""
    return None if has_free_place(host, status) else least_recent(name, status, last_use)


def has_free_place(host: Host, status: HostStatus) -> bool:
    """Rule 2: loaded + loading < ``models_max`` (0: no limit): a load evicts nothing."""
    return host.models_max == 0 or len(status.loaded) + len(status.loading) < host.models_max


def least_recent(name: str, status: HostStatus, last_use: LastUse) -> str | None:
    """The loaded model of host ``name`` crossbar sent a request to least recently (one
    it never sent any comes first; ties by id), the one llama-server evicts for a load;
    None when nothing is loaded."""
    if not status.loaded:
        return None
    return min(status.loaded, key=lambda m: (_seconds(last_use(name, m)), m))


def _seconds(value: float | None) -> float:
    return float("-inf") if value is None else value


def load_tier(
    names: Iterable[str], hosts: Mapping[str, Host], statuses: Mapping[str, HostStatus], in_use: InUse,
    last_use: LastUse, kept: Collection[str] = (), waiting: Callable[[str], int] | None = None,
) -> list[str]:
    """Rule 2: of ``names`` (hosts that would load the model), those with a free place;
    else, of the hosts whose least recently used model has no request in flight, none
    ``waiting`` for it (when given) and is not ``kept`` (a ``keep_loaded`` name, or the id
    the host lists it under: rule 5: evicting it would only load it again), those whose
    such model crossbar sent a request
    to least recently: the load evicts the model of the fleet asked for longest ago, as
    one box evicts its own least recently used (a model asked for a moment ago would be
    asked for again soon, and its reload would evict another); else none (the request
    waits: no model in use is evicted). Order kept."""
    names = list(names)
    free = [h for h in names if has_free_place(hosts[h], statuses[h])]
    if free:
        return free
    idle: dict[str, float] = {}
    for h in names:
        lru = least_recent(h, statuses[h], last_use)
        if (lru is not None and lru not in kept_ids(kept, (statuses[h],)) and in_use(h, lru) == 0
                and not (waiting and waiting(lru))):
            idle[h] = _seconds(last_use(h, lru))
    oldest = min(idle.values(), default=None)
    return [h for h in idle if idle[h] == oldest]


def idle_models(
    name: str, status: HostStatus, idle_unload: float, kept: Collection[str], now: float, in_use: InUse,
    last_use: LastUse,
) -> list[str]:
    """Rule 4: the models loaded on host ``name`` that no request used for
    ``idle_unload`` seconds (``last_use``: the last request, or when crossbar first saw
    the model loaded; None counts as just now), with none in flight, and not ``kept``."""
    out = []
    for m in status.loaded:
        if m in kept or in_use(name, m):
            continue
        last = last_use(name, m)
        if last is not None and now - last >= idle_unload:
            out.append(m)
    return out


def keep_targets(
    route: Route, hosts: Mapping[str, Host], statuses: Mapping[str, HostStatus], busy: Collection[str],
    inflight: Callable[[str], int], in_use: InUse, last_use: LastUse, draining: Collection[str] = (),
) -> list[tuple[str, str]]:
    """Rule 5: (model, host) for each ``keep_loaded`` model of ``route`` that no healthy
    host of the route has loaded or loading, on the host rule 2 picks among the healthy
    router-mode hosts listing it available that have no command in flight (``busy``) and
    are not draining; among those the least busy ((in flight + 1) / weight, route order
    on ties). At most one per host, and one per model: a kept name and a host-reported
    alias of it (§Model names) are one model, loaded once."""
    if route.placement is None:
        return []
    taken = set(busy)
    healthy = [h for h in route.hosts if h in hosts and h in statuses and statuses[h].healthy]
    kept = kept_ids(route.placement.keep_loaded, [statuses[h] for h in healthy])
    placed: set[str] = set()
    out: list[tuple[str, str]] = []
    for model in route.placement.keep_loaded:
        ids = {model_id(statuses[h], model) for h in healthy}
        if ids & placed or any(model_id(statuses[h], model) in (*statuses[h].loaded, *statuses[h].loading)
                               for h in healthy):
            continue
        names = [h for h in healthy if h not in taken and h not in draining
                 and model_id(statuses[h], model) in statuses[h].available]
        tier = load_tier(names, hosts, statuses, in_use, last_use, kept)
        if not tier:
            continue
        host = min(tier, key=lambda h: ((inflight(h) + 1) / hosts[h].weight, route.hosts.index(h)))
        taken.add(host)
        placed |= ids
        out.append((model_id(statuses[host], model), host))
    return out


def kept_ids(names: Iterable[str], statuses: Iterable[HostStatus]) -> set[str]:
    """Rules 4 and 5: the ``keep_loaded`` ``names`` and the ids ``statuses`` list them
    under (a name may be a host-reported alias, §Model names): what is never unloaded
    as idle nor evicted for a load."""
    names = list(names)
    return {*names, *(model_id(s, m) for s in statuses for m in names)}


def lists_at_all(status: HostStatus, model: str) -> bool:
    """Whether ``status`` lists ``model`` in any state (loaded, loading or available), by
    id or by a host-reported alias (§Model names); one state:
    :func:`crossbar.hosts.balance.lists`."""
    mid = model_id(status, model)
    return mid in status.loaded or mid in status.loading or mid in status.available


def unlisted_keeps(route: Route, statuses: Mapping[str, HostStatus]) -> list[str] | None:
    """Rule 5: the ``keep_loaded`` models of ``route`` that no host of the route lists
    (id or alias), which crossbar can load nowhere; None until every host of the route
    has had a good poll (``last_ok``), and for a route without ``placement``."""
    if route.placement is None:
        return None
    listings = [statuses.get(h) for h in route.hosts]
    if any(s is None or s.last_ok is None for s in listings):
        return None
    return [m for m in route.placement.keep_loaded if not any(s is not None and lists_at_all(s, m) for s in listings)]
