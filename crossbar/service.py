"""Assemble crossbar from a :class:`~crossbar.config.Config` (DESIGN.md §Shape).

:func:`make_service` builds one ``MultiService``: the health poller and the web service
(a ``Site`` on the ``listen`` endpoint whose root sends ``/_crossbar/...`` to the ops app
and everything else to the proxy). On shutdown it drains (DESIGN.md §Operations).
"""

from __future__ import annotations

import gc
from dataclasses import replace
from typing import Any, Mapping

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred, gatherResults
from twisted.internet.endpoints import serverFromString
from twisted.internet.defer import TimeoutError
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from twisted.python.failure import Failure
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.client import Agent
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request, Site

from crossbar.channel import HeadDeadlineChannel
from crossbar.config import Config, ConfigError, load_config
from crossbar.health import HealthTable
from crossbar.metrics import Metrics
from crossbar.ops import OpsApp
from crossbar.poller import HealthPoller, HTTPProbe
from crossbar.proxy import ProxyResource
from crossbar.reload import SIGHUPReload, plan_reload
from crossbar.request import CappedRequest
from crossbar.systemd import Notifier, SystemdNotifier, watchdog_interval
from crossbar.upstream import UpstreamEndpoints, UpstreamPools, quiet_pool

__all__ = ["CrossbarService", "ListenService", "make_service"]


class _Root(Resource):
    """``/_crossbar/...`` goes to the ops app, every other path to the proxy."""

    def __init__(self, ops: IResource, proxy: IResource) -> None:
        super().__init__()
        self._ops = ops
        self._proxy = proxy

    def getChildWithDefault(self, path: bytes, request: Request) -> IResource:
        if path == b"_crossbar":
            return self._ops
        return self._proxy


class _Site(Site):
    """A Site without Twisted's access log: the proxy writes its own line (rule 8)."""

    displayTracebacks = False
    noisy = False
    protocol = HeadDeadlineChannel  # type: ignore[assignment]  # HTTP/1.1 only: no HTTP/2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open_channels: set[HeadDeadlineChannel] = set()
        """Client connections now open (each channel adds and removes itself)."""

    def log(self, request: Any) -> None:
        pass

    def stop_keep_alive(self) -> int:
        """Close every client connection with no request on it, and every other one
        right after its answer; returns how many were closed at once."""
        return sum(1 for channel in list(self.open_channels) if channel.close_when_idle())


class ListenService(Service):
    """Listens on ``endpoint`` while running; :attr:`port` is the listening port.

    A listen that fails at once (address in use, bad interface) raises from
    ``startService``, so ``twistd`` stops at start-up instead of running deaf.
    """

    _log = Logger(namespace="crossbar")

    def __init__(self, endpoint: IStreamServerEndpoint, factory: IProtocolFactory) -> None:
        self.endpoint = endpoint
        self.factory = factory
        self.port: IListeningPort | None = None
        self._listening: Deferred[IListeningPort] | None = None

    def privilegedStartService(self) -> None:
        """Listen before twistd drops privileges (``--uid``), so ports below 1024 work."""
        super().privilegedStartService()
        self._listen()

    def startService(self) -> None:
        super().startService()
        if self._listening is None:  # started without privilegedStartService (tests)
            self._listen()

    def _listen(self) -> None:
        try:
            d = self.endpoint.listen(self.factory)
        except Exception as e:  # e.g. OverflowError for a port over 65535
            raise CannotListenError(None, None, e) from None
        self._listening = d
        d.addCallback(self._listened)
        if d.called:  # TCP, UNIX, systemd: listening (or not) at once
            failures: list[Failure] = []
            d.addErrback(failures.append)
            if failures:
                error = failures[0].value
                if isinstance(error, CannotListenError):
                    raise error
                raise CannotListenError(None, None, error)  # e.g. a unix socket's lock file
        else:
            d.addErrback(self._listen_failed)

    def _listen_failed(self, failure: Failure) -> None:
        """A listen that failed later (e.g. a slow endpoint): running deaf helps nobody."""
        self._log.failure("cannot listen; stopping", failure=failure)
        from twisted.internet import reactor

        reactor.stop()

    def _listened(self, port: IListeningPort) -> IListeningPort:
        self.port = port
        host = port.getHost()
        self._log.info("listening on {address}", address=f"{getattr(host, 'host', host)}:{getattr(host, 'port', '')}")
        return port

    def when_listening(self) -> Deferred[IListeningPort]:
        """Fires with the listening port once listening."""
        assert self._listening is not None, "not started"
        d: Deferred[IListeningPort] = Deferred()

        def fire(port: IListeningPort) -> IListeningPort:
            d.callback(port)
            return port

        if self.port is not None:
            d.callback(self.port)
        else:
            self._listening.addCallback(fire)
        return d

    def stopService(self) -> Deferred[None] | None:
        super().stopService()
        self._listening = None
        port, self.port = self.port, None
        if port is not None:
            return port.stopListening()
        return None


class _Request(CappedRequest):
    """Says no ``Server: TwistedWeb/x.y``: crossbar's answers reveal no version."""

    def render(self, resrc: IResource) -> None:
        self.responseHeaders.removeHeader(b"server")
        super().render(resrc)


class CrossbarService(MultiService):
    """The whole daemon: poller + web service, with drain on shutdown, SIGHUP reload
    and systemd notification (DESIGN.md §Operations).

    Attributes exposed for tests and operations: :attr:`config`, :attr:`table`,
    :attr:`poller`, :attr:`proxy`, :attr:`ops`, :attr:`site`, :attr:`web`,
    :attr:`systemd` (None without ``$NOTIFY_SOCKET``).

    :param environ: where ``NOTIFY_SOCKET`` / ``WATCHDOG_USEC`` are read (default
        ``os.environ``).
    :param handle_sighup: install the SIGHUP handler while running (the twistd plugin
        does; in-process tests need not).
    """

    _log = Logger(namespace="crossbar")

    def __init__(
        self,
        config: Config,
        reactor: Any,
        environ: Mapping[str, str] | None = None,
        handle_sighup: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.reactor = reactor
        self.metrics = Metrics()
        health = config.health
        self.table = HealthTable(config.hosts, health.recovery_polls, health.failure_threshold, reactor.seconds)
        poll_pool = quiet_pool(reactor, persistent=True)
        poll_pool.maxPersistentPerHost = 1
        self._poll_pool = poll_pool
        probe = self._probe(health.timeout)
        self.poller = HealthPoller(
            self.table,
            {name: h.url for name, h in config.hosts.items()},
            probe,
            health.interval,
            health.timeout,
            reactor,
            on_poll=self._observe_poll,
        )
        self.poller.setServiceParent(self)
        self.pools = UpstreamPools(reactor, config.timeouts.connect)
        self.proxy = ProxyResource(config, self.table, self.pools, reactor, self.metrics)
        self._first_round_seen = False
        self.ops = OpsApp(
            table=lambda: self.table,
            urls=lambda: {name: h.url for name, h in self.config.hosts.items()},
            inflight=self.proxy.inflight,
            token=lambda: self.config.ops.token,
            first_round_done=self.first_round_done,
            metrics=self.metrics,
        )
        # A proxy never parses form bodies (Twisted would, for every POST: costly, and
        # a malformed multipart upload must still be forwarded as it is).
        self.site = _Site(
            _Root(self.ops.resource(), self.proxy), requestFactory=_Request, parsePOSTFormSubmission=False
        )
        try:
            endpoint = serverFromString(reactor, config.listen)
        except IndexError:
            if config.listen.startswith("systemd:"):
                raise ConfigError(
                    config.source, "listen",
                    "systemd passed no such socket (start crossbar through its .socket unit)",
                ) from None
            raise ConfigError(config.source, "listen", "not a valid Twisted endpoint") from None
        except Exception as e:  # parsing may also load files (ssl: keys) or plugins
            why = getattr(e, "strerror", None) or str(e) or type(e).__name__
            raise ConfigError(config.source, "listen", f"not a valid Twisted endpoint: {why}") from None
        self.web = ListenService(endpoint, self.site)
        self.web.setServiceParent(self)
        self.systemd: SystemdNotifier | None = None
        notifier = Notifier.from_environment(environ)
        if notifier is not None:
            self.systemd = SystemdNotifier(
                notifier,
                reactor,
                ready=self._when_ready,
                healthy=lambda: {name: s.healthy for name, s in self.table.all().items()},
                watchdog=watchdog_interval(environ),
            )
            self.systemd.setServiceParent(self)
        if handle_sighup:
            SIGHUPReload(self.reload, reactor).setServiceParent(self)
        self._drain_trigger: Any = None
        self._drain: Deferred[None] | None = None
        self._drained = False
        self._drain_waiters: list[Deferred[None]] = []

    def _probe(self, timeout: float) -> HTTPProbe:
        """The poller's probe: ``timeout`` bounds opening a connection to a host."""
        endpoints = UpstreamEndpoints(self.reactor, timeout)
        return HTTPProbe(Agent.usingEndpointFactory(self.reactor, endpoints, pool=self._poll_pool))

    def first_round_done(self) -> bool:
        """Every host's first poll has finished; once true it stays true (a reload that
        adds a host does not make a ready crossbar unready)."""
        if not self._first_round_seen and self.poller.first_round_done:
            self._first_round_seen = True
        return self._first_round_seen

    def _when_ready(self) -> Deferred[object]:
        both: list[Deferred[Any]] = [self.web.when_listening(), self.poller.when_first_round_done()]
        return gatherResults(both)  # type: ignore[return-value]

    def _observe_poll(self, host: str, seconds: float, ok: bool) -> None:
        self.metrics.poll_duration.labels(host, "ok" if ok else "failed").observe(seconds)
        if self.systemd is not None:
            self.systemd.health_changed()

    def startService(self) -> None:
        super().startService()
        self._drain_trigger = self.reactor.addSystemEventTrigger("before", "shutdown", self.drain)
        # Everything loaded so far (Twisted, TLS support, klein, prometheus_client: most of
        # the heap) lives as long as the process: keep the cyclic GC from scanning it
        # again on every full collection, which stalled requests for tens of ms.
        gc.freeze()

    def stopService(self) -> Deferred[Any]:
        """Stop everything. When a drain is under way (SIGTERM: twistd calls this and
        :meth:`drain` from the same "before shutdown" phase), wait for it first, so the
        listener and the in-flight requests get their ``drain.delay`` and ``drain.grace``."""
        if self._drain_trigger is not None:
            try:
                self.reactor.removeSystemEventTrigger(self._drain_trigger)
            except (ValueError, KeyError):
                pass
            self._drain_trigger = None
        return ensureDeferred(self._stop())

    async def _stop(self) -> None:
        if self._drain is not None and not self._drained:
            waiter: Deferred[None] = Deferred()
            self._drain_waiters.append(waiter)
            await waiter
        try:
            await super().stopService()
        finally:
            if self.systemd is not None:
                self.systemd.notifier.close()
            await DeferredList([self.pools.close(), self._poll_pool.closeCachedConnections()])

    def drain(self) -> Deferred[None]:
        """Drain (DESIGN.md §Operations): readiness 503 at once, keep serving for
        ``drain.delay`` s, stop accepting, give in-flight requests ``drain.grace`` s,
        then abort what is left. Calling it again returns the drain under way."""
        if self._drain is None:
            self._drain = ensureDeferred(self._run_drain())
            self._drain.addBoth(self._drain_over)
        d: Deferred[None] = Deferred()
        if self._drained:
            d.callback(None)
        else:
            self._drain_waiters.append(d)
        return d

    def _drain_over(self, result: object) -> None:
        self._drained = True
        if isinstance(result, Failure):
            self._log.failure("drain failed", failure=result)
        waiters, self._drain_waiters = self._drain_waiters, []
        for w in waiters:
            w.callback(None)

    async def _run_drain(self) -> None:
        self.ops.draining = True
        self.proxy.draining = True
        if self.systemd is not None:
            self.systemd.draining()
        delay, grace = self.config.drain.delay, self.config.drain.grace
        self._log.info(
            "draining: readiness is 503; accepting for {delay}s more, then {grace}s for "
            "{count} in-flight requests", delay=delay, grace=grace, count=len(self.proxy.active),
        )
        await deferLater(self.reactor, delay)
        if self.web.running:
            stopped = self.web.stopService()
            if stopped is not None:
                await stopped
        idle = self.site.stop_keep_alive()  # keep-alive clients reconnect elsewhere
        self._log.info(
            "stopped accepting, closed {idle} idle connections; requests in flight: {count}",
            idle=idle, count=len(self.proxy.active),
        )
        finished = self.proxy.when_idle()
        finished.addTimeout(grace, self.reactor)
        try:
            await finished
        except TimeoutError:
            pass  # the grace is over
        if self.proxy.active:
            self._log.warn(
                "drain grace over: aborting requests still in flight: {count}", count=len(self.proxy.active)
            )
            self.proxy.abort_all()
        self._log.info("drained")

    def reload(self) -> bool:
        """Re-read and validate the config file (SIGHUP, DESIGN.md §Operations).

        An invalid file is logged and the running config kept (returns False). A valid
        one is swapped in (returns True): routes, hosts, health settings, timeouts,
        drain and the ops token. In-flight requests finish on the config they started
        with; hosts whose URL did not change keep their health; new hosts are polled at
        once. ``listen`` cannot change without a restart: that is logged and the old
        listener kept.
        """
        path = self.config.source
        try:
            new = load_config(path)
        except ConfigError as e:
            self._log.error("reload refused, keeping the running config: {error}", error=str(e))
            return False
        old = self.config
        plan = plan_reload(old, new)
        if plan.listen_changed:
            self._log.warn(
                "reload: listen changed from {old} to {new}; a restart is needed to apply it",
                old=old.listen, new=new.listen,
            )
            new = replace(new, listen=old.listen)
        health = new.health
        self.table.recovery_polls = health.recovery_polls
        self.table.failure_threshold = health.failure_threshold
        self.table.set_hosts(new.hosts, reset=plan.fresh)
        for name in plan.removed + plan.fresh:
            for gauge in (self.metrics.host_healthy, self.metrics.models_loaded):
                try:
                    gauge.remove(name)
                except KeyError:
                    pass
        self.poller.probe = self._probe(health.timeout)
        self.pools.connect_timeout = new.timeouts.connect
        self.config = new
        self.proxy.config = new
        self.poller.set_timing(health.interval, health.timeout)
        self.poller.set_hosts({name: h.url for name, h in new.hosts.items()})
        if self.systemd is not None:
            self.systemd.health_changed()
        self._log.info(
            "reloaded {path}: {routes} routes, {hosts} hosts ({fresh} new or changed, {removed} removed)",
            path=path, routes=len(new.routes), hosts=len(new.hosts), fresh=len(plan.fresh),
            removed=len(plan.removed),
        )
        return True


def make_service(
    config: Config, reactor: Any = None, environ: Mapping[str, str] | None = None, handle_sighup: bool = False
) -> CrossbarService:
    """Build the crossbar service for ``config`` on ``reactor`` (default: the global one).

    ``environ`` and ``handle_sighup``: see :class:`CrossbarService` (the twistd plugin
    passes ``handle_sighup=True``).

    :raises ConfigError: when ``listen`` is not a valid Twisted endpoint string.
    """
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
    return CrossbarService(config, reactor, environ=environ, handle_sighup=handle_sighup)
