"""The running state of one crossbar: one source of truth for each runtime fact.

- the current :class:`~crossbar.config.Config`, one reference that a reload swaps (a
  request keeps the config it started with, so it is served under one config);
- the health table (and with it readiness: every host's first poll is in the table);
- requests in flight per host (:class:`~crossbar.state.inflight.Inflight`), read by status,
  metrics and choosing alike;
- the requests crossbar is handling (for the drain) and whether it is draining.

Status, metrics, readiness, systemd and the proxy all read these; nothing copies them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from twisted.internet.defer import Deferred, succeed

from crossbar.hosts.balance import Chosen, Rotation, Verdict, choose
from crossbar.hosts.placement import Placing, evicted, model_id
from crossbar.config import Config, Route
from crossbar.state.worker_counts import WorkerCounts
from crossbar.state.cluster import ClusterView
from crossbar.state.limits import KeyLimiter
from crossbar.hosts.health import HealthTable
from crossbar.state.inflight import Inflight
from crossbar.state.placement import PlacementState
from crossbar.state.placement_share import ClusterShare, WorkerShare
from crossbar.state.queue import RouteQueues
from crossbar.state.standing import RuntimeStanding
from crossbar.state.token_history import TokenHistory
from crossbar.state.tokens import TokenLedger
from crossbar.waiting import Condition
from crossbar.state.cells import AFFINITY, KEY_INFLIGHT, QUEUED, QUEUED_SINCE, Kind
from crossbar.state.counts import Counts
from crossbar.state.drains import HostDrains

__all__ = ["Runtime"]


class Runtime:
    """The facts crossbar's parts share (see the module docstring).

    :param config: the config to start with.
    :param now: POSIX seconds (``reactor.seconds``), for the health table.
    :ivar config: the current config; assign a new one to reload.
    :ivar table: the health table.
    :ivar inflight: requests in flight per host; a release wakes the queues.
    :ivar queues: the requests waiting for a host with room, per route.
    :ivar rotation: where round-robin among exact ties stands, per route.
    :ivar affinity_counts: (route, ``home``/``spill``/``none``) -> requests dispatched.
    :ivar key_inflight: (route, client key name) -> requests in flight or waiting.
    :ivar tokens: token totals per host and route and their history: the one store of
        tokens/s and the cached share (status and the dashboard).
    :ivar counts: where this process's shared counts go and are read from (the one
        place deciding this process / workers / Redis, :mod:`crossbar.state.counts`).
    :ivar own_counters: counters this process keeps outside the runtime, by kind
        (e.g. :data:`~crossbar.state.cells.CLUSTER_LOST`: the times its link to Redis
        was lost) -> how to read this process's value; with workers they are published
        to the fleet (:meth:`publish_counters`) and read summed (:meth:`counter`).
    :ivar limits: the client keys' request and token limits (docs/design.md §Access).
    :ivar active: the requests being handled (proxy exchanges), until each ends.
    :ivar draining: a drain has started (docs/design.md §Operations).
    :ivar drained: hosts being drained one by one (``POST /_crossbar/hosts/<name>/drain``):
        they take no new request while their in-flight ones finish.
    :ivar on_drain_change: called with (host, draining) when :meth:`drain_host` changes
        :attr:`drained` (a worker tells its supervisor, which tells every worker).
    :ivar idle: a :class:`Condition` that holds while no request is being handled.
    :ivar placement: the loads crossbar caused and the uses it made of router-mode
        hosts' models (docs/design.md §Where models live).
    """

    def __init__(self, config: Config, now: Callable[[], float]) -> None:
        self.config = config
        self.now = now
        health = config.health
        self.table = HealthTable(config.hosts, health.recovery_polls, health.failure_threshold, now)
        self.queues = RouteQueues(now, RuntimeStanding(self))  # fair order (§Access)
        self.counts = Counts()
        self.inflight = Inflight(on_release=self.queues.wake, counts=self.counts)
        self.rotation = Rotation()
        self.affinity_counts: Counter[tuple[str, str]] = Counter()
        self.key_inflight: Counter[tuple[str, str]] = Counter()
        self.tokens = TokenLedger(now, tuple(config.hosts), tuple(config.routes), self.counts)
        self.own_counters: dict[Kind, Callable[[], int]] = {}
        self.limits = KeyLimiter(now)
        self.active: set[Any] = set()
        self.draining = False
        self.drains = HostDrains(lambda: self.config.hosts)
        self.on_drain_change: Callable[[str, bool], None] | None = None
        self.idle = Condition(lambda: not self.active)
        self.placement = PlacementState(now)

    # -- choosing a host (docs/design.md §Choosing a host, §Where models live) ------------

    def choose(self, route: Route, model: str | None, key: str | None, exclude: list[str],
               queued_at: float | None = None) -> Chosen | Verdict:
        """:func:`~crossbar.hosts.balance.choose` for a request of ``route`` wanting
        ``model`` with affinity ``key``, hosts in ``exclude`` already tried, waiting
        since clock second ``queued_at`` (None: not waiting), on the health table with
        the loads crossbar caused counted as loading (§Where models live, rule 1) and,
        on a route with ``placement``, rules 2 and 3. A request sent to a router-mode
        host counts as a use of its model there from now; one that makes it load the
        model (``load``/``spread``) makes it count as loading it at once."""
        placement = self.placement
        statuses = placement.overlay(self.table.all(), () if model is None or route.placement is None else (model,))
        placing = None
        settings = route.placement
        if settings is not None:
            spread = (queued_at is not None and settings.spread_after is not None
                      and self.now() - queued_at >= settings.spread_after)
            placing = Placing(self.inflight.host_model, placement.last_use, spread, settings.keep_loaded,
                              self.queues.waiting_for)
        verdict = choose(route, self.config.hosts, statuses, self.inflight.host, model, key, self.rotation,
                         exclude=exclude, draining=self.drained, placement=placing)
        if isinstance(verdict, Chosen) and model is not None:
            status = statuses[verdict.host]
            if status.router:
                mid = model_id(status, model)
                placement.used(verdict.host, mid)
                if verdict.load:
                    evicts = evicted(verdict.host, self.config.hosts[verdict.host], status, placement.last_use)
                    placement.started(verdict.host, mid, "spread" if verdict.load == "spread" else "request", evicts)
                verdict = verdict._replace(model=mid)
        return verdict

    # -- shared counts (docs/design.md §Workers, §Several crossbars: crossbar.state.counts) --

    @property
    def fleet(self) -> WorkerCounts | None:
        """With workers, the box's shared counts (:meth:`attach`); else None."""
        return self.counts.fleet

    @property
    def cluster(self) -> ClusterView | None:
        """With ``cluster.redis``, the instances' counts (:meth:`join`); else None."""
        return self.counts.cluster

    def attach(self, fleet: WorkerCounts) -> None:
        """Publish this process's counts to ``fleet`` and read the fleet's from now on."""
        self.counts.fleet = fleet
        self.placement.share = self.inflight.models_share = WorkerShare(fleet)  # §Where models live
        self.queues.on_change = self._publish_queue
        if fleet.limits is not None:  # key limits per box (docs/design.md §Access)
            self.limits.counts = fleet.limits
        self.republish()
        self.tokens.attach(TokenHistory.of_row(fleet.shared.path, fleet.shared.row))

    def join(self, cluster: ClusterView) -> None:
        """Share this process's in-flight counts (per host, per client key) with the
        other instances of ``cluster`` and count theirs (docs/design.md §Several crossbars)."""
        self.counts.cluster = cluster
        self.placement.share = self.inflight.models_share = ClusterShare(cluster)  # §Where models live
        cluster.on_drains = self.apply_drains
        self.inflight.publish()
        for route, key in self.key_inflight:
            self._publish_key(route, key)

    def others_changed(self) -> None:
        """Another instance's counts changed: a slot may have freed there."""
        if len(self.queues):
            self.queues.wake()

    def reconfigure(self, config: Config) -> None:
        """A reload (docs/design.md §Operations): ``config`` is the one every request
        from now on is served under (in-flight ones keep theirs); drains of hosts it no
        longer names are forgotten; the token ledger and the fleet's names follow it."""
        self.config = config
        self.drains.forget_removed()  # a removed host is leaving, not draining
        self.tokens.configure(tuple(config.hosts), tuple(config.routes))
        if self.fleet is not None:
            self.fleet.configure(config)
            self.republish()

    def republish(self) -> None:
        """Write every count of this process to the fleet again (after the fleet's
        names changed with a reload)."""
        if self.fleet is None:
            return
        self.inflight.publish()
        self.placement.republish()
        self.tokens.republish()
        for route in self.config.routes:
            self._publish_queue(route)
        for (route, outcome), n in self.affinity_counts.items():
            self.counts.publish(AFFINITY, AFFINITY.cell(route, outcome), n)
        for route, key in self.key_inflight:
            self._publish_key(route, key)
        self.publish_counters()

    def publish_counters(self) -> None:
        """Write this process's :attr:`own_counters` where they are shared (with workers;
        call it whenever one may have grown)."""
        for kind, read in self.own_counters.items():
            self.counts.publish(kind, kind.cell(), read())

    def counter(self, kind: Kind) -> int:
        """Own counter ``kind`` (:attr:`own_counters`): this process's value, or with
        workers the sum over every worker, those that died included (the supervisor
        keeps their share), so it never goes down whichever worker answers
        (docs/design.md §Workers)."""
        self.publish_counters()
        read = self.own_counters.get(kind)
        return self.counts.read(kind, kind.cell(), read() if read is not None else 0)

    def _publish_key(self, route: str, key: str) -> None:
        self.counts.publish(KEY_INFLIGHT, KEY_INFLIGHT.cell(route, key), self.key_inflight[(route, key)])

    def _publish_queue(self, route: str) -> None:
        since = self.queues.oldest_since(route)
        self.counts.publish(QUEUED, QUEUED.cell(route), self.queues.queued(route))
        self.counts.publish(QUEUED_SINCE, QUEUED_SINCE.cell(route), 0 if since is None else int(since * 1000) or 1)

    def queued(self, route: str) -> int:
        """Requests waiting in ``route``'s queue (every worker's)."""
        return self.counts.read(QUEUED, QUEUED.cell(route), self.queues.queued(route))

    def oldest_wait(self, route: str) -> float | None:
        """Seconds the oldest waiting request of ``route`` has waited (every worker's),
        or None when none waits."""
        own = self.queues.oldest_since(route)
        since = self.counts.smallest(QUEUED_SINCE, QUEUED_SINCE.cell(route), None if own is None else own * 1000)
        return None if since is None else max(0.0, self.now() - since / 1000)

    def count_affinity(self, route: str, outcome: str) -> None:
        """One request of ``route`` was dispatched with affinity ``outcome``."""
        self.affinity_counts[(route, outcome)] += 1
        if self.counts.shared:
            self.counts.publish(AFFINITY, AFFINITY.cell(route, outcome), self.affinity_counts[(route, outcome)])

    def affinity(self, route: str, outcome: str) -> int:
        """Requests of ``route`` dispatched with affinity ``outcome`` (every worker's)."""
        return self.counts.read(AFFINITY, AFFINITY.cell(route, outcome), self.affinity_counts[(route, outcome)])

    # -- host drain (docs/design.md §Operations) -------------------------------------------

    def drain_host(self, host: str, draining: bool, tell: bool = True) -> bool:
        """Start (``draining``) or end the drain of configured ``host``; returns False
        for a host the config does not name. An undrained host may take the requests
        waiting at once. ``tell``: call :attr:`on_drain_change` (not when the change
        came from the supervisor)."""
        if not self.drains.set(host, draining):
            return False
        if not draining:
            self.queues.wake()
        if tell and self.on_drain_change is not None:
            self.on_drain_change(host, draining)
        if tell and self.cluster is not None:  # every instance (§Several crossbars)
            self.cluster.drain(host, draining)
        return True

    def apply_drains(self, drains: dict[str, bool], whole: bool) -> None:
        """Drains done through other instances, as Redis tells them: host -> draining,
        and with ``whole`` the full set (a configured host absent is not draining).
        Hosts the config does not name are ignored."""
        for host, draining in self.drains.changes(drains, whole).items():
            self.drain_host(host, draining, tell=False)

    @property
    def drained(self) -> set[str]:
        """The hosts being drained (:class:`~crossbar.state.drains.HostDrains`)."""
        return self.drains.drained

    def first_round_done(self) -> bool:
        """Every configured host's first poll has finished (or timed out)."""
        return all(s.polled for s in self.table.all().values())

    @property
    def ready(self) -> bool:
        """Readiness (docs/design.md §Operations): every host's first poll is done, some
        host is healthy, and crossbar is not draining; with ``cluster.redis``, the first
        connection to Redis has also succeeded or failed (at most 2 s after start,
        §Several crossbars: an instance never serves its first requests counting alone
        while Redis is there)."""
        if self.draining or (self.cluster is not None and not self.cluster.settled):
            return False
        statuses = self.table.all().values()
        return all(s.polled for s in statuses) and any(s.healthy for s in statuses)

    def key_admits(self, route: Route, key: str) -> bool:
        """Whether a request with client key ``key`` of ``route`` may start: the key has
        fewer than its ``max_inflight`` requests in flight or waiting (docs/design.md §Access;
        429 otherwise), counted as :meth:`key_requests` says."""
        settings = route.keys.get(key)
        limit = settings.max_inflight if settings is not None else None
        return limit is None or self.key_requests(route.name, key) < limit

    def key_requests(self, route: str, key: str) -> int:
        """Requests of configured client key ``key`` of ``route`` in flight or waiting:
        every instance's with ``cluster.redis``, every worker's with workers (what
        :meth:`key_admits` compares with ``max_inflight``; the fair order reads it too)."""
        return self.counts.read(KEY_INFLIGHT, KEY_INFLIGHT.cell(route, key), self.key_inflight[(route, key)])

    def check_limits(self, route: Route, key: str) -> Deferred[float]:
        """A key's ``limits`` for a request arriving now (docs/design.md §Access): fires with
        0 when it may start (it is counted), else with the seconds until the window
        allows the next one (429 with that ``Retry-After``). At once without
        ``cluster``; within 50 ms with it. Never fails."""
        settings = route.keys.get(key)
        if settings is None or not settings.limits:
            return succeed(0.0)
        return self.limits.check(route.name, key, settings.limits)

    def spend(self, route: str, key: str, tokens: int) -> None:
        """Client key ``key`` of ``route`` spent ``tokens`` (prompt + generated, as the
        host reported them) with an answer that just ended: counted against its
        ``tokens_per_minute`` and ``tokens_per_day`` (fleet-wide with ``cluster``)."""
        self.limits.spend(route, key, tokens)

    def begin(self, exchange: Any) -> None:
        """``exchange`` is being handled (the drain waits for it; its key counts)."""
        self.active.add(exchange)
        if exchange.key:
            self.key_inflight[(exchange.route_name, exchange.key)] += 1
            self._publish_key(exchange.route_name, exchange.key)

    def end(self, exchange: Any) -> None:
        """``exchange`` is over."""
        if exchange in self.active:
            self.active.discard(exchange)
            if exchange.key:
                self.key_inflight[(exchange.route_name, exchange.key)] -= 1
                self._publish_key(exchange.route_name, exchange.key)
        self.idle.check()
