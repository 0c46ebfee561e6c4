"""TLS end to end through a real crossbar (docs/design.md §Access, §The proxy rule 7):
hosts served over TLS with ``trustme`` certificates made in the test run, crossbar
loaded from a config file, and a TLS listener reached by the ``openai`` client.

Each refused host is a connect failure with a ``last_err`` (status) and a log line that
say what failed; the route fails over to a plain host.
"""

from __future__ import annotations

import datetime
import ssl
from typing import Any

import trustme
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.logger import LogLevel, formatEvent
from OpenSSL import SSL
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web._newclient import ResponseNeverReceived

from crossbar.upstream.failures import describe_failure

from tests.accesskit import serve_tls, start_file, write_pem
from tests.harness import FakeLlama, http_client, listen, upstream_requests, wait_for
from tests.logs import LogCapture
from tests.upstreams import host_status

_DAY = datetime.timedelta(days=1)
CHAT = b'{"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]}'


class TLSHostsTests(TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.ca = trustme.CA()
        self.ca_path = write_pem(self, "ca.pem", self.ca.cert_pem.bytes())
        self.log = LogCapture(self)

    async def crossbar(self, tls_host: str) -> tuple[Any, str, FakeLlama, FakeLlama]:
        """crossbar with TLS host ``t`` (its YAML value; ``{port}`` is filled in by the
        caller) and plain host ``plain``, route ``r: [t, plain]``. Returns the service,
        its base URL, t's and plain's FakeLlama."""
        plain = FakeLlama()
        plain_url = await listen(self, plain)
        config = (
            "health: {interval: 60, timeout: 5}\n"
            f"hosts:\n  t: {tls_host}\n  plain: {plain_url}\n"
            "routes:\n  r: {hosts: [t, plain]}\n"
        )
        service, base, _ = await start_file(self, config)
        await service.poller.when_first_round_done()
        return service, base, self.tls_host, plain

    async def serve(self, leaf: trustme.LeafCert, client_ca: trustme.CA | None = None) -> int:
        self.tls_host = FakeLlama()
        return await serve_tls(self, self.tls_host, leaf, client_ca)

    async def post(self, base: str) -> tuple[int, str | None]:
        response = await http_client(self).post(base + "/r/v1/chat/completions", data=CHAT,
                                                headers={b"Content-Type": [b"application/json"]})
        await response.content()
        host = response.headers.getRawHeaders(b"x-crossbar-host")
        return response.code, host[0].decode() if host else None

    async def assert_refused(self, tls_host: str, reason: str) -> None:
        """Host ``t`` fails its poll with ``reason`` in ``last_err``; forced healthy, a
        request to it fails over to ``plain`` and marks it down with ``reason`` again
        (status and a log line)."""
        service, base, t, plain = await self.crossbar(tls_host)
        hosts = await host_status(self, base)
        self.assertFalse(hosts["t"]["healthy"])
        self.assertIn(reason, hosts["t"]["last_err"])
        # The proxy's own attempt: t looks healthy, the handshake fails, plain answers.
        service.table.record_success("t", ["tiny-a"])
        for _ in range(service.config.health.recovery_polls):
            service.table.record_success("t", ["tiny-a"])
        self.assertTrue(service.table.is_healthy("t"))
        self.assertEqual(await self.post(base), (200, "plain"))
        self.assertFalse(service.table.is_healthy("t"))
        hosts = await host_status(self, base)
        self.assertIn(reason, hosts["t"]["last_err"])
        self.assertTrue(any(reason in (formatEvent(e) or "") and "t" in (formatEvent(e) or "") for e in self.log.events),
                        "no log line names the reason")
        self.assertEqual(upstream_requests(t), [])
        self.assertEqual(len(upstream_requests(plain)), 1)

    async def test_private_ca_verified_with_tls_ca(self) -> None:
        port = await self.serve(self.ca.issue_cert("localhost"))
        service, base, t, plain = await self.crossbar(
            f"{{url: 'https://localhost:{port}', tls: {{ca: {self.ca_path}}}}}")
        self.assertTrue(service.table.is_healthy("t"))
        self.assertEqual(await self.post(base), (200, "t"))
        self.assertEqual(len(upstream_requests(t)), 1)

    async def test_private_ca_refused_without_tls_ca(self) -> None:
        port = await self.serve(self.ca.issue_cert("localhost"))
        await self.assert_refused(f"https://localhost:{port}", "unknown CA")

    async def test_wrong_hostname(self) -> None:
        port = await self.serve(self.ca.issue_cert("other.example"))
        await self.assert_refused(f"{{url: 'https://localhost:{port}', tls: {{ca: {self.ca_path}}}}}", "wrong name")

    async def test_expired_certificate(self) -> None:
        now = datetime.datetime.now(datetime.timezone.utc)
        port = await self.serve(self.ca.issue_cert("localhost", not_before=now - 10 * _DAY, not_after=now - _DAY))
        await self.assert_refused(f"{{url: 'https://localhost:{port}', tls: {{ca: {self.ca_path}}}}}",
                                  "certificate expired")

    async def test_mutual_tls_required_by_the_host(self) -> None:
        client_ca = trustme.CA()
        port = await self.serve(self.ca.issue_cert("localhost"), client_ca=client_ca)
        await self.assert_refused(f"{{url: 'https://localhost:{port}', tls: {{ca: {self.ca_path}}}}}",
                                  "client certificate")

    async def test_mutual_tls_with_client_cert(self) -> None:
        client_ca = trustme.CA()
        port = await self.serve(self.ca.issue_cert("localhost"), client_ca=client_ca)
        leaf = client_ca.issue_cert("crossbar")
        cert = write_pem(self, "client.pem", leaf.cert_chain_pems[0].bytes())
        key = write_pem(self, "client.key", leaf.private_key_pem.bytes())
        service, base, t, _ = await self.crossbar(
            f"{{url: 'https://localhost:{port}', tls: {{ca: {self.ca_path}, client_cert: {cert}, client_key: {key}}}}}")
        self.assertTrue(service.table.is_healthy("t"))
        self.assertEqual(await self.post(base), (200, "t"))
        self.assertEqual(len(upstream_requests(t)), 1)

    async def test_verify_false_warns_once_at_start(self) -> None:
        stranger = trustme.CA()  # a CA crossbar is never told about
        port = await self.serve(stranger.issue_cert("other.example"))
        service, base, t, _ = await self.crossbar(f"{{url: 'https://localhost:{port}', tls: {{verify: false}}}}")
        self.assertTrue(service.table.is_healthy("t"))
        self.assertEqual(await self.post(base), (200, "t"))
        warnings = [formatEvent(e) for e in self.log.events
                    if e.get("log_level") == LogLevel.warn and "verify" in (formatEvent(e) or "")]
        self.assertEqual(len(warnings), 1, warnings)
        self.assertIn("hosts.t.tls.verify", warnings[0])


def _httpx() -> Any:
    """The HTTP library the installed ``openai`` client is built on (``httpx``, or its
    ``httpx2`` fork in newer releases)."""
    try:
        import httpx
    except ImportError:
        import httpx2 as httpx  # type: ignore[no-redef]
    return httpx


def _stream_over_tls(base: str, ca_file: str, api_key: str) -> tuple[list[str], str | None]:
    from openai import OpenAI

    http = _httpx().Client(verify=ssl.create_default_context(cafile=ca_file))
    client = OpenAI(base_url=base + "/r/v1", api_key=api_key, http_client=http, max_retries=0, timeout=30.0)
    try:
        chunks: list[str] = []
        with client.chat.completions.with_streaming_response.create(
            model="tiny-a", messages=[{"role": "user", "content": "hi"}], stream=True,  # type: ignore[arg-type]
        ) as response:
            host = response.headers.get("x-crossbar-host")
            for chunk in response.parse():
                for choice in chunk.choices:
                    if choice.delta.content:
                        chunks.append(choice.delta.content)
        return chunks, host
    finally:
        client.close()
        http.close()


def _refused_without_ca(base: str) -> str:
    httpx = _httpx()
    try:
        httpx.get(base + "/_crossbar/health", timeout=10)
    except httpx.ConnectError as e:
        return str(e)
    raise AssertionError("a client without the test CA connected")


def _raw_over_tls(base: str, ca_file: str, request: bytes) -> bytes:
    """Send ``request`` over TLS to crossbar; the answer's bytes until it closes or its
    ``Content-Length`` body is in (then the client closes: the test need not wait for
    crossbar's close)."""
    import socket
    from urllib.parse import urlsplit

    def complete(data: bytes) -> bool:
        head, sep, body = data.partition(b"\r\n\r\n")
        lengths = [line.split(b":", 1)[1] for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")]
        return bool(sep) and bool(lengths) and len(body) >= int(lengths[0])

    where = urlsplit(base)
    context = ssl.create_default_context(cafile=ca_file)
    with socket.create_connection(("127.0.0.1", where.port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as sock:
            sock.sendall(request)
            data = b""
            try:
                while not complete(data) and (chunk := sock.recv(65536)):
                    data += chunk
            except (ssl.SSLError, OSError):
                pass
    return data


async def _keyed_tls_crossbar(case: TestCase) -> tuple[Any, str, str, FakeLlama]:
    """A crossbar on an ``ssl:`` listener (a trustme CA's certificate for localhost) with
    one keyed route ``r`` (key ``alice``) to a fake host: (service, base URL, the CA's
    PEM file, the host)."""
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    ca_file = write_pem(case, "ca.pem", ca.cert_pem.bytes())
    cert = write_pem(case, "listener.pem", b"".join(p.bytes() for p in leaf.cert_chain_pems))
    key = write_pem(case, "listener.key", leaf.private_key_pem.bytes())
    host = FakeLlama()
    url = await listen(case, host)
    service, base, _ = await start_file(
        case, f"hosts: {{a: {url}}}\nroutes:\n  r: {{hosts: [a], keys: {{alice: ${{T_TLS_ALICE}}}}}}\n",
        {"T_TLS_ALICE": "alice-Tt9l-secret"},
        listen=f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={cert}",
    )
    return service, base, ca_file, host


class TLSListenerTests(TestCase):
    timeout = 60

    async def test_openai_client_through_a_tls_listener(self) -> None:
        """``listen: "ssl:0:...:privateKey=KEY:certKey=CERT"`` (Twisted's ``ssl:``
        endpoint string): the ``openai`` client with the test CA streams through a
        keyed route; a client without the CA is refused."""
        service, base, ca_file, host = await _keyed_tls_crossbar(self)
        self.assertTrue(base.startswith("https://localhost:"), base)
        await service.poller.when_first_round_done()
        chunks, served_by = await deferToThread(_stream_over_tls, base, ca_file, "alice-Tt9l-secret")
        self.assertEqual(served_by, "a")
        self.assertEqual(len(chunks), 5)
        self.assertIn("CERTIFICATE_VERIFY_FAILED", await deferToThread(_refused_without_ca, base))
        await wait_for(lambda: len(upstream_requests(host)) == 1, what="one request at the host")
        # Refusals made on the request head (401, 413) close a TLS connection cleanly:
        # no traceback from Twisted's TLS layer (a half-close broke it).
        log = LogCapture(self)
        for extra in (b"", b"Authorization: Bearer alice-Tt9l-secret\r\n"):
            length = b"2" if not extra else b"99999999"
            head = await deferToThread(_raw_over_tls, base, ca_file, b"POST /r/v1/chat/completions HTTP/1.1\r\n"
                                       b"Host: localhost\r\n" + extra + b"Content-Length: " + length + b"\r\n\r\n{}")
            self.assertTrue(head.startswith(b"HTTP/1.1 401" if not extra else b"HTTP/1.1 413"), head)
        await deferLater(reactor, 0.3, lambda: None)
        self.assertEqual(log.errors(), [])


class TLSHeadRefusalCloseTests(TestCase):
    """A refusal made on the request head (401, 413) on an ``ssl:`` listener closes the
    connection like on plain TCP (docs/design.md §The proxy, rule 9): crossbar sends its
    TLS close at once and drops the TCP connection after the linger at the latest, also
    when the client neither answers the close nor closes (issue 20)."""

    timeout = 60

    async def test_refused_tls_connection_closes_without_the_client(self) -> None:
        from crossbar.proxy import request as request_module

        self.patch(request_module, "_LINGER_SECONDS", 0.5)
        _, base, ca_file, _ = await _keyed_tls_crossbar(self)
        for extra, code in ((b"", b"401"), (b"Authorization: Bearer alice-Tt9l-secret\r\n", b"413")):
            length = b"2" if not extra else b"99999999"
            answer, tls_closed, tcp_closed_after = await deferToThread(
                _silent_tls_client, base, ca_file, b"POST /r/v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                + extra + b"Content-Length: " + length + b"\r\n\r\n{}", 8.0)
            self.assertTrue(answer.startswith(b"HTTP/1.1 " + code), answer)
            self.assertTrue(tls_closed, "no TLS close from crossbar")
            self.assertIsNotNone(tcp_closed_after, "crossbar kept the TCP connection open")
            assert tcp_closed_after is not None
            self.assertLess(tcp_closed_after, 3.0)


def _silent_tls_client(base: str, ca_file: str, request: bytes, wait: float) -> tuple[bytes, bool, float | None]:
    """A TLS client (``ssl.SSLObject`` over a plain socket, so it sees the TLS close and
    the TCP close apart) that sends ``request`` and then only reads: it never answers
    crossbar's TLS close nor closes. Returns the answer's bytes, whether a TLS close
    came, and the seconds from the request to the TCP close (None: still open after
    ``wait`` seconds)."""
    import socket
    import time
    from urllib.parse import urlsplit

    context = ssl.create_default_context(cafile=ca_file)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with socket.create_connection(("127.0.0.1", urlsplit(base).port), timeout=wait) as sock:

        def flush() -> None:
            data = outgoing.read()
            if data:
                sock.sendall(data)

        def pump() -> bool:
            data = sock.recv(65536)
            if not data:
                incoming.write_eof()
                return False
            incoming.write(data)
            return True

        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                flush()
                pump()
        flush()
        tls.write(request)
        flush()
        answer, tls_closed, open_ = b"", False, True
        started = time.monotonic()
        deadline = started + wait
        while open_ and time.monotonic() < deadline:
            try:
                open_ = pump()
            except (TimeoutError, socket.timeout):
                break
            except OSError:  # reset
                open_ = False
            while not tls_closed:
                try:
                    data = tls.read(65536)
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLError:
                    break
                if not data:  # the TLS close (close_notify): read() says so with b""
                    tls_closed = True
                    break
                answer += data
        closed_after = None if open_ else time.monotonic() - started
        return answer, tls_closed, closed_after


class DescribeTLSFailureTests(SynchronousTestCase):
    def test_short_reason_not_openssl_list(self) -> None:
        """``last_err`` and log lines use the short TLS reason, also for a refusal the
        host sends after the TLS 1.3 handshake (found by the mutual TLS test above)."""
        error = SSL.Error([("SSL routines", "", "tlsv13 alert certificate required")])
        failure = Failure(ResponseNeverReceived([Failure(error)]))
        self.assertEqual(describe_failure(failure), "client certificate required by the host")
        self.assertEqual(describe_failure(Failure(ValueError("plain  problem"))), "plain problem")
