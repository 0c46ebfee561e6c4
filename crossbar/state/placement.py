"""What crossbar knows of the loads it caused (docs/design.md §Where models live, rules 1, 4
and 7): the hosts it made load a model (counted as loading at once, until a poll says
otherwise or ``timeouts.first_byte`` passes), the models it told a host to unload
(counted as not loaded there at once, until a poll shows them gone or the same bound
passes), the last request it sent each model on each host, when it first saw a model
loaded, and the last load and unload per host with their reason; with a share, the
marks and uses of the other workers and instances too. Bookkeeping only: no I/O (the
commands are :class:`crossbar.state.placer.Placer`'s), the clock is injected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple

from twisted.internet.defer import Deferred, succeed

from crossbar.hosts.health import HostStatus
from crossbar.hosts.placement import InUse, model_id, with_loading
from crossbar.state.placement_share import PlacementShare

__all__ = ["Load", "Move", "PlacementState", "REASONS", "Settled", "Unload"]

REASONS = ("request", "spread", "keep", "idle")
"""Why a model was loaded (``request``, ``spread``, ``keep``) or unloaded (``idle``)."""


@dataclass(frozen=True)
class Load:
    """A load crossbar caused on one host.

    :ivar since: clock seconds it started (the request or the command was sent).
    :ivar reason: ``request``, ``spread`` or ``keep``.
    :ivar evicts: the model the host unloads for it (no free place: its least recently
        used), counted as unloaded at once like the load counts as loading; or None.
    """

    since: float
    reason: str
    evicts: str | None = None


@dataclass
class Unload:
    """An unload crossbar told a host to do (rule 4), until it is over.

    :ivar since: clock seconds the command was sent, then the second the host answered
        it (the bound, ``timeouts.first_byte``, counts from the later).
    :ivar done: the host answered the command.
    :ivar reason: why crossbar sent it (``idle``), counted once a poll shows it done.
    :ivar shown: good polls started after that answer that still listed the model
        loaded (llama-server lists a model it is stopping as loaded for a moment; a
        second such poll means the host kept it, or loaded it again).
    """

    since: float
    done: bool = False
    shown: int = 0
    reason: str = "idle"


class Settled(NamedTuple):
    """The unloads one poll settled (:meth:`PlacementState.polled`, rule 4).

    :ivar gone: the models the poll shows gone; :ivar kept: those the host answered
        the unload of and still lists loaded, two polls on.
    """

    gone: list[str]
    kept: list[str]


@dataclass(frozen=True)
class Move:
    """The last load or unload of a host (status, the dashboard).

    :ivar model: the model id; :ivar reason: one of :data:`REASONS`;
    :ivar at: clock seconds it started.
    """

    model: str
    reason: str
    at: float


class PlacementState:
    """Loads crossbar caused and the uses it made, per (host, model id).

    :param now: clock seconds (``reactor.seconds``).
    :ivar loading: (host, model) -> the :class:`Load` under way (rule 1).
    :ivar unloading: (host, model) -> the :class:`Unload` this process sent (rule 4):
        the model counts as not loaded there, and no request for it goes there, until
        a poll started after the host answered shows it gone (or a second such poll
        still shows it loaded); with a :attr:`share`, in the other processes too.
    :ivar last_load: host -> its last load; :ivar last_unload: host -> its last unload.
    :ivar on_move: called with (host, model, ``load``/``unload``, reason) for every
        load and unload crossbar causes (the metrics).
    :ivar on_loaded: called with (host, model, seconds) when a poll shows a load
        crossbar caused finished (the load-time histogram).
    :ivar share: with workers or ``cluster.redis``, where this process's loads, unloads
        and uses go and the other processes' come from (rule 7), else None.
    """

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self.loading: dict[tuple[str, str], Load] = {}
        self._used: dict[tuple[str, str], float] = {}
        self._seen: dict[tuple[str, str], float] = {}
        self.last_load: dict[str, Move] = {}
        self.last_unload: dict[str, Move] = {}
        self.on_move: Callable[[str, str, str, str], None] | None = None
        self.on_loaded: Callable[[str, str, float], None] | None = None
        self.share: PlacementShare | None = None
        self._lingering: dict[tuple[str, str], float] = {}
        self.unloading: dict[tuple[str, str], Unload] = {}
        self._unload_lingering: dict[tuple[str, str], float] = {}

    def last_use(self, host: str, model: str) -> float | None:
        """Clock seconds of the last request crossbar (any process sharing, rule 7) sent
        ``model`` on ``host`` (or of an unload of it there the host refused:
        :meth:`unload_refused`), or None."""
        own = self._used.get((host, model))
        if self.share is None:
            return own
        theirs = self.share.last_use(host, model)
        return theirs if own is None else own if theirs is None else max(own, theirs)

    def idle_since(self, host: str, model: str) -> float | None:
        """Since when ``model`` on ``host`` is unused by crossbar: its last use (a
        request, or an unload the host refused: :meth:`unload_refused`), else the first
        poll that showed it loaded; None when neither is known (rule 4)."""
        used = self.last_use(host, model)
        return used if used is not None else self._seen.get((host, model))

    def overlay(self, statuses: Mapping[str, HostStatus], wanted: Iterable[str] = ()) -> Mapping[str, HostStatus]:
        """Rules 1 and 4: ``statuses`` with every load crossbar caused and no poll settled
        yet counted as loading, and every model it is unloading as not loaded (the same
        mapping when there is none); with a :attr:`share`, the other processes' loads
        and unloads of the ``wanted`` models (ids or aliases) too."""
        loads, unloads = self._shared(statuses, wanted)
        if not self.loading and not loads and not unloads and not self.unloading:
            return statuses
        by_host: dict[str, tuple[list[str], list[str], list[str]]] = {}
        for host, model in loads:
            by_host.setdefault(host, ([], [], []))[0].append(model)
        for (host, model), load in self.loading.items():
            loading, evicting, _ = by_host.setdefault(host, ([], [], []))
            loading.append(model)
            if load.evicts is not None:
                evicting.append(load.evicts)
        for host, model in [*self.unloading, *unloads]:
            by_host.setdefault(host, ([], [], []))[2].append(model)
        out = dict(statuses)
        for host, (loading, evicting, unloading) in by_host.items():
            if host in out:
                out[host] = with_loading(out[host], loading, evicting, unloading)
        return out

    def _shared(self, statuses: Mapping[str, HostStatus],
                wanted: Iterable[str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """The (host, model id) of the ``wanted`` models that another process of
        :attr:`share` is loading there (listed available) and unloading there (listed
        loaded): rules 1, 4 and 7."""
        loads: list[tuple[str, str]] = []
        unloads: list[tuple[str, str]] = []
        share = self.share
        if share is None:
            return loads, unloads
        for model in wanted:
            for host, status in statuses.items():
                if not status.router:
                    continue
                mid = model_id(status, model)
                if mid in status.available and share.loading(host, mid):
                    loads.append((host, mid))
                elif mid in status.loaded and share.unloading(host, mid):
                    unloads.append((host, mid))
        return loads, unloads

    def claim_unload(self, host: str, model: str) -> Deferred[bool]:
        """Rule 4: whether this process may unload ``model`` on ``host``: no other process
        of :attr:`share` has an unload of it under way, decided as one step with
        publishing this one's (:meth:`PlacementShare.claim_unloading`); True at once
        without a share. Never fails."""
        if self.share is None:
            return succeed(True)
        return self.share.claim_unloading(host, model)

    def others_unloading(self, host: str, model: str) -> bool:
        """Another process of :attr:`share` told ``host`` to unload ``model`` (id) and no
        poll of its showed it gone yet (rule 4): this one sends no second command."""
        return self.share is not None and self.share.unloading(host, model)

    def used(self, host: str, model: str) -> None:
        """A request for ``model`` was sent to ``host`` now."""
        now = self._used[(host, model)] = self.now()
        if self.share is not None:
            self.share.publish_use(host, model, now)

    def drop(self, host: str, model: str, linger: float = 0.0) -> None:
        """The load of ``model`` on ``host`` is settled (or failed): no longer counted
        here; the other processes of :attr:`share` still see it for ``linger`` seconds
        (until their own polls show what this one's did)."""
        if self.loading.pop((host, model), None) is not None and self.share is not None:
            self._end_shared((host, model), linger, self._lingering, self.share.publish_loading)

    def republish(self) -> None:
        """Write this process's loads and last uses to :attr:`share` again (after a reload)."""
        if self.share is not None:
            for host, model in self.loading:
                self.share.publish_loading(host, model, True)
            for host, model in [*self.unloading, *self._unload_lingering]:
                self.share.publish_unloading(host, model, True)
            for (host, model), seconds in self._used.items():
                self.share.publish_use(host, model, seconds)

    def started(self, host: str, model: str, reason: str, evicts: str | None = None) -> None:
        """A request sent to ``host`` made it load ``model`` now: it counts as loading at
        once (rule 1), and ``evicts`` (the model it unloads for it, if any) as unloaded;
        counted for the metrics at once (:meth:`command_started`, then
        :meth:`command_accepted`)."""
        self.command_started(host, model, reason, evicts)
        self.command_accepted(host, model, reason)

    def unloading_started(self, host: str, model: str) -> None:
        """crossbar is telling ``host`` to unload ``model`` (rule 4): from now until a poll
        that started after the command ended shows it gone (or the command failed, or
        ``timeouts.first_byte`` passed) it counts as not loaded there, so no request is
        sent to it on that host while the host stops it (a request caught by the unload
        would be cut, and a cut answer marks the host down); with a :attr:`share`, in
        every process (rule 7)."""
        self.unloading[(host, model)] = Unload(self.now())
        self._unload_lingering.pop((host, model), None)
        if self.share is not None:
            self.share.publish_unloading(host, model, True)

    def unloading_ended(self, host: str, model: str, linger: float = 0.0) -> None:
        """The unload of ``model`` on ``host`` failed, or is over (a poll showed it gone,
        ``timeouts.first_byte`` passed, a reload removed the host): it no longer counts
        here; the other processes of :attr:`share` still see it for ``linger`` seconds
        (until their own polls show what this one's did)."""
        if self.unloading.pop((host, model), None) is not None and self.share is not None:
            self._end_shared((host, model), linger, self._unload_lingering, self.share.publish_unloading)

    def _end_shared(self, key: tuple[str, str], linger: float, lingering: dict[tuple[str, str], float],
                    publish: Callable[[str, str, bool], None]) -> None:
        """A mark of this process ended: the other processes of :attr:`share` stop seeing
        it now, or ``linger`` seconds from now (:meth:`expire` then unpublishes it)."""
        if linger > 0:
            lingering[key] = self.now() + linger
        else:
            lingering.pop(key, None)
            publish(*key, False)

    def unload_refused(self, host: str, model: str) -> None:
        """The unload of ``model`` on ``host`` failed, or the host answered it and kept
        the model (rule 4): the mark ends, and the refusal counts as a use of the model
        there, shared like the others (rule 7): its idle time starts again in every
        process, so the next unload of it there waits a whole ``idle_unload``."""
        self.unloading_ended(host, model)
        self.used(host, model)

    def unloaded(self, host: str, model: str, reason: str) -> None:
        """``host`` answered crossbar's unload of ``model`` (rule 4); it stays counted as
        not loaded until a poll that starts from now shows it gone (or a second one
        still shows it loaded: :meth:`polled`)."""
        unload = self.unloading.get((host, model))
        self.drop(host, model)
        self._seen.pop((host, model), None)
        if unload is None:  # a poll already showed it gone (the answer came after it)
            self._unloaded(host, model, reason)
        else:
            unload.since, unload.done, unload.reason = self.now(), True, reason

    def _unloaded(self, host: str, model: str, reason: str) -> None:
        """An unload crossbar caused is done: the host answered it and a poll shows the
        model gone (status's last unload, the metrics; rule 7). One the host answered and
        kept is not an unload (:meth:`unload_refused`)."""
        self.last_unload[host] = Move(model, reason, self.now())
        if self.on_move is not None:
            self.on_move(host, model, "unload", reason)

    def polled(self, host: str, status: HostStatus, started: float, linger: float = 0.0,
               in_use: InUse | None = None) -> Settled:
        """A good poll of ``host`` that started at clock second ``started`` listed
        ``status``: a load it shows loaded is done (its time observed; the other
        processes see it loading ``linger`` seconds more, until their polls show it
        loaded); one it shows neither loaded nor loading (failed, or back to unloaded)
        ended, if the poll started after the load did and no request crossbar sent for
        the model is still in flight there (``in_use``, when given: llama-server lists a
        model unloaded while requests for it wait in its own queue for a place; a load
        that failed ends them with an error) (rule 1). Models seen loaded for the first
        time start their idle time. An unload is over (the other processes see it
        ``linger`` seconds more) when a poll started after the command was sent shows
        the model gone, or when a second poll started after the host answered still
        lists it loaded (the host kept it, or something loaded it again: without this
        the mark would hold the model away from the host until ``timeouts.first_byte``)
        (rule 4): then its idle time starts again (:meth:`unload_refused`). Returns the
        unloads of this process it settled: the models gone, and those the host kept."""
        now = self.now()
        settled = Settled([], [])
        for model in status.loaded:
            self._seen.setdefault((host, model), now)
        for (h, model), load in list(self.loading.items()):
            if h != host:
                continue
            if model in status.loaded:
                self.drop(h, model, linger)
                if self.on_loaded is not None:
                    self.on_loaded(host, model, max(0.0, now - load.since))
            elif model not in status.loading and started >= load.since and not (in_use and in_use(h, model)):
                self.drop(h, model)
        for key in [k for k in self._seen if k[0] == host and k[1] not in status.loaded]:
            del self._seen[key]
        for (h, model), unload in list(self.unloading.items()):
            if h != host or started < unload.since:
                continue
            if model not in status.loaded:
                self.unloading_ended(h, model, linger)
                settled.gone.append(model)
                if unload.done:
                    self._unloaded(h, model, unload.reason)
            elif unload.done:
                unload.shown += 1
                if unload.shown >= 2:
                    self.unload_refused(h, model)
                    settled.kept.append(model)
        return settled

    def expire(self, bound: float) -> list[tuple[str, str]]:
        """Drop the loads (rule 1) and the unloads (rule 4) older than ``bound`` seconds
        (``timeouts.first_byte``), and stop showing the other processes the settled
        loads and unloads whose linger is over; returns the loads dropped."""
        now = self.now()
        gone = [k for k, load in self.loading.items() if now - load.since >= bound]
        for key in gone:
            self.drop(*key)
        for key in [k for k, unload in self.unloading.items() if now - unload.since >= bound]:
            self.unloading_ended(*key)
        for key in [k for k, until in self._lingering.items() if until <= now]:
            del self._lingering[key]
            if self.share is not None and key not in self.loading:
                self.share.publish_loading(*key, False)
        for key in [k for k, until in self._unload_lingering.items() if until <= now]:
            del self._unload_lingering[key]
            if self.share is not None and key not in self.unloading:
                self.share.publish_unloading(*key, False)
        return gone

    def forget(self, hosts: Iterable[str]) -> None:
        """Keep only what concerns ``hosts`` (a reload removed or reset the others)."""
        keep = set(hosts)
        for key in [k for k in self.loading if k[0] not in keep]:
            self.drop(*key)
        for key in [k for k in self.unloading if k[0] not in keep]:
            self.unloading_ended(*key)
        for table in (self._used, self._seen):
            for key in [k for k in table if k[0] not in keep]:
                del table[key]
        for moves in (self.last_load, self.last_unload):
            for host in [h for h in moves if h not in keep]:
                del moves[host]

    # -- the Placer's load commands (rule 7: counted once the host accepted them) ----------

    def command_started(self, host: str, model: str, reason: str, evicts: str | None = None) -> None:
        """A load command for ``model`` is on its way to ``host``: it counts as loading at
        once (rule 1), ``evicts`` as unloaded, as :meth:`started` does; but it is no load
        crossbar caused yet (no :attr:`last_load`, no :attr:`on_move`): that is
        :meth:`command_accepted`, when the host said yes (a refused command loads nothing)."""
        if (host, model) not in self.loading:
            self.loading[(host, model)] = Load(self.now(), reason, evicts)
            self._lingering.pop((host, model), None)
            if self.share is not None:
                self.share.publish_loading(host, model, True)

    def command_accepted(self, host: str, model: str, reason: str) -> None:
        """``host`` accepted the load command for ``model`` (2xx): a load crossbar caused,
        for the status, the dashboard and the metrics (rule 7); its time is now."""
        self.last_load[host] = Move(model, reason, self.now())
        if self.on_move is not None:
            self.on_move(host, model, "load", reason)
