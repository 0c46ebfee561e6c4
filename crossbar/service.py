"""Assemble crossbar from a :class:`~crossbar.config.Config` (DESIGN.md §Shape).

:func:`make_service` builds one ``MultiService``: the health poller and the web service
(a ``Site`` on the ``listen`` endpoint whose root sends ``/_crossbar/...`` to the ops app
and everything else to the proxy). On shutdown it drains (DESIGN.md §Operations).
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IStreamServerEndpoint
from twisted.python.failure import Failure
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.client import Agent
from twisted.web.resource import IResource, Resource
from twisted.web.server import Request, Site

from crossbar.config import Config, ConfigError
from crossbar.health import HealthTable
from crossbar.metrics import Metrics
from crossbar.ops import OpsApp
from crossbar.poller import HealthPoller, HTTPProbe
from crossbar.proxy import ProxyResource
from crossbar.request import CappedRequest
from crossbar.upstream import UpstreamPools, quiet_pool

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

    def log(self, request: Request) -> None:
        pass


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

    def startService(self) -> None:
        super().startService()
        d = self.endpoint.listen(self.factory)
        self._listening = d
        failures: list[Failure] = []
        d.addCallbacks(self._listened, failures.append)
        if failures:
            failures[0].raiseException()

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
        port, self.port = self.port, None
        if port is not None:
            return port.stopListening()
        return None


class CrossbarService(MultiService):
    """The whole daemon: poller + web service, with drain on shutdown.

    Attributes exposed for tests and operations: :attr:`config`, :attr:`table`,
    :attr:`poller`, :attr:`proxy`, :attr:`ops`, :attr:`site`, :attr:`web`.
    """

    _log = Logger(namespace="crossbar")

    def __init__(self, config: Config, reactor: Any) -> None:
        super().__init__()
        self.config = config
        self.reactor = reactor
        self.metrics = Metrics()
        health = config.health
        self.table = HealthTable(config.hosts, health.recovery_polls, health.failure_threshold, reactor.seconds)
        poll_pool = quiet_pool(reactor, persistent=True)
        poll_pool.maxPersistentPerHost = 1
        self._poll_pool = poll_pool
        probe = HTTPProbe(Agent(reactor, pool=poll_pool, connectTimeout=health.timeout))
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
        self.ops = OpsApp(
            table=lambda: self.table,
            urls=lambda: {name: h.url for name, h in self.config.hosts.items()},
            inflight=self.proxy.inflight,
            token=lambda: self.config.ops.token,
            first_round_done=lambda: self.poller.first_round_done,
            metrics=self.metrics,
        )
        self.site = _Site(_Root(self.ops.resource(), self.proxy), requestFactory=CappedRequest)
        try:
            endpoint = serverFromString(reactor, config.listen)
        except (ValueError, KeyError, TypeError, ImportError) as e:
            raise ConfigError(config.source, "listen", f"not a valid Twisted endpoint: {e}") from None
        self.web = ListenService(endpoint, self.site)
        self.web.setServiceParent(self)
        self._drain_trigger: Any = None

    def _observe_poll(self, host: str, seconds: float, ok: bool) -> None:
        self.metrics.poll_duration.labels(host, "ok" if ok else "failed").observe(seconds)

    def startService(self) -> None:
        super().startService()
        self._drain_trigger = self.reactor.addSystemEventTrigger("before", "shutdown", self.drain)

    def stopService(self) -> Deferred[Any]:
        if self._drain_trigger is not None:
            try:
                self.reactor.removeSystemEventTrigger(self._drain_trigger)
            except (ValueError, KeyError):
                pass
            self._drain_trigger = None
        d = super().stopService()
        d.addBoth(lambda r: DeferredList([self.pools.close(), self._poll_pool.closeCachedConnections()]))
        return d

    def drain(self) -> Deferred[None]:
        """Drain (DESIGN.md §Operations): readiness 503 at once, keep serving for
        ``drain.delay`` s, stop accepting, give in-flight requests ``drain.grace`` s,
        then abort what is left."""
        return ensureDeferred(self._drain())

    async def _drain(self) -> None:
        if self.ops.draining:
            return
        self.ops.draining = True
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
        waited = 0.0
        step = 0.05
        while self.proxy.active and waited < grace:
            await deferLater(self.reactor, step)
            waited += step
        if self.proxy.active:
            self._log.warn("drain grace over: aborting {count} requests", count=len(self.proxy.active))
            self.proxy.abort_all()
        self._log.info("drained")


def make_service(config: Config, reactor: Any = None) -> CrossbarService:
    """Build the crossbar service for ``config`` on ``reactor`` (default: the global one).

    :raises ConfigError: when ``listen`` is not a valid Twisted endpoint string.
    """
    if reactor is None:
        from twisted.internet import reactor as global_reactor

        reactor = global_reactor
    return CrossbarService(config, reactor)
