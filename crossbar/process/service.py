"""Assemble crossbar from a :class:`~crossbar.config.Config` (docs/design.md §Shape), drain
it on shutdown and reload it on SIGHUP (docs/design.md §Operations).

:func:`make_service` builds one :class:`CrossbarService` (a ``MultiService``): the
health poller and the web service (a :class:`~crossbar.proxy.web.CrossbarSite` on the
``listen`` endpoint), around one :class:`~crossbar.state.runtime.Runtime` that every part
reads. Its ``stopService`` is the drain, so ``twistd`` (which waits for that Deferred on
SIGTERM) gives in-flight requests their time without depending on trigger order.
"""

from __future__ import annotations

import gc
import os
from typing import Any, Callable, Mapping

from twisted.application.service import MultiService
from twisted.internet.defer import CancelledError, Deferred, DeferredList, TimeoutError, ensureDeferred, gatherResults
from twisted.internet.interfaces import IStreamServerEndpoint
from twisted.internet.task import LoopingCall, deferLater
from twisted.logger import Logger

from crossbar.config import Config
from crossbar.state.cells import CLUSTER_LOST, CLUSTER_SLOW, RESTARTS
from crossbar.state.worker_counts import AFFINITY_OUTCOMES, WorkerCounts
from crossbar.hosts.health import HealthTable
from crossbar.ops.metrics import FleetCounters, LiveCollector, Metrics
from crossbar.ops.app import OpsApp
from crossbar.ops.fleet_recent import FleetRecent
from crossbar.ops.recent import TICK, RecentRequests
from crossbar.state.token_share import RedisTokens
from crossbar.hosts.commands import HTTPModelCommands
from crossbar.state.placer import Placer
from crossbar.hosts.poller import HealthPoller, HTTPProbe
from crossbar.proxy.resource import ProxyResource
from crossbar.ops.record import RequestLog
from crossbar.process.reload import REFUSED, SIGHUPReload, catch_second_stop_signal, next_config, plan_reload
from crossbar.state.cluster import ClusterCollector, RedisCluster
from crossbar.state.limits import LimitsCollector, RedisLimits
from crossbar.state.runtime import Runtime
from crossbar.upstream.tls import HostTLS
from crossbar.ops.systemd import Notifier, SystemdNotifier, watchdog_interval
from crossbar.upstream.pools import PollAgent, UpstreamEndpoints, UpstreamPools, poll_pool
from crossbar.waiting import Condition
from crossbar.process.listen import ListenService, listen_endpoint
from crossbar.proxy.web import CrossbarSite, Root

__all__ = ["CrossbarService", "ListenService", "make_service"]


def _inflight_series(runtime: Runtime) -> dict[tuple[str, str], int]:
    """(route, host) -> in flight, for the metrics: hosts a reload removed drop out once idle."""
    hosts = runtime.config.hosts
    return {key: n for key, n in runtime.inflight.by_route_host().items() if n or key[1] in hosts}


def _count_moves(metrics: Metrics) -> Callable[[str, str, str, str], None]:
    """What counts a model's load or unload (host, model, ``load``/``unload``, reason)
    in the metrics (docs/design.md §Where models live, rule 7)."""
    def count(host: str, model: str, action: str, reason: str) -> None:
        counter = metrics.model_loads if action == "load" else metrics.model_unloads
        counter.labels(host, model, reason).inc()
    return count


def _join_cluster(config: Config, reactor: Any, runtime: Runtime, metrics: Metrics,
                  on_change: Callable[[], None]) -> RedisCluster | None:
    """With ``cluster.redis`` (docs/design.md §Several crossbars): this process's
    :class:`~crossbar.state.cluster.RedisCluster`, joined by ``runtime`` (in-flight
    counts, key limits) and watched by ``metrics`` (its gauges are this process's link;
    its losses and slow checks are summed over workers); None without."""
    if config.cluster is None:
        return None
    cluster = RedisCluster(config.cluster.redis, reactor, on_change=on_change, tls=config.cluster.tls)
    runtime.own_counters[CLUSTER_LOST] = lambda: cluster.lost
    runtime.own_counters[CLUSTER_SLOW] = lambda: cluster.slow_checks.count
    runtime.join(cluster)
    runtime.limits.fleet = RedisLimits(cluster)
    RedisTokens(runtime.tokens, cluster, reactor.seconds)  # the fleet's token figures
    metrics.watch(FleetCounters(ClusterCollector(cluster), {
        "crossbar_cluster_lost": lambda: runtime.counter(CLUSTER_LOST),
        "crossbar_cluster_slow": lambda: runtime.counter(CLUSTER_SLOW),
    }))
    return cluster


def _both(first: Callable[[], None], second: Callable[[], None]) -> None:
    """One timer for the dashboard's entries and the token store (docs/design.md
    §Operations, §What the answers say)."""
    first()
    second()


class CrossbarService(MultiService):
    """The whole daemon: poller + web service around one :class:`Runtime`, with the
    drain as ``stopService``, SIGHUP reload and systemd notification.

    Attributes for tests and operations: :attr:`runtime` (config, table, in-flight
    counts), :attr:`poller`, :attr:`proxy`, :attr:`ops`, :attr:`site`, :attr:`web`,
    :attr:`pools`, :attr:`metrics`, :attr:`systemd` (None without ``$NOTIFY_SOCKET``).

    :param config: the validated config.
    :param reactor: the reactor.
    :param environ: where ``NOTIFY_SOCKET`` / ``WATCHDOG_USEC`` are read (default
        ``os.environ``).
    :param handle_signals: install the SIGHUP handler while running, and during a drain
        a SIGTERM/SIGINT handler that ends it at once (the twistd plugin does;
        in-process tests need not).
    :param listen: the server endpoint to listen on, instead of ``config.listen``'s (a
        worker adopts its supervisor's socket, :mod:`crossbar.process.worker`).
    :param worker_counts: with workers, the counts shared by every worker, which this
        worker publishes to and reads from (docs/design.md §Workers).
    """

    _log = Logger(namespace="crossbar")

    def __init__(
        self,
        config: Config,
        reactor: Any,
        environ: Mapping[str, str] | None = None,
        handle_signals: bool = True,
        listen: IStreamServerEndpoint | None = None,
        worker_counts: WorkerCounts | None = None,
    ) -> None:
        super().__init__()
        self.reactor = reactor
        self.runtime = runtime = Runtime(config, reactor.seconds)
        self._others_wake: LoopingCall | None = None
        if worker_counts is not None:
            runtime.attach(worker_counts)
            # Another worker's freed slot is seen here within this period (§Workers:
            # a waiting request goes within 20 ms of a slot freeing anywhere).
            self._others_wake = LoopingCall(self._wake_if_waiting)
            self._others_wake.clock = reactor
        self.metrics = Metrics()
        self.metrics.watch(LiveCollector(
            lambda: _inflight_series(runtime), runtime.table.all,
            lambda: {name: runtime.queued(name) for name in runtime.config.routes},
            lambda: {(r, o): runtime.affinity(r, o) for r in runtime.config.routes for o in AFFINITY_OUTCOMES},
            restarts=(lambda: runtime.counter(RESTARTS)) if worker_counts is not None else None,
            draining=lambda: runtime.drained,
        ))
        self.cluster = _join_cluster(config, reactor, runtime, self.metrics, self._cluster_changed)
        self.metrics.watch(LimitsCollector(runtime.limits))  # with workers: the box's spending
        self.requests = RequestLog(self.metrics, runtime.tokens)
        # The dashboard's recent requests: one append per request; with workers, every
        # worker's are read from its file in the workers' state directory.
        # With cluster.redis, every instance's: through Redis (crossbar.ops.fleet_recent).
        directory = os.path.dirname(worker_counts.shared.path) if worker_counts is not None else None
        row = worker_counts.shared.row if worker_counts is not None else 0
        self.recent: RecentRequests = (
            RecentRequests(reactor.seconds, directory, row) if self.cluster is None
            else FleetRecent(reactor.seconds, self.cluster, directory, row))
        self.requests.observers.append(self.recent.observe)
        self._recent_tick = LoopingCall(_both, self.recent.tick, runtime.tokens.tick)
        self._recent_tick.clock = reactor
        tls = HostTLS.from_config(config)
        self.pools = UpstreamPools(reactor, config.timeouts.connect, tls=tls)
        self._poll_pool = poll_pool(reactor)
        health = config.health
        self.poller = HealthPoller(
            runtime.table, {name: h.url for name, h in config.hosts.items()}, self._probe(health.timeout, config, tls),
            health.interval, health.timeout, reactor, on_poll=self._observe_poll,
            wants_slots=lambda name: (host := runtime.config.hosts.get(name)) is not None and host.max_inflight_slots,
        )
        self.poller.setServiceParent(self)
        # docs/design.md §Where models live: loads and unloads on router-mode hosts.
        self.placer = Placer(runtime, HTTPModelCommands(self.pools), reactor)
        runtime.placement.on_move = _count_moves(self.metrics)
        self.placer.on_failure = lambda host, action, failure: self.metrics.model_command_failures.labels(
            host, action, failure).inc()
        runtime.placement.on_loaded = lambda host, model, seconds: self.metrics.model_load_seconds.labels(
            host, model).observe(seconds)
        self.proxy = ProxyResource(runtime, self.pools, reactor, self.requests)
        self.ops = OpsApp(runtime, self.metrics, self.recent, reactor)
        self.site = CrossbarSite(Root(self.ops.resource(), self.proxy), runtime, self.requests)
        self.web = ListenService(listen if listen is not None else listen_endpoint(reactor, config), self.site)
        self.web.setServiceParent(self)
        self.systemd: SystemdNotifier | None = None
        notifier = Notifier.from_environment(environ)
        if notifier is not None:
            self.systemd = SystemdNotifier(
                notifier, reactor, ready=self._when_ready,
                healthy=lambda: {name: s.healthy for name, s in runtime.table.all().items()},
                watchdog=watchdog_interval(environ),
            )
            self.systemd.setServiceParent(self)
        self._handle_signals = handle_signals
        if handle_signals:
            SIGHUPReload(self.reload, reactor).setServiceParent(self)
        self._drain: Deferred[None] | None = None
        self._drained = False
        self._drain_over = Condition(lambda: self._drained)
        self._drain_step: Deferred[Any] | None = None
        self._hurried = False

    @property
    def config(self) -> Config:
        """The current config (``runtime.config``)."""
        return self.runtime.config

    @property
    def table(self) -> HealthTable:
        """The health table (``runtime.table``)."""
        return self.runtime.table

    def _probe(self, timeout: float, config: Config, tls: HostTLS) -> HTTPProbe:
        """The poller's probe for ``config``'s hosts: ``timeout`` bounds opening a
        connection to a host, ``tls`` is how https hosts are checked."""
        endpoints = UpstreamEndpoints(self.reactor, timeout, tls)
        api_keys = {h.url.url: h.api_key for h in config.hosts.values() if h.api_key is not None}
        return HTTPProbe(PollAgent(endpoints, self._poll_pool), api_keys)

    def _cluster_changed(self) -> None:
        """The cluster's view changed (another instance's counts, or Redis lost or
        back): publish this worker's losses to the fleet, and wake the queues."""
        self.runtime.publish_counters()
        self.runtime.others_changed()

    def _wake_if_waiting(self) -> None:
        if len(self.runtime.queues):
            self.runtime.queues.wake()

    def when_ready(self) -> Deferred[object]:
        """Fires once listening and every host's first poll is done."""
        return self._when_ready()

    def _when_ready(self) -> Deferred[object]:
        both: list[Deferred[Any]] = [self.web.when_listening(), self.poller.when_first_round_done()]
        return gatherResults(both)  # type: ignore[return-value]

    def _observe_poll(self, host: str, seconds: float, ok: bool) -> None:
        self.metrics.poll_duration.labels(host, "ok" if ok else "failed").observe(seconds)
        self.placer.polled(host, seconds, ok)  # settles loads before a waiting request looks
        self.runtime.queues.wake()  # a host that came back, or a model now loaded
        if self.systemd is not None:
            self.systemd.health_changed()

    def startService(self) -> None:
        super().startService()
        if self._others_wake is not None:
            self._others_wake.start(WORKERS_WAKE_INTERVAL, now=False)
        self._recent_tick.start(TICK, now=False)
        self.placer.start()
        if self.cluster is not None:
            self.cluster.start()
        # Everything loaded so far (Twisted, TLS support, klein, prometheus_client: most of
        # the heap) lives as long as the process: keep the cyclic GC from scanning it
        # again on every full collection, which stalled requests for tens of ms.
        gc.freeze()

    def stopService(self) -> Deferred[Any]:
        """Drain (see :meth:`drain`), then stop the poller and the listener and close
        upstream connections. ``twistd`` waits for the returned Deferred on SIGTERM."""
        return ensureDeferred(self._stop())

    async def _stop(self) -> None:
        await self.drain()
        if self._others_wake is not None and self._others_wake.running:
            self._others_wake.stop()
        if self._recent_tick.running:
            self._recent_tick.stop()
        self.placer.stop()
        if self.cluster is not None:
            await self.cluster.stop()
        try:
            await super().stopService()
        finally:
            if self.systemd is not None:
                self.systemd.notifier.close()
            await DeferredList([self.pools.close(), self._poll_pool.close()])

    def drain(self) -> Deferred[None]:
        """Drain (docs/design.md §Operations): readiness 503 at once, keep serving for
        ``drain.delay`` s, stop accepting, give in-flight requests ``drain.grace`` s,
        then abort what is left. Calling it again returns the drain under way; the
        Deferred never fails."""
        if self._drain is None:
            self._drain = ensureDeferred(self._run_drain())
            self._drain.addErrback(lambda f: self._log.failure("drain failed", failure=f))
            self._drain.addBoth(self._drain_done)
        return self._drain_over.wait()

    def _drain_done(self, _: object) -> None:
        self._drained = True
        self._drain_over.check()

    def hurry(self) -> None:
        """End a drain at once (a second SIGTERM or Ctrl-C): stop waiting, abort what is
        still in flight, and let the shutdown go on."""
        if self._drain is None or self._drained or self._hurried:
            return
        self._hurried = True
        self._log.warn("second stop signal: ending the drain now, aborting {count} requests in flight",
                       count=len(self.runtime.active))
        step, self._drain_step = self._drain_step, None
        if step is not None:
            step.cancel()

    async def _wait_step(self, step: Deferred[Any]) -> None:
        """Wait for one drain phase, unless :meth:`hurry` cancels it."""
        if self._hurried:
            step.cancel()
        self._drain_step = step
        try:
            await step
        except (CancelledError, TimeoutError):
            pass
        finally:
            self._drain_step = None

    async def _run_drain(self) -> None:
        runtime = self.runtime
        runtime.draining = True
        self._catch_second_signal()
        if self.systemd is not None:
            self.systemd.draining()
        delay, grace = runtime.config.drain.delay, runtime.config.drain.grace
        self._log.info(
            "draining: readiness is 503; accepting for {delay}s more, then {grace}s for "
            "{count} in-flight requests", delay=delay, grace=grace, count=len(runtime.active),
        )
        await self._wait_step(deferLater(self.reactor, delay))
        if self.web.running:
            stopped = self.web.stopService()
            if stopped is not None:
                await stopped
        idle = self.site.stop_keep_alive()  # keep-alive clients reconnect elsewhere
        self._log.info(
            "stopped accepting, closed {idle} idle connections; requests in flight: {count}",
            idle=idle, count=len(runtime.active),
        )
        await self._wait_step(self.proxy.when_idle().addTimeout(grace, self.reactor))
        if runtime.active:
            if not self._hurried:
                self._log.warn("drain grace over: aborting requests still in flight: {count}",
                               count=len(runtime.active))
            self.proxy.abort_all()
        self._log.info("drained")

    def _catch_second_signal(self) -> None:
        if self._handle_signals:
            catch_second_stop_signal(self.reactor, self.hurry)

    def reload(self, text: str | None = None, said: bool = False) -> bool:
        """Re-read and validate the config file (SIGHUP, docs/design.md §Operations); with
        ``text``, validate that instead (a worker: the text its supervisor validated and
        warned about, ``said``: its warnings are not said again).

        An invalid file is logged and the running config kept (returns False). A valid
        one is swapped in with one assignment (returns True). In-flight requests finish
        on the config they started with; hosts whose URL did not change keep their
        health; new hosts are polled at once (and readiness waits for their first
        poll). ``listen`` cannot change without a restart: that is logged and the old
        listener kept.
        """
        old = self.runtime.config
        path = old.source
        new = next_config(old, self.reactor, self._log, text=text, said=said)
        if new is None:
            return False
        plan = plan_reload(old, new)
        # Everything that can still fail, before anything changes: a reload applies
        # whole or not at all.
        try:
            tls = HostTLS.from_config(new)
            probe = self._probe(new.health.timeout, new, tls)
        except Exception as e:
            self._log.error(REFUSED, error=f"{type(e).__name__}: {e}")
            return False
        # Each part takes from the new config what it keeps (its own reconfigure), in the
        # order requests see them: health, connections, the config itself, polls.
        self.runtime.table.reconfigure(new, plan.fresh)
        self.pools.reconfigure(new, tls, plan.fresh)
        self.runtime.reconfigure(new)
        self.runtime.placement.forget(h for h in new.hosts if h not in plan.fresh)  # §Where models live
        self.placer.start()  # its ticks run while some route has placement
        if plan.fresh:
            # A kept-alive poll connection was opened under the old settings (a CA that no
            # longer holds would go on passing): new and changed hosts are polled anew.
            self._poll_pool.close()
        self.poller.reconfigure(new, probe, plan.fresh)
        if self.systemd is not None:
            self.systemd.health_changed()
        self.runtime.queues.wake()  # new hosts, weights or limits may make room
        self._log.info(
            "reloaded {path}: {routes} routes, {hosts} hosts ({summary})",
            path=path, routes=len(new.routes), hosts=len(new.hosts), summary=plan.summary(),
        )
        return True


WORKERS_WAKE_INTERVAL = 0.01
"""Seconds between a worker's looks at the other workers' counts while requests wait."""


def make_service(
    config: Config, reactor: Any = None, environ: Mapping[str, str] | None = None, handle_signals: bool = False
) -> CrossbarService:
    """Build the crossbar service for ``config`` on ``reactor`` (default: the global one).

    ``environ`` and ``handle_signals``: see :class:`CrossbarService` (the twistd plugin
    passes ``handle_signals=True``).

    :raises ConfigError: when ``listen`` is not a valid Twisted endpoint string.
    """
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
    return CrossbarService(config, reactor, environ=environ, handle_signals=handle_signals)
