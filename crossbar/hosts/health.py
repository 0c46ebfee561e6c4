"""The health table: what crossbar believes about every host (docs/design.md §The health table).

The table is pure bookkeeping: it performs no I/O. The poller (:mod:`crossbar.hosts.poller`)
feeds it poll results and the proxy feeds it :meth:`HealthTable.mark_down`. Readers get
frozen :class:`HostStatus` records, so nothing a caller does changes the table (rule 8).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Iterable

from twisted.logger import Logger

from crossbar.config import Config, one_line
from crossbar.hosts.models import ModelList

__all__ = ["HealthTable", "HostStatus", "LifeSign", "models_text"]


@dataclass(frozen=True)
class HostStatus(ModelList):
    """One host's state as last recorded: what it listed at its last good poll (the
    fields of :class:`~crossbar.hosts.models.ModelList`: ``loaded``, ``loading``,
    ``available``, ``entries`` for the route model list of docs/design.md §The proxy
    rule 10, ``router``, ``aliases``), and its health.

    :ivar healthy: whether the proxy may send requests to the host.
    :ivar last_ok: POSIX time (seconds) of the last good poll, or None.
    :ivar last_err: why the last poll or request failed; "" after a good poll.
    :ivar consecutive: good polls in a row.
    :ivar failures: failed polls in a row.
    :ivar has_failed: the host has failed (a failed poll that took or kept it down, or a
        mark-down) and has not been trusted since, so it needs ``recovery_polls`` good
        polls in a row to be healthy (rules 3-5).
    :ivar polled: at least one poll of the host has finished (good or failed).
    :ivar slots: the slot count the host reported (``GET /props`` → ``total_slots``,
        for ``max_inflight: slots``), or None while unknown; kept across a failure,
        read anew after each recovery, dropped when the host is in router mode.
    :ivar unloading: ids crossbar told the host to unload and no poll showed gone yet
        (docs/design.md §Where models live, rule 4): counted ``available`` there, but no
        request for them goes to this host until the mark ends. Never set by a poll:
        only the placement overlay's copies carry it
        (:meth:`~crossbar.state.placement.PlacementState.overlay`).
    """

    healthy: bool = False
    last_ok: float | None = None
    last_err: str = ""
    consecutive: int = 0
    failures: int = 0
    has_failed: bool = False
    polled: bool = False
    slots: int | None = None
    unloading: tuple[str, ...] = ()


class LifeSign:
    """When a host last sent a byte of an answer, in clock seconds (``-inf``: never).

    The relay of an answer from the host sets :attr:`at` on each body chunk (one
    attribute store per event); the health table reads it (:meth:`HealthTable.alive_since`).
    """

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = float("-inf")


LOGGED_MODELS = 20
"""Loaded ids the "is healthy" line names at most (a host may list thousands)."""


def models_text(status: HostStatus) -> str:
    """The models of the "is healthy" line: the loaded ids (escaped: a host's text; the
    first :data:`LOGGED_MODELS`, then how many more), then how many are loading and how
    many the host can load on demand (a router-mode host lists them all, most unloaded):
    ``tiny-a; 2 available``, ``none loaded; 3 available``; ``none`` for a host that lists
    nothing."""
    more = len(status.loaded) - LOGGED_MODELS
    loaded = one_line(", ".join(status.loaded[:LOGGED_MODELS])) + (f" and {more} more" if more > 0 else "")
    counts = [f"{len(ids)} {what}" for ids, what in ((status.loading, "loading"), (status.available, "available"))
              if ids]
    if not counts:
        return loaded or "none"
    return f"{loaded or 'none loaded'}; {', '.join(counts)}"


class HealthTable:
    """Per-host health, updated by poll results and by the proxy's mark-downs.

    :param hosts: the host names to track; every one starts unhealthy (rule 1).
    :param recovery_polls: good polls in a row a host that has failed needs (>= 1).
    :param failure_threshold: failed polls in a row before a healthy host goes down (>= 1).
    :param now: a clock returning POSIX seconds, e.g. ``reactor.seconds``.
    """

    _log = Logger(namespace="crossbar.health")

    def __init__(
        self,
        hosts: Iterable[str],
        recovery_polls: int,
        failure_threshold: int,
        now: Callable[[], float],
    ) -> None:
        self._hosts: dict[str, HostStatus] = {name: HostStatus() for name in hosts}
        self.recovery_polls = recovery_polls
        self.failure_threshold = failure_threshold
        self._now = now
        self._life: dict[str, LifeSign] = {}

    def life_sign(self, name: str) -> LifeSign:
        """Where the proxy notes each byte of an answer from ``name`` (a sign of life,
        docs/design.md §The proxy rule 7), read by :meth:`alive_since`. A host the
        table does not track, or one that starts over, gets one that is read nowhere."""
        life = self._life.get(name)
        if life is None:
            life = LifeSign()
            if name in self._hosts:
                self._life[name] = life
        return life

    def alive_since(self, name: str, since: float) -> bool:
        """Whether ``name`` showed a sign of life at or after clock second ``since``: a
        good poll finished, or a byte of an answer arrived (rule 7: a host slow on one
        request while it answers others is busy, not dead)."""
        status = self._hosts.get(name)
        if status is not None and status.last_ok is not None and status.last_ok >= since:
            return True
        life = self._life.get(name)
        return life is not None and life.at >= since

    def get(self, name: str) -> HostStatus | None:
        """The status of ``name``, or None for a host the table does not track."""
        return self._hosts.get(name)

    def is_router(self, name: str) -> bool:
        """``name`` is in router mode at its last good poll (§"Model names")."""
        status = self._hosts.get(name)
        return status is not None and status.router

    def all(self) -> dict[str, HostStatus]:
        """A snapshot of every host's status (a new dict; the records are frozen)."""
        return dict(self._hosts)

    def is_healthy(self, name: str) -> bool:
        """Whether ``name`` is tracked and healthy."""
        status = self._hosts.get(name)
        return status is not None and status.healthy

    def record_success(self, name: str, models: ModelList | Iterable[str]) -> None:
        """A good poll of ``name`` that listed ``models`` (rule 3): a
        :class:`~crossbar.hosts.models.ModelList`, or ids that are all loaded (empty ids and
        duplicates are dropped and the rest sorted).
        """
        old = self._hosts.get(name)
        if old is None:
            return
        listed = models if isinstance(models, ModelList) else ModelList.of_loaded(models)
        consecutive = old.consecutive + 1
        healthy = (not old.has_failed) or consecutive >= self.recovery_polls
        new = replace(
            old,
            consecutive=consecutive,
            failures=0,
            last_ok=self._now(),
            last_err="",
            **{f.name: getattr(listed, f.name) for f in fields(ModelList)},
            healthy=healthy,
            # once trusted again it is judged like a host that never failed: a failed
            # poll below failure_threshold followed by a good one keeps it healthy
            has_failed=old.has_failed and not healthy,
            polled=True,
            slots=None if listed.router else old.slots,
        )
        self._set(name, old, new)

    def record_slots(self, name: str, slots: int) -> None:
        """``name`` reported ``slots`` slots (``max_inflight: slots``, docs/design.md
        §Choosing a host, rule 2). Unknown names are ignored."""
        old = self._hosts.get(name)
        if old is not None and old.slots != slots:
            self._hosts[name] = replace(old, slots=slots)
            self._log.info("host {host}: {slots} slots (its max_inflight)", host=name, slots=slots)

    def record_failure(self, name: str, reason: str) -> None:
        """A failed poll of ``name`` (rule 4); ``loaded`` is kept as last seen."""
        old = self._hosts.get(name)
        if old is None:
            return
        failures = old.failures + 1
        goes_down = (not old.healthy) or failures >= self.failure_threshold
        new = replace(
            old,
            failures=failures,
            consecutive=0,
            last_err=reason,
            polled=True,
            healthy=old.healthy and not goes_down,
            has_failed=old.has_failed or goes_down,
        )
        self._set(name, old, new)

    def mark_down(self, name: str, reason: str) -> None:
        """A request to ``name`` really failed: take it out at once (rule 5).

        Unknown names are ignored.
        """
        old = self._hosts.get(name)
        if old is None:
            return
        new = replace(
            old, healthy=False, has_failed=True, consecutive=0, last_err="marked down: " + reason
        )
        self._set(name, old, new)

    def reconfigure(self, config: Config, fresh: Iterable[str] = ()) -> None:
        """A reload (docs/design.md §Operations): ``health.recovery_polls`` and
        ``failure_threshold`` from ``config``, and its hosts (:meth:`set_hosts`; those in
        ``fresh`` start over)."""
        self.recovery_polls = config.health.recovery_polls
        self.failure_threshold = config.health.failure_threshold
        self.set_hosts(config.hosts, reset=fresh)

    def set_hosts(self, names: Iterable[str], reset: Iterable[str] = ()) -> None:
        """Track exactly ``names``, in that order (a config reload, docs/design.md §Operations).

        A host already tracked and not in ``reset`` keeps its status; a new host, or
        one in ``reset`` (its URL changed), starts afresh (rule 1); hosts not in
        ``names`` are forgotten.
        """
        fresh = set(reset)
        old = self._hosts
        self._hosts = {
            name: old[name] if name in old and name not in fresh else HostStatus() for name in names
        }
        for name in [n for n in self._life if n not in self._hosts or n in fresh]:
            del self._life[name]  # relays in flight of the old host note into a detached sign

    def _set(self, name: str, old: HostStatus, new: HostStatus) -> None:
        self._hosts[name] = new
        if not old.polled and new.polled and not new.healthy and not old.healthy:
            # Unhealthy from the start: no transition, but the operator must hear of it.
            self._log.warn(
                "host {host} is unhealthy: {reason}", host=name, healthy=False, reason=one_line(new.last_err)
            )
        elif old.healthy != new.healthy:
            if new.healthy:
                # Model ids are the host's text: escaped, so none can break the line, the
                # terminal or the log file's encoding (a lone surrogate lost the line).
                self._log.info(
                    "host {host} is healthy: {reason} (models: {models})",
                    host=name, healthy=True, reason=f"{new.consecutive} good poll(s) in a row",
                    loaded=[one_line(m) for m in new.loaded[:LOGGED_MODELS]], models=models_text(new),
                )
            else:
                self._log.warn(
                    "host {host} is unhealthy: {reason}", host=name, healthy=False, reason=one_line(new.last_err)
                )
