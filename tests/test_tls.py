"""TLS to hosts (crossbar/upstream/tls.py, crossbar/upstream/pools.py; docs/design.md §Access, rule 7).

Real loopback TLS servers (Twisted's ``ssl:`` server endpoint) with certificates made
in the test run by ``trustme``; crossbar's side is the real ``UpstreamEndpoints`` under
a Twisted ``Agent``, as the proxy and the poller use it. Each refusal is a *connect*
failure (the ``ConnectTracker`` sees it, so the proxy fails over) with the right short
reason.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from typing import Any

import treq
import trustme
from OpenSSL import SSL
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import IListeningPort
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web._newclient import RequestTransmissionFailed, ResponseFailed, ResponseNeverReceived
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.resource import Resource
from twisted.web.server import Request

from crossbar.config import HostTLSSettings, parse_config
from crossbar.upstream.tls import HandshakeFirstEndpoint, HostTLS, TLSHandshakeError, client_creator, tls_failure_reason
from crossbar.upstream.pools import ConnectTracker, UpstreamEndpoints
from tests.accesskit import serve_tls

_DAY = datetime.timedelta(days=1)


def _settings(ca: trustme.CA | None = None, client: trustme.LeafCert | None = None, verify: bool = True) -> HostTLSSettings:
    """What the config would hold for these files (the config tests cover reading them)."""
    client_pem = b""
    if client is not None:
        client_pem = client.cert_chain_pems[0].bytes() + client.private_key_pem.bytes()
    return HostTLSSettings(
        ca="ca.pem" if ca else None, verify=verify, client_cert="c.pem" if client else None,
        client_key="c.key" if client else None, ca_pem=ca.cert_pem.bytes() if ca else b"", client_pem=client_pem,
    )


class _Hello(Resource):
    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        return b"hello over tls"


class TLSHostTests(TestCase):
    def setUp(self) -> None:
        self.ca = trustme.CA()

    async def serve(self, leaf: trustme.LeafCert, client_ca: trustme.CA | None = None) -> int:
        """A TLS web server on 127.0.0.1 with ``leaf``; requiring a client certificate
        from ``client_ca`` when given. Returns its port."""
        return await serve_tls(self, _Hello(), leaf, client_ca)

    async def get(self, url: str, tls: HostTLS | None) -> tuple[bytes, ConnectTracker]:
        pool = HTTPConnectionPool(reactor, persistent=False)
        tracker = ConnectTracker(UpstreamEndpoints(reactor, 5.0, tls))
        agent = Agent.usingEndpointFactory(reactor, tracker, pool=pool)
        response = await agent.request(b"GET", url.encode("ascii"))
        return await treq.content(response), tracker

    async def refused(self, url: str, tls: HostTLS | None) -> tuple[str | None, ConnectTracker]:
        """The request fails; returns the failure's short reason and the tracker."""
        pool = HTTPConnectionPool(reactor, persistent=False)
        tracker = ConnectTracker(UpstreamEndpoints(reactor, 5.0, tls))
        agent = Agent.usingEndpointFactory(reactor, tracker, pool=pool)
        try:
            await agent.request(b"GET", url.encode("ascii"))
        except Exception as e:
            return tls_failure_reason(e), tracker
        self.fail(f"{url}: the request succeeded")

    def policy(self, host: str, port: int, **settings: Any) -> HostTLS:
        return HostTLS({(host, port): _settings(**settings)})

    async def test_verified_with_the_configured_ca(self) -> None:
        port = await self.serve(self.ca.issue_cert("localhost", "127.0.0.1"))
        body, tracker = await self.get(f"https://localhost:{port}/", self.policy("localhost", port, ca=self.ca))
        self.assertEqual(body, b"hello over tls")
        body, _ = await self.get(f"https://127.0.0.1:{port}/", self.policy("127.0.0.1", port, ca=self.ca))
        self.assertEqual(body, b"hello over tls")
        self.assertIsNone(tracker.connect_failure)

    async def test_private_ca_refused_with_the_system_store(self) -> None:
        port = await self.serve(self.ca.issue_cert("localhost"))
        reason, tracker = await self.refused(f"https://localhost:{port}/", HostTLS({}))
        self.assertEqual(reason, "unknown CA")
        self.assertIsInstance(tracker.connect_failure.value if tracker.connect_failure else None, TLSHandshakeError)
        # The default policy (no tls settings at all) refuses it the same way.
        reason, _ = await self.refused(f"https://localhost:{port}/", None)
        self.assertEqual(reason, "unknown CA")

    async def test_another_ca_is_unknown(self) -> None:
        port = await self.serve(self.ca.issue_cert("localhost"))
        reason, _ = await self.refused(f"https://localhost:{port}/", self.policy("localhost", port, ca=trustme.CA()))
        self.assertEqual(reason, "unknown CA")

    async def test_wrong_name(self) -> None:
        port = await self.serve(self.ca.issue_cert("gpu-b.example"))
        reason, tracker = await self.refused(f"https://localhost:{port}/", self.policy("localhost", port, ca=self.ca))
        self.assertEqual(reason, "wrong name")
        self.assertIsNotNone(tracker.connect_failure)

    async def test_wrong_ip_address(self) -> None:
        port = await self.serve(self.ca.issue_cert("localhost", "10.0.0.6"))
        reason, _ = await self.refused(f"https://127.0.0.1:{port}/", self.policy("127.0.0.1", port, ca=self.ca))
        self.assertEqual(reason, "wrong name")

    async def test_expired_certificate(self) -> None:
        now = datetime.datetime.now(datetime.timezone.utc)
        port = await self.serve(self.ca.issue_cert("localhost", not_before=now - 10 * _DAY, not_after=now - _DAY))
        reason, tracker = await self.refused(f"https://localhost:{port}/", self.policy("localhost", port, ca=self.ca))
        self.assertEqual(reason, "certificate expired")
        self.assertIsNotNone(tracker.connect_failure)

    async def test_mutual_tls_required_by_the_host(self) -> None:
        client_ca = trustme.CA()
        port = await self.serve(self.ca.issue_cert("localhost"), client_ca=client_ca)
        url = f"https://localhost:{port}/"
        reason, _ = await self.refused(url, self.policy("localhost", port, ca=self.ca))
        self.assertEqual(reason, "client certificate required by the host")
        # A client certificate from a CA the host does not trust is refused too.
        stranger = trustme.CA().issue_cert("crossbar")
        reason, _ = await self.refused(url, self.policy("localhost", port, ca=self.ca, client=stranger))
        self.assertIsNotNone(reason)
        assert reason is not None
        self.assertTrue(reason.startswith("client certificate refused by the host"), reason)
        body, _ = await self.get(url, self.policy("localhost", port, ca=self.ca, client=client_ca.issue_cert("crossbar")))
        self.assertEqual(body, b"hello over tls")

    async def test_verify_false_accepts_anything(self) -> None:
        """``verify: false`` checks nothing: unknown CA, wrong name and expiry all pass."""
        now = datetime.datetime.now(datetime.timezone.utc)
        port = await self.serve(trustme.CA().issue_cert("elsewhere", not_before=now - 10 * _DAY, not_after=now - _DAY))
        body, _ = await self.get(f"https://localhost:{port}/", self.policy("localhost", port, verify=False))
        self.assertEqual(body, b"hello over tls")

    async def test_verify_false_still_presents_the_client_certificate(self) -> None:
        client_ca = trustme.CA()
        port = await self.serve(self.ca.issue_cert("localhost"), client_ca=client_ca)
        body, _ = await self.get(
            f"https://localhost:{port}/", self.policy("localhost", port, verify=False, client=client_ca.issue_cert("c"))
        )
        self.assertEqual(body, b"hello over tls")

    async def test_policy_from_config_per_host(self) -> None:
        """Two https hosts with different CAs behind one HostTLS, built from the config."""
        other = trustme.CA()
        port_a = await self.serve(self.ca.issue_cert("localhost"))
        port_b = await self.serve(other.issue_cert("127.0.0.1"))
        d = tempfile.mkdtemp(prefix="crossbar-tls-")
        self.addCleanup(shutil.rmtree, d, True)
        self.ca.cert_pem.write_to_path(os.path.join(d, "a.pem"))
        other.cert_pem.write_to_path(os.path.join(d, "b.pem"))
        config = parse_config(
            "listen: tcp:1\nhosts:\n"
            f"  a: {{url: 'https://LOCALHOST:{port_a}', tls: {{ca: a.pem}}}}\n"
            f"  b: {{url: 'https://127.0.0.1:{port_b}/base', tls: {{ca: b.pem}}}}\n"
            "routes: {r: {hosts: [a, b]}}\n",
            os.path.join(d, "c.yaml"), environ={},
        )
        tls = HostTLS.from_config(config)
        self.assertEqual((await self.get(f"https://localhost:{port_a}/", tls))[0], b"hello over tls")
        self.assertEqual((await self.get(f"https://127.0.0.1:{port_b}/", tls))[0], b"hello over tls")
        self.assertIs(tls.creatorForNetloc(b"localhost", port_a), tls.creatorForNetloc(b"LocalHost", port_a))

    async def test_plain_http_server_is_a_handshake_failure(self) -> None:
        port: IListeningPort = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            Factory.forProtocol(_PlainHTTP)
        )
        self.addCleanup(port.stopListening)
        number = port.getHost().port  # type: ignore[attr-defined]
        reason, tracker = await self.refused(f"https://127.0.0.1:{number}/", HostTLS({}))
        assert reason is not None
        self.assertTrue(reason.startswith("handshake failed: "), reason)
        self.assertIsNotNone(tracker.connect_failure)


class _Silent(Protocol):
    pass


class _PlainHTTP(Protocol):
    """A plain-HTTP host that answers whatever arrives (a ClientHello here)."""

    def dataReceived(self, data: bytes) -> None:
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")  # type: ignore[union-attr]


class HandshakeTimeoutTests(TestCase):
    async def test_silent_host_times_out(self) -> None:
        """A host that accepts TCP and never answers the ClientHello fails the connect
        after ``timeout`` seconds (a Clock: no sleeping)."""
        port: IListeningPort = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            Factory.forProtocol(_Silent)
        )
        self.addCleanup(port.stopListening)
        clock = Clock()
        tcp = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)  # type: ignore[attr-defined]
        endpoint = HandshakeFirstEndpoint(client_creator("localhost", None), tcp, clock, 3.0)
        d = endpoint.connect(Factory.forProtocol(Protocol))
        while not clock.getDelayedCalls():  # TCP connected: the handshake timer runs
            await _turn()
        self.assertFalse(d.called)
        clock.advance(3.0)
        try:
            await d
        except TLSHandshakeError as e:
            self.assertEqual(e.reason, "handshake timed out")
        else:
            self.fail("connected")

    async def test_cancel_during_the_handshake_closes_the_connection(self) -> None:
        closed: Deferred[None] = Deferred()

        class Watch(Protocol):
            def connectionLost(self, reason: Failure = Failure(Exception())) -> None:
                closed.callback(None)

        port: IListeningPort = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Factory.forProtocol(Watch))
        self.addCleanup(port.stopListening)
        clock = Clock()
        tcp = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)  # type: ignore[attr-defined]
        d = HandshakeFirstEndpoint(client_creator("localhost", None), tcp, clock, 3.0).connect(Factory.forProtocol(Protocol))
        while not clock.getDelayedCalls():
            await _turn()
        d.cancel()
        with self.assertRaises(Exception):
            await d
        await closed  # the host saw the connection go
        self.assertEqual(clock.getDelayedCalls(), [])  # and the handshake timer is gone

    async def test_refused_tcp_is_not_a_tls_failure(self) -> None:
        port: IListeningPort = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Factory.forProtocol(_Silent))
        number = port.getHost().port  # type: ignore[attr-defined]
        await port.stopListening()
        endpoint = HandshakeFirstEndpoint(client_creator("localhost", None), TCP4ClientEndpoint(reactor, "127.0.0.1", number), reactor, 3.0)
        with self.assertRaises(ConnectionRefusedError) as caught:
            await endpoint.connect(Factory.forProtocol(Protocol))
        self.assertIsNone(tls_failure_reason(caught.exception))


async def _turn() -> None:
    d: Deferred[None] = Deferred()
    reactor.callLater(0.01, d.callback, None)  # type: ignore[attr-defined]
    await d


class FailureReasonTests(SynchronousTestCase):
    """The short reason is found through Twisted's wrappers; other failures give None."""

    def ssl_error(self, reason: str) -> SSL.Error:
        return SSL.Error([("SSL routines", "", reason)])

    def test_handshake_error(self) -> None:
        self.assertEqual(tls_failure_reason(TLSHandshakeError("certificate expired")), "certificate expired")

    def test_wrapped_in_response_never_received(self) -> None:
        error = ResponseNeverReceived([Failure(self.ssl_error("tlsv13 alert certificate required"))])
        self.assertEqual(tls_failure_reason(Failure(error)), "client certificate required by the host")

    def test_wrapped_twice(self) -> None:
        inner = Failure(TLSHandshakeError("wrong name"))
        outer = RequestTransmissionFailed([Failure(ResponseFailed([inner]))])
        self.assertEqual(tls_failure_reason(Failure(outer)), "wrong name")

    def test_verification_error(self) -> None:
        from service_identity import VerificationError

        self.assertEqual(tls_failure_reason(VerificationError(errors=[])), "wrong name")

    def test_other_ssl_errors(self) -> None:
        self.assertEqual(tls_failure_reason(self.ssl_error("certificate verify failed")), "certificate verify failed")
        self.assertEqual(tls_failure_reason(self.ssl_error("wrong version number")), "handshake failed: wrong version number")
        self.assertEqual(
            tls_failure_reason(self.ssl_error("sslv3 alert bad certificate")), "client certificate refused by the host"
        )

    def test_cause_chain(self) -> None:
        try:
            try:
                raise TLSHandshakeError("unknown CA")
            except TLSHandshakeError as inner:
                raise RuntimeError("request failed") from inner
        except RuntimeError as outer:
            self.assertEqual(tls_failure_reason(outer), "unknown CA")

    def test_not_tls(self) -> None:
        self.assertIsNone(tls_failure_reason(Failure(ConnectionRefusedError())))
        self.assertIsNone(tls_failure_reason(ResponseNeverReceived([Failure(ValueError("x"))])))
        self.assertIsNone(tls_failure_reason(ValueError("certificate expired")))
