"""Upstream endpoints (crossbar/upstream/pools.py): what a host URL connects through."""

from __future__ import annotations

from twisted.internet.endpoints import HostnameEndpoint, TCP4ClientEndpoint, TCP6ClientEndpoint
from twisted.trial.unittest import TestCase
from twisted.web.client import URI, BrowserLikePolicyForHTTPS

from crossbar.upstream.pools import ConnectTracker, UpstreamEndpoints


class EndpointChoiceTests(TestCase):
    """An IP literal connects directly (a refused connection is known at once, so
    failover costs no resolver or happy-eyeballs delay); a name goes through
    HostnameEndpoint."""

    def endpoint(self, url: bytes) -> object:
        from twisted.internet import reactor  # built, never connected

        tracker = ConnectTracker(UpstreamEndpoints(reactor, 5.0, BrowserLikePolicyForHTTPS()))
        return tracker.endpointForURI(URI.fromBytes(url))._wrapped  # type: ignore[attr-defined]

    def test_ipv4_literal(self) -> None:
        self.assertIsInstance(self.endpoint(b"http://10.0.0.5:8080/v1/models"), TCP4ClientEndpoint)

    def test_ipv6_literal(self) -> None:
        self.assertIsInstance(self.endpoint(b"http://[::1]:8080/v1/models"), TCP6ClientEndpoint)

    def test_name(self) -> None:
        self.assertIsInstance(self.endpoint(b"http://gpu-a.lan:8080/v1/models"), HostnameEndpoint)
