"""Headers in both directions (docs/design.md §The proxy, rule 6), on real loopback sockets."""

from __future__ import annotations

import gzip
import json
from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase
from twisted.web.http_headers import Headers
from twisted.web.server import Request

from crossbar.proxy.headers import HOP_BY_HOP, hop_by_hop_names
from tests.harness import two_hosts, upstream_requests
from tests.logs import LogCapture
from tests.raw import complete, parse_responses, raw_exchange, request_bytes

SECRET = b"sk-very-secret-4f1c9a"


class HopByHopNamesTests(TestCase):
    def test_fixed_list(self) -> None:
        self.assertEqual(
            HOP_BY_HOP,
            {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
             b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"},
        )

    def test_connection_names(self) -> None:
        headers = Headers({b"Connection": [b"keep-alive , X-Hop-A", b"x-hop-b,,"]})
        names = hop_by_hop_names(headers)
        self.assertTrue({b"x-hop-a", b"x-hop-b", b"keep-alive"} <= names)
        self.assertNotIn(b"", names)
        self.assertTrue(HOP_BY_HOP <= names)


def respond_with_headers(request: Request, body: bytes) -> bytes:
    h = request.responseHeaders
    h.setRawHeaders(b"Set-Cookie", [b"a=1; Path=/", b"b=2; Path=/"])
    h.setRawHeaders(b"Connection", [b"X-Hop-Resp"])
    h.setRawHeaders(b"X-Hop-Resp", [b"1"])
    h.setRawHeaders(b"Keep-Alive", [b"timeout=5"])
    h.setRawHeaders(b"Proxy-Authenticate", [b"Basic realm=x"])
    h.setRawHeaders(b"Trailer", [b"X-T"])
    h.setRawHeaders(b"Upgrade", [b"h2c"])
    h.setRawHeaders(b"X-Custom", [b"one", b"two"])
    h.setRawHeaders(b"Content-Type", [b"text/plain; charset=utf-8"])
    return b"plain answer"


class HeaderTests(TestCase):
    def test_request_headers_upstream(self) -> object:
        async def go() -> None:
            log = LogCapture(self)
            hosts = await two_hosts(self)
            sent = [
                (b"Connection", b"keep-alive , X-Hop-Req"),
                (b"X-Hop-Req", b"drop me"),
                (b"Keep-Alive", b"timeout=5"),
                (b"TE", b"trailers"),
                (b"Trailer", b"X-T"),
                (b"Upgrade", b"websocket"),
                (b"Proxy-Authorization", b"Basic cHJveHk6cHc="),
                (b"Proxy-Connection", b"keep-alive"),
                (b"X-Foo", b"1"),
                (b"X-Foo", b"2"),
                (b"X-Forwarded-For", b"6.6.6.6"),
                (b"X-Forwarded-Host", b"evil.test"),
                (b"X-Forwarded-Proto", b"https"),
                (b"Forwarded", b"for=6.6.6.6;proto=https"),
                (b"Authorization", b"Bearer " + SECRET),
                (b"Accept-Encoding", b"gzip, br"),
                (b"Content-Type", b"application/json"),
                (b"Content-Length", b"21"),
            ]
            data, _ = await raw_exchange(hosts.port, request_bytes(
                b"POST", b"/r/v1/chat/completions?k=" + SECRET, sent, b'{"model": "model-a"}\n', close=False),
                until=complete)
            [response] = parse_responses(data, at_eof=False)
            self.assertEqual(response.status, 200)
            [seen] = upstream_requests(hosts.a)
            h: Headers = seen.headers
            for name in (b"x-hop-req", b"keep-alive", b"te", b"trailer", b"upgrade", b"proxy-authorization",
                         b"proxy-connection", b"forwarded", b"transfer-encoding"):
                self.assertIsNone(h.getRawHeaders(name), name)
            for value in h.getRawHeaders(b"connection", []):
                self.assertNotIn(b"hop", value.lower())
            self.assertEqual(h.getRawHeaders(b"x-foo"), [b"1", b"2"])
            self.assertEqual(h.getRawHeaders(b"host"), [hosts.service.config.hosts["a"].url.url[len("http://"):].encode()])
            self.assertEqual(h.getRawHeaders(b"x-forwarded-for"), [b"127.0.0.1"])
            self.assertEqual(h.getRawHeaders(b"x-forwarded-host"), [b"crossbar.test"])
            self.assertEqual(h.getRawHeaders(b"x-forwarded-proto"), [b"http"])
            self.assertEqual(h.getRawHeaders(b"authorization"), [b"Bearer " + SECRET])
            self.assertEqual(h.getRawHeaders(b"accept-encoding"), [b"gzip, br"])
            self.assertEqual(h.getRawHeaders(b"content-type"), [b"application/json"])
            self.assertEqual(h.getRawHeaders(b"content-length"), [b"21"])
            self.assertEqual(seen.uri, b"/v1/chat/completions?k=" + SECRET)
            self.assertTrue(log.proxied())
            log.assert_never_contains(self, SECRET)

        return ensureDeferred(go())

    def test_response_headers_back(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            hosts.b.handlers[b"/v1/hdr"] = respond_with_headers
            data, _ = await raw_exchange(hosts.port, request_bytes(b"GET", b"/r/v1/hdr"))
            [response] = parse_responses(data)
            self.assertEqual(response.status, 200)
            self.assertEqual(response.body, b"plain answer")
            self.assertEqual(response.get(b"set-cookie"), [b"a=1; Path=/", b"b=2; Path=/"])
            self.assertEqual(response.get(b"x-custom"), [b"one", b"two"])
            for name in (b"x-hop-resp", b"keep-alive", b"proxy-authenticate", b"trailer", b"upgrade"):
                self.assertEqual(response.get(name), [], name)
            for value in response.get(b"connection"):
                self.assertNotIn(b"hop", value.lower())
            self.assertEqual(response.get(b"content-type"), [b"text/plain; charset=utf-8"])
            self.assertEqual(response.get(b"x-crossbar-host"), [b"b"])
            self.assertEqual(response.get(b"content-length"), [b"12"])
            self.assertEqual(len(response.get(b"server")), 1)  # the upstream's, relayed; none added

        return ensureDeferred(go())

    def test_sse_headers_relayed(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            body = json.dumps({"model": "model-b", "stream": True}).encode()
            data, _ = await raw_exchange(hosts.port, request_bytes(
                b"POST", b"/r/v1/chat/completions", [(b"Content-Length", str(len(body)).encode())], body))
            [response] = parse_responses(data)
            self.assertEqual(response.status, 200)
            self.assertEqual(response.get(b"content-type"), [b"text/event-stream"])
            self.assertEqual(response.get(b"cache-control"), [b"no-cache"])
            self.assertEqual(response.get(b"x-accel-buffering"), [b"no"])
            self.assertTrue(response.chunked)
            self.assertEqual(response.get(b"content-encoding"), [])
            self.assertTrue(response.body.endswith(b"data: [DONE]\n\n"))
            self.assertEqual(response.body.count(b"data: "), hosts.b.events + 1)

        return ensureDeferred(go())

    def test_no_compression_added(self) -> object:
        payload = json.dumps({"text": "compress me " * 500}).encode()
        packed = gzip.compress(payload, mtime=0)

        def gzipped(request: Request, body: bytes) -> bytes:
            request.setHeader(b"Content-Encoding", b"gzip")
            request.setHeader(b"Content-Type", b"application/json")
            return packed

        def gzipped_chunked(request: Request, body: bytes) -> Any:
            request.setHeader(b"Content-Encoding", b"gzip")
            request.write(packed[:100])
            request.write(packed[100:])
            request.finish()
            from twisted.web.server import NOT_DONE_YET
            return NOT_DONE_YET

        def plain(request: Request, body: bytes) -> bytes:
            request.setHeader(b"Content-Type", b"application/json")
            return payload

        async def go() -> None:
            hosts = await two_hosts(self)
            hosts.b.handlers.update({b"/v1/gz": gzipped, b"/v1/gzc": gzipped_chunked, b"/v1/plain": plain})
            accept = [(b"Accept-Encoding", b"gzip, deflate, br")]
            for path, chunked in ((b"/v1/gz", False), (b"/v1/gzc", True)):
                data, _ = await raw_exchange(hosts.port, request_bytes(b"GET", b"/r" + path, accept))
                [response] = parse_responses(data)
                self.assertEqual(response.body, packed, path)
                self.assertEqual(response.chunked, chunked, path)
                self.assertEqual(response.get(b"content-encoding"), [b"gzip"])
                self.assertEqual(gzip.decompress(response.body), payload)
                self.assertEqual(upstream_requests(hosts.b)[-1].headers.getRawHeaders(b"accept-encoding"),
                                 [b"gzip, deflate, br"])
            data, _ = await raw_exchange(hosts.port, request_bytes(b"GET", b"/r/v1/plain", accept))
            [response] = parse_responses(data)
            self.assertEqual(response.body, payload)
            self.assertEqual(response.get(b"content-encoding"), [])
            self.assertEqual(response.get(b"content-length"), [str(len(payload)).encode()])

        return ensureDeferred(go())
