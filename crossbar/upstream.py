"""Connections to upstream hosts for the proxy path (DESIGN.md §The proxy, rules 6-7).

The proxy needs to know, for a request that failed, whether crossbar could not *open* a
connection to the host (fail over to the next host) or whether a *reused* pooled
connection turned out dead (retry once on a fresh connection, mark nothing down).
Twisted's ``Agent`` does not say; :class:`ConnectTracker` learns it from the public
``IAgentEndpointFactory`` seam: ``connect()`` is only called for a new connection.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.internet.interfaces import IProtocolFactory, IReactorTime, IStreamClientEndpoint
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool, URI
from twisted.web.client import _HTTP11ClientFactory
from twisted.web._newclient import HEADER, STATUS, HTTP11ClientProtocol, ParseError
from twisted.web.iweb import IAgent, IAgentEndpointFactory, IPolicyForHTTPS
from zope.interface import implementer

from crossbar.tcp import no_delay
from crossbar.tls import HandshakeFirstEndpoint, HostTLS

__all__ = [
    "MAX_RESPONSE_HEAD", "ConnectTracker", "ResponseHeadTooLarge", "UpstreamEndpoints", "UpstreamPools", "quiet_pool",
]

MAX_RESPONSE_HEAD = 64 * 1024
"""The most bytes of an upstream answer's head (status lines and headers, interim
``1xx`` answers included) crossbar reads before giving up on it (DESIGN.md §The proxy,
rule 9): Twisted's HTTP client bounds each line but not how many there are."""


class ResponseHeadTooLarge(Exception):
    """An upstream answer's head went over :data:`MAX_RESPONSE_HEAD` bytes."""


_ATTEMPT_DELAY = 0.05
"""Seconds between connection attempts to a name's successive addresses."""


@implementer(IStreamClientEndpoint)
class _TrackedEndpoint:
    def __init__(self, wrapped: IStreamClientEndpoint, tracker: ConnectTracker) -> None:
        self._wrapped = wrapped
        self._tracker = tracker

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        self._tracker.connects += 1
        d = self._wrapped.connect(protocolFactory)

        def failed(f: Failure) -> Failure:
            self._tracker.connect_failure = f
            return f

        d.addErrback(failed)
        return d


@implementer(IAgentEndpointFactory)
class UpstreamEndpoints:
    """How crossbar connects to a host URL (the proxy's and the poller's agents).

    An IP literal gets a plain TCP endpoint: no name resolution (which Twisted does with
    ``getaddrinfo`` on its thread pool) and a refused connection is known at once. A
    name goes through ``HostnameEndpoint``. ``https`` wraps either in TLS that
    completes its handshake before the connection counts as open
    (:class:`crossbar.tls.HandshakeFirstEndpoint`, within ``connect_timeout`` more
    seconds): a refused certificate is a connect failure with a short reason
    (:func:`crossbar.tls.tls_failure_reason`), DESIGN.md §Access and rule 7.

    :param reactor: the reactor.
    :param connect_timeout: seconds to open a connection (and again for the handshake).
    :param tls: the TLS policy per host for ``https`` hosts, e.g.
        ``crossbar.tls.HostTLS.from_config(config)``; default: ``HostTLS({})``
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
    """

    def __init__(self, endpoints: UpstreamEndpoints) -> None:
        self._endpoints = endpoints
        self.connects = 0
        self.connect_failure: Failure | None = None

    def endpointForURI(self, uri: URI) -> IStreamClientEndpoint:
        return _TrackedEndpoint(self._endpoints.endpointForURI(uri), self)


class _ClientProtocol(HTTP11ClientProtocol):
    """Twisted's client protocol, also telling the proxy the answer's ``Connection``
    header: Twisted keeps it out of ``IResponse.headers``, yet the proxy must drop the
    headers it names (DESIGN.md §The proxy, rule 6). Each response gets the attribute
    ``upstream_connection``: the raw ``Connection`` values (a tuple of bytes).

    It also refuses answers crossbar cannot relay as a failed request (rule 7, so the
    proxy marks the host down and answers 502): a head over :data:`MAX_RESPONSE_HEAD`
    bytes, a status code outside 100-599 (Twisted takes any integer), and ``101
    Switching Protocols`` (crossbar never forwards ``Upgrade``; Twisted would skip it
    as an interim answer and parse the new protocol's bytes as HTTP)."""

    _head_bytes = 0

    def connectionMade(self) -> None:
        super().connectionMade()
        no_delay(self.transport)

    def request(self, request: Any) -> Deferred[Any]:
        d = super().request(request)
        parser = self._parser
        self._head_bytes = 0
        if parser is not None:
            parse_status = parser.statusReceived

            def status_received(line: bytes) -> None:
                parse_status(line)
                code = parser.response.code
                if code == 101 or not 100 <= code <= 599:
                    raise ParseError("status code crossbar cannot relay", line[:100])

            parser.statusReceived = status_received  # type: ignore[method-assign]

        def keep(response: Any) -> Any:
            values = parser.connHeaders.getRawHeaders(b"connection", ()) if parser is not None else ()
            response.upstream_connection = tuple(values)
            return response

        d.addCallback(keep)
        return d

    def dataReceived(self, bytes: bytes) -> None:
        parser = self._parser
        if parser is None or parser.state not in (STATUS, HEADER):
            super().dataReceived(bytes)
            return
        self._head_bytes += len(bytes)
        super().dataReceived(bytes)
        # Still in the head after all of it: every byte counted was head.
        if self._parser is parser and parser.state in (STATUS, HEADER) and self._head_bytes > MAX_RESPONSE_HEAD:
            self._giveUp(Failure(ResponseHeadTooLarge(f"response head over {MAX_RESPONSE_HEAD} bytes")))
            transport: Any = self.transport  # an ITCPTransport
            transport.abortConnection()  # never wait to flush to a host we gave up on


class _QuietFactory(_HTTP11ClientFactory):
    noisy = False  # no "Starting factory" line per upstream connection

    def buildProtocol(self, addr: Any) -> HTTP11ClientProtocol:
        return _ClientProtocol(self._quiescentCallback)


def quiet_pool(reactor: IReactorTime, persistent: bool) -> HTTPConnectionPool:
    """An ``HTTPConnectionPool`` that does not log every connection it opens."""
    pool = HTTPConnectionPool(reactor, persistent=persistent)
    pool._factory = _QuietFactory
    return pool


class UpstreamPools:
    """The proxy's connection pools: one persistent, shared by all requests.

    :param reactor: the reactor.
    :param connect_timeout: seconds to open a connection (``timeouts.connect``).
    :param max_per_host: idle persistent connections kept per host.
    :param idle_seconds: how long an idle pooled connection is kept.
    :param tls: the TLS policy per host (see :class:`UpstreamEndpoints`).
    :ivar tls: that policy; assign a new one on reload (the next connection uses it;
        close the pooled connections of hosts whose ``tls`` changed).
    """

    def __init__(
        self, reactor: IReactorTime, connect_timeout: float, max_per_host: int = 64, idle_seconds: float = 60.0,
        tls: IPolicyForHTTPS | None = None,
    ) -> None:
        self._reactor = reactor
        self.connect_timeout = connect_timeout
        self.tls: IPolicyForHTTPS = tls if tls is not None else HostTLS({})
        self.pool = quiet_pool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = max_per_host
        self.pool.cachedConnectionTimeout = idle_seconds  # type: ignore[assignment]  # Twisted says int; seconds
        # A stale pooled connection is retried by the proxy itself (any method), once.
        self.pool.retryAutomatically = False
        self._fresh_pool = quiet_pool(reactor, persistent=False)

    def agent(self, fresh: bool = False) -> tuple[IAgent, ConnectTracker]:
        """An agent for one attempt and the tracker of its connections.

        ``fresh=True`` never reuses a pooled connection (the retry after a stale one).
        """
        tracker = ConnectTracker(UpstreamEndpoints(self._reactor, self.connect_timeout, self.tls))
        pool = self._fresh_pool if fresh else self.pool
        return Agent.usingEndpointFactory(self._reactor, tracker, pool=pool), tracker

    def close(self) -> Deferred[Any]:
        """Close every idle pooled connection."""
        return self.pool.closeCachedConnections()
