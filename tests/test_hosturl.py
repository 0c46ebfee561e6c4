"""Host URLs (docs/design.md §Configuration ``hosts``; §The health table; §The proxy, rule 6):
every form the config accepts works the same for polls and for requests.

``HostURLTests`` check :class:`~crossbar.hosturl.HostURL` itself, and that it accepts
and refuses what the config loader does. ``LoopbackFormTests`` run crossbar in-process
in front of a real loopback upstream served at each URL form (names, IPv4 and IPv6
literals, explicit and default ports, base paths plain, percent-encoded and with
characters URL libraries like to re-encode, trailing slashes, ``https`` with a trustme
CA) and prove that the poll passed and that a proxied request reached the right path,
byte for byte.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import tempfile
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.endpoints import SSL4ServerEndpoint, TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort
from twisted.internet.ssl import CertificateOptions
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.server import Request

from crossbar.config import ConfigError, parse_config
from crossbar.hosturl import HostURL, HostURLError, host_url
from tests.harness import FakeLlama, _QuietSite, start_routes, upstream_requests
from tests.raw import parse_responses, post_bytes, raw_exchange


def _config_accepts(url: str) -> bool:
    text = f"listen: tcp:0\nhosts:\n  h: {json.dumps(url)}\nroutes:\n  r: {{hosts: [h]}}\n"
    try:
        parse_config(text, "t.yaml", environ={})
    except ConfigError:
        return False
    return True


class HostURLTests(SynchronousTestCase):
    def test_fields(self) -> None:
        cases = [
            ("http://127.0.0.1:8080", "http", "127.0.0.1", 8080, "127.0.0.1:8080", ""),
            ("http://localhost", "http", "localhost", 80, "localhost", ""),
            ("https://gpu-1.example", "https", "gpu-1.example", 443, "gpu-1.example", ""),
            ("http://[::1]:9000/llama", "http", "::1", 9000, "[::1]:9000", "/llama"),
            ("https://[2001:db8::7]/a/b", "https", "2001:db8::7", 443, "[2001:db8::7]", "/a/b"),
            ("http://h:1/ll%7Ema", "http", "h", 1, "h:1", "/ll%7Ema"),
            ("http://[fe80::1%25eth0]:8080", "http", "fe80::1%25eth0", 8080, "[fe80::1%25eth0]:8080", ""),
        ]
        for url, scheme, host, port, netloc, path in cases:
            u = HostURL.parse(url)
            self.assertEqual((u.url, u.scheme, u.host, u.port, u.netloc, u.path),
                             (url, scheme, host, port, netloc, path), url)

    def test_trailing_slashes_and_blanks_trimmed(self) -> None:
        self.assertEqual(HostURL.parse(" http://h:1/ ").url, "http://h:1")
        self.assertEqual(HostURL.parse("http://h:1/llama//").url, "http://h:1/llama")
        self.assertEqual(HostURL.parse("http://h:1/llama//").path, "/llama")

    def test_target_keeps_bytes(self) -> None:
        u = HostURL.parse("http://[::1]:8080/m[1]|x/")
        self.assertEqual(u.target(b"/health"), b"http://[::1]:8080/m[1]|x/health")
        self.assertEqual(u.target(b"/v1/a%2Fb?q=%7E"), b"http://[::1]:8080/m[1]|x/v1/a%2Fb?q=%7E")
        self.assertEqual(u.target(b""), b"http://[::1]:8080/m[1]|x")
        self.assertEqual(u.target(b"?x=1"), b"http://[::1]:8080/m[1]|x?x=1")

    def test_target_refuses_what_would_change_the_base(self) -> None:
        u = HostURL.parse("http://h:1")
        for bad in (b"evil.example/x", b"@evil/x", b":2/x", b"x"):
            self.assertRaises(ValueError, u.target, bad)

    def test_refused(self) -> None:
        for url in ("ftp://h", "http://", "http://h?x=1", "http://h#f", "http://u:p@h", "http://h:0",
                    "http://h:65536", "http://h:", "http://h:x", "http://[::1", "http://[::1]x", "http://:80",
                    "http://h/é", "http://[zz]:80", "http://[]:80", "h:80", ""):
            with self.assertRaises(HostURLError, msg=url) as e:
                HostURL.parse(url)
            self.assertNotIn("\n", str(e.exception))

    def test_agrees_with_config(self) -> None:
        """Every URL the config accepts parses; the config refuses what HostURL refuses
        (but for IPv6 literals, which only HostURL checks fully: reported to the lead)."""
        for url in ("http://127.0.0.1:8080", "http://localhost", "https://h:8443/a/b/", "http://[::1]:1",
                    "http://h/ll%7Ema", "http://h/m[1]|x", "HTTP://h", "http://h:1/a%2Fb"):
            self.assertEqual(_config_accepts(url), _parses(url), url)
        for url in ("ftp://h", "http://h?x=1", "http://u@h", "http://h:0", "http://h:", "http://:1"):
            self.assertFalse(_config_accepts(url), url)
            self.assertFalse(_parses(url), url)

    def test_host_url_remembers(self) -> None:
        self.assertIs(host_url("http://h:1/x"), host_url("http://h:1/x"))
        self.assertRaises(HostURLError, host_url, "http://h:0")


def _parses(url: str) -> bool:
    try:
        HostURL.parse(url)
    except HostURLError:
        return False
    return True


class PrefixedLlama(FakeLlama):
    """A :class:`FakeLlama` served under the base path ``prefix`` (raw bytes, as on
    the wire): a request outside it is a 404 (and recorded in ``outside``)."""

    def __init__(self, prefix: bytes) -> None:
        super().__init__(["tiny-a"])
        self.prefix = prefix
        self.raw: list[bytes] = []
        self.outside: list[bytes] = []

    def render(self, request: Request) -> Any:
        self.raw.append(request.uri)
        if not request.path.startswith(self.prefix + b"/"):
            self.outside.append(request.uri)
            request.setResponseCode(404)
            return b"outside the base path"
        request.path = request.path[len(self.prefix):]
        request.uri = request.uri[len(self.prefix):]
        return super().render(request)


def _tls_options(case: TestCase, interface: str) -> tuple[Any, str]:
    """Server TLS options for localhost, 127.0.0.1, ::1 and ``interface`` from a fresh
    trustme CA, and the path of the CA's PEM file."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1", "::1", *([interface] if interface else []))
    fd, path = tempfile.mkstemp(suffix="-ca.pem")
    os.close(fd)
    case.addCleanup(os.remove, path)
    ca.cert_pem.write_to_path(path)
    # cryptography objects: pyOpenSSL's own (PrivateCertificate.options()) are deprecated
    options = CertificateOptions(privateKey=load_pem_private_key(cert.private_key_pem.bytes(), None),
                                 certificate=x509.load_pem_x509_certificate(cert.cert_chain_pems[0].bytes()))
    return options, path


def _default_port_interface() -> str:
    """A loopback address of this process's own (so tests running at the same time do
    not contend for port 80/443 on 127.0.0.1)."""
    pid = os.getpid()
    return f"127.{(pid >> 8) % 250 + 2}.{pid % 250 + 2}.1"


class LoopbackFormTests(TestCase):
    timeout = 30

    async def _serve(self, upstream: PrefixedLlama, family: str, tls: bool, port: int = 0,
                     interface: str = "") -> int:
        site = _QuietSite(upstream)
        endpoint: Any
        if tls:
            options, ca_path = _tls_options(self, interface)
            old = os.environ.get("SSL_CERT_FILE")
            os.environ["SSL_CERT_FILE"] = ca_path  # crossbar's default TLS policy: platform trust
            self.addCleanup(lambda: os.environ.__setitem__("SSL_CERT_FILE", old) if old is not None
                            else os.environ.pop("SSL_CERT_FILE", None))
            endpoint = SSL4ServerEndpoint(reactor, port, options, interface=interface or
                                          ("::1" if family == "6" else "127.0.0.1"))
        elif family == "6":
            endpoint = TCP6ServerEndpoint(reactor, port, interface="::1")
        else:
            endpoint = TCP4ServerEndpoint(reactor, port, interface=interface or "127.0.0.1")
        try:
            listening: IListeningPort = await endpoint.listen(site)
        except CannotListenError as e:
            if port and isinstance(e.socketError, OSError) and e.socketError.errno in (errno.EACCES, errno.EADDRINUSE):
                raise SkipTest(f"cannot listen on {interface}:{port} for a default-port URL: {e.socketError}")
            raise
        self.addCleanup(listening.stopListening)
        return listening.getHost().port  # type: ignore[attr-defined, no-any-return]

    async def _check(self, template: str, prefix: bytes, family: str = "4", tls: bool = False,
                     default_port: int = 0) -> None:
        upstream = PrefixedLlama(prefix)
        interface = _default_port_interface() if default_port else ""
        port = await self._serve(upstream, family, tls, default_port, interface)
        url = template.format(port=port, interface=interface)
        self.assertTrue(_config_accepts(url), url)
        service, base = await start_routes(self, {"h": url})
        status = service.table.get("h")
        assert status is not None
        self.assertEqual((status.healthy, status.loaded, status.last_err), (True, ("tiny-a",), ""), url)
        self.assertEqual(upstream.raw[:2], [prefix + b"/health", prefix + b"/v1/models"], url)
        crossbar_port = int(base.rsplit(":", 1)[1])
        body = json.dumps({"model": "tiny-a", "messages": []}).encode()
        data, _ = await raw_exchange(crossbar_port, post_bytes(b"/r/v1/chat/completions?q=%7E&x=a/b", body))
        [response] = parse_responses(data)
        self.assertEqual(response.status, 200, (url, response.body))
        self.assertEqual([s.uri for s in upstream_requests(upstream)], [b"/v1/chat/completions?q=%7E&x=a/b"], url)
        self.assertEqual(upstream.raw[-1], prefix + b"/v1/chat/completions?q=%7E&x=a/b", url)
        self.assertEqual(upstream.outside, [], url)

    def test_ipv4_literal(self) -> Any:
        return ensureDeferred(self._check("http://127.0.0.1:{port}", b""))

    def test_ipv4_literal_trailing_slash(self) -> Any:
        return ensureDeferred(self._check("http://127.0.0.1:{port}/", b""))

    def test_name(self) -> Any:
        return ensureDeferred(self._check("http://localhost:{port}", b""))

    def test_name_upper_case(self) -> Any:
        return ensureDeferred(self._check("http://LocalHost:{port}/", b""))

    def test_ipv6_literal(self) -> Any:
        """Failed before: treq (hyperlink) refuses ``[::1]``: the poll never passed."""
        return ensureDeferred(self._check("http://[::1]:{port}", b"", family="6"))

    def test_ipv6_literal_base_path(self) -> Any:
        return ensureDeferred(self._check("http://[::1]:{port}/llama/", b"/llama", family="6"))

    def test_base_path(self) -> Any:
        return ensureDeferred(self._check("http://127.0.0.1:{port}/llama", b"/llama"))

    def test_base_path_trailing_slash(self) -> Any:
        return ensureDeferred(self._check("http://127.0.0.1:{port}/llama/", b"/llama"))

    def test_nested_base_path_by_name(self) -> Any:
        return ensureDeferred(self._check("http://localhost:{port}/a/b", b"/a/b"))

    def test_percent_encoded_base_path(self) -> Any:
        return ensureDeferred(self._check("http://127.0.0.1:{port}/ll%7Ema/a%2Fb", b"/ll%7Ema/a%2Fb"))

    def test_base_path_with_characters_libraries_reencode(self) -> Any:
        """Failed before: the poll went to ``/m%5B1%5D%7Cx`` while requests went to
        ``/m[1]|x``."""
        return ensureDeferred(self._check("http://127.0.0.1:{port}/m[1]|x", b"/m[1]|x"))

    def test_default_port(self) -> Any:
        return ensureDeferred(self._check("http://{interface}/llama", b"/llama", default_port=80))

    def test_explicit_default_port(self) -> Any:
        return ensureDeferred(self._check("http://{interface}:80", b"", default_port=80))

    def test_https_name(self) -> Any:
        return ensureDeferred(self._check("https://localhost:{port}", b"", tls=True))

    def test_https_ipv4_base_path(self) -> Any:
        return ensureDeferred(self._check("https://127.0.0.1:{port}/llama/", b"/llama", tls=True))

    def test_https_ipv6(self) -> Any:
        return ensureDeferred(self._check("https://[::1]:{port}/v", b"/v", family="6", tls=True))

    def test_https_default_port(self) -> Any:
        return ensureDeferred(self._check("https://{interface}/llama", b"/llama", tls=True, default_port=443))


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


if not _has_ipv6_loopback():
    for _name in ("test_ipv6_literal", "test_ipv6_literal_base_path", "test_https_ipv6"):
        setattr(getattr(LoopbackFormTests, _name), "skip", "this machine has no IPv6 loopback (::1)")
