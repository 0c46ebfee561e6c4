"""Connections to upstream hosts for the proxy path (docs/design.md §The proxy, rules 6-7).

The proxy needs to know, for a request that failed, whether crossbar could not *open* a
connection to the host (fail over to the next host) or whether a *reused* pooled
connection turned out dead (retry once on a fresh connection, mark nothing down).
An agent does not say; :class:`ConnectTracker` learns it from the public
``IAgentEndpointFactory`` seam: ``connect()`` is only called for a new connection.
Requests and polls go through one HTTP/1.1 client, crossbar's own
(:mod:`crossbar.upstream.h1client`): the same head limits, ``101``
refusal, framing rules and TLS for both (docs/design.md §Configuration: every host URL works
for polls and requests alike). :class:`PollAgent` is the poller's.
"""

from __future__ import annotations

from typing import Any, Iterable

from twisted.internet.defer import Deferred, fail
from twisted.web.client import RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived  # type: ignore[attr-defined]  # re-exported by twisted.web.client
from twisted.web.http_headers import Headers
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.interfaces import IProtocolFactory, IReactorTime, IStreamClientEndpoint
from twisted.python.failure import Failure
from twisted.web.client import URI
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IBodyProducer, IPolicyForHTTPS, IResponse
from zope.interface import implementer

from crossbar.config import Config
from crossbar.upstream.h1answer import MAX_RESPONSE_HEAD, ResponseHeadTooLarge
from crossbar.upstream.h1client import H1Agent, H1Pool
from crossbar.upstream.tls import HandshakeFirstEndpoint, HostTLS

__all__ = [
    "MAX_RESPONSE_HEAD", "ConnectTracker", "PollAgent", "ResponseHeadTooLarge", "UpstreamEndpoints", "UpstreamPools",
    "poll_pool",
]

_ATTEMPT_DELAY = 0.05
"""Seconds between connection attempts to a name's successive addresses."""


@implementer(IStreamClientEndpoint)
class _TrackedEndpoint:
    def __init__(self, wrapped: IStreamClientEndpoint, tracker: ConnectTracker) -> None:
        self._wrapped = wrapped
        self._tracker = tracker

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        tracker = self._tracker
        tracker.connects += 1
        d = self._wrapped.connect(protocolFactory)

        def connected(protocol: Any) -> Any:
            if tracker.clock is not None:
                tracker.connected_at = tracker.clock.seconds()
            return protocol

        def failed(f: Failure) -> Failure:
            tracker.connect_failure = f
            return f

        d.addCallbacks(connected, failed)
        return d


@implementer(IAgentEndpointFactory)
class UpstreamEndpoints:
    """How crossbar connects to a host URL (the proxy's and the poller's agents).

    An IP literal gets a plain TCP endpoint: no name resolution (which Twisted does with
    ``getaddrinfo`` on its thread pool) and a refused connection is known at once. A
    name goes through ``HostnameEndpoint``. ``https`` wraps either in TLS that
    completes its handshake before the connection counts as open
    (:class:`crossbar.upstream.tls.HandshakeFirstEndpoint`, within ``connect_timeout`` more
    seconds): a refused certificate is a connect failure with a short reason
    (:func:`crossbar.upstream.tls.tls_failure_reason`), docs/design.md §Access and rule 7.

    :param reactor: the reactor.
    :param connect_timeout: seconds to open a connection (and again for the handshake).
    :param tls: the TLS policy per host for ``https`` hosts, e.g.
        ``crossbar.upstream.tls.HostTLS.from_config(config)``; default: ``HostTLS({})``
        (every host verified against the system trust store, name checked).
    """

    def __init__(self, reactor: Any, connect_timeout: float, tls: IPolicyForHTTPS | None = None) -> None:
        self._reactor = reactor
        self._timeout = connect_timeout
        self._tls: IPolicyForHTTPS = tls if tls is not None else HostTLS({})

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        host = uri.host.decode("ascii")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        endpoint: IStreamClientEndpoint
        if isIPAddress(host):
            endpoint = TCP4ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        elif isIPv6Address(host):
            endpoint = TCP6ClientEndpoint(self._reactor, host, uri.port, timeout=self._timeout)
        else:
            # HostnameEndpoint waits attemptDelay (0.3 s by default) for further
            # addresses even after the last attempt was refused: keep failover quick.
            endpoint = HostnameEndpoint(
                self._reactor, host, uri.port, timeout=self._timeout, attemptDelay=_ATTEMPT_DELAY
            )
        if uri.scheme == b"https":
            creator = self._tls.creatorForNetloc(uri.host, uri.port)
            endpoint = HandshakeFirstEndpoint(creator, endpoint, self._reactor, self._timeout)
        return endpoint


@implementer(IAgentEndpointFactory)
class ConnectTracker:
    """An endpoint factory for one proxied request that records its connection attempts.

    :ivar connects: new connections opened (0 means a pooled connection was reused).
    :ivar connect_failure: the failure of the last connection attempt, if it failed.
    :ivar connected_at: reactor seconds when a new connection was opened (the request
        is written on it at once), or None (none opened, or no ``clock`` given).
    """

    def __init__(self, endpoints: UpstreamEndpoints, clock: IReactorTime | None = None) -> None:
        self._endpoints = endpoints
        self.clock = clock
        self.connects = 0
        self.connect_failure: Failure | None = None
        self.connected_at: float | None = None

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        return _TrackedEndpoint(self._endpoints.endpointForURI(uri), self)


class UpstreamPools:
    """The proxy's connection pool: one persistent :class:`crossbar.upstream.h1client.H1Pool`
    shared by all requests (a retry after a stale connection opens a fresh one outside it).

    :param reactor: the reactor.
    :param connect_timeout: seconds to open a connection (``timeouts.connect``).
    :param max_per_host: idle persistent connections kept per host.
    :param idle_seconds: how long an idle pooled connection is kept.
    :param tls: the TLS policy per host (see :class:`UpstreamEndpoints`).
    :ivar tls: that policy; assign a new one on reload (the next connection uses it;
        close the pooled connections of hosts whose ``tls`` changed).
    :ivar pool: the idle connections (``max_per_host`` and ``idle_seconds`` are its
        attributes).
    """

    def __init__(
        self, reactor: IReactorTime, connect_timeout: float, max_per_host: int = 64, idle_seconds: float = 60.0,
        tls: IPolicyForHTTPS | None = None,
    ) -> None:
        self._reactor = reactor
        self.connect_timeout = connect_timeout
        self.tls: IPolicyForHTTPS = tls if tls is not None else HostTLS({})
        # crossbar's own HTTP/1.1 client (crossbar/upstream/h1client.py); a stale
        # pooled connection is retried by the proxy itself (any method), once.
        self.pool = H1Pool(reactor, max_per_host, idle_seconds)

    def agent(self, fresh: bool = False) -> tuple[H1Agent, ConnectTracker]:
        """An agent for one attempt (:class:`crossbar.upstream.h1client.H1Agent`) and the
        tracker of its connections.

        ``fresh=True`` never reuses a pooled connection (the retry after a stale one):
        a new connection, sent ``Connection: close``.
        """
        tracker = ConnectTracker(UpstreamEndpoints(self._reactor, self.connect_timeout, self.tls), self._reactor)
        return H1Agent(tracker, None if fresh else self.pool), tracker

    def close(self) -> Deferred[Any]:
        """Close every idle pooled connection; fires once they are closed."""
        return self.pool.close()

    def reconfigure(self, config: Config, tls: IPolicyForHTTPS, fresh: Iterable[str] = ()) -> None:
        """A reload (docs/design.md §Operations): the new ``tls`` policy (built from
        ``config`` beforehand: building it may fail, applying it may not) and
        ``timeouts.connect``; when an ``https://`` host in ``fresh`` changed its
        connection settings, no idle connection made under the old ones is reused."""
        self.tls = tls
        if any(config.hosts[name].url.scheme == "https" for name in fresh if name in config.hosts):
            self.close()
        self.connect_timeout = config.timeouts.connect


def poll_pool(reactor: IReactorTime) -> H1Pool:
    """The poller's pool: one idle connection kept per host (a poll is two GETs in a
    row), closed like the proxy's (idle time, the host's keep-alive timeout)."""
    return H1Pool(reactor, max_per_host=1)


_NEVER_ANSWERED = (RequestNotSent, RequestTransmissionFailed, ResponseNeverReceived)


@implementer(IAgent)
class PollAgent:
    """The health poller's ``IAgent``: crossbar's HTTP/1.1 client over ``pool``.

    A GET or HEAD without a body whose *reused* connection died before any answer
    byte is sent once more on a new connection, as Twisted's ``Agent`` did for the
    poller: a poll is idempotent and loads nothing (docs/design.md §The health table,
    rule 9), so a host that closed an idle connection as it was reused is not
    failed for it. Proxied requests never get this (rule 7).

    :param endpoints: where new connections come from (e.g. :class:`UpstreamEndpoints`,
        whose ``connect_timeout`` is the poll's ``health.timeout``).
    :param pool: the idle connections (:func:`poll_pool`).
    """

    def __init__(self, endpoints: UpstreamEndpoints, pool: H1Pool) -> None:
        self._endpoints = endpoints
        self._pool = pool

    def request(self, method: bytes, uri: bytes, headers: Headers | None = None,
                bodyProducer: IBodyProducer | None = None) -> Deferred[IResponse]:
        """Send one request (see :meth:`crossbar.upstream.h1client.H1Agent.request`)."""
        tracker = ConnectTracker(self._endpoints)
        d = H1Agent(tracker, self._pool).request(method, uri, headers, bodyProducer)
        if bodyProducer is not None or method not in (b"GET", b"HEAD"):
            return d

        def again(failure: Failure) -> Deferred[IResponse]:
            if tracker.connects == 0 and failure.check(*_NEVER_ANSWERED):
                return H1Agent(self._endpoints, self._pool).request(method, uri, headers, None)
            return fail(failure)

        return d.addErrback(again)
