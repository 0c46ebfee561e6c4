"""Request bodies (docs/design.md §The proxy, rule 4): the 16 MiB cap refused early, chunked
bodies cut off at the limit or forwarded with a Content-Length. Raw loopback sockets, so
exactly the bytes a client would send are sent."""

from __future__ import annotations

import json
import time

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

from crossbar.proxy import request as request_module
from crossbar.proxy.request import MAX_BODY
from tests.harness import TwoHosts, two_hosts, upstream_requests
from tests.raw import parse_responses, raw_exchange, request_bytes

TARGET = b"/r/v1/chat/completions"


def chunked(body: bytes, size: int) -> bytes:
    """``body`` in the chunked transfer coding, ``size`` bytes a chunk."""
    out = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"".join(out) + b"0\r\n\r\n"


class BodyLimitTests(TestCase):
    def setUp(self) -> None:
        self.patch(request_module, "_LINGER_SECONDS", 1.0)

    async def assert_413(self, data: bytes) -> None:
        responses = parse_responses(data)
        self.assertEqual([r.status for r in responses], [413], data[:300])
        [response] = responses
        self.assertEqual(json.loads(response.body), {"error": {"code": 413, "message": "body too large", "type": "invalid_request_error"}})
        self.assertEqual(response.one(b"content-type"), b"application/json")
        self.assertEqual(response.one(b"connection"), b"close")

    async def assert_serving(self, hosts: TwoHosts) -> None:
        data, _ = await raw_exchange(hosts.port, request_bytes(
            b"POST", TARGET, [(b"Content-Length", b"2")], b"{}"))
        [response] = parse_responses(data)
        self.assertEqual(response.status, 200)

    def test_content_length_over_limit_refused_before_the_body(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            head = request_bytes(b"POST", TARGET, [(b"Content-Length", str(MAX_BODY + 1).encode())], close=False)
            data, how = await raw_exchange(hosts.port, head)  # headers only: no body byte is ever sent
            self.assertEqual(how, "half-close")
            await self.assert_413(data)
            self.assertEqual(upstream_requests(hosts.a) + upstream_requests(hosts.b), [])
            await self.assert_serving(hosts)

        return ensureDeferred(go())

    def test_expect_100_continue_gets_no_100(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            head = request_bytes(b"POST", TARGET, [
                (b"Content-Length", b"%d" % (MAX_BODY * 4)), (b"Expect", b"100-continue")], close=False)
            data, _ = await raw_exchange(hosts.port, head)
            self.assertTrue(data.startswith(b"HTTP/1.1 413 "), data[:100])
            await self.assert_413(data)
            # Within the limit, the 100 Continue is still sent (the body is wanted).
            head = request_bytes(b"POST", TARGET, [(b"Content-Length", b"2"), (b"Expect", b"100-continue")])
            data, _ = await raw_exchange(hosts.port, head, until=lambda d: b"\r\n\r\n" in d)
            self.assertTrue(data.startswith(b"HTTP/1.1 100 "), data[:100])
            await self.assert_serving(hosts)

        return ensureDeferred(go())

    def test_client_still_sending_reads_the_413(self) -> object:
        """The client sends all of a 40 MiB body: crossbar half-closes and drains what
        still arrives, so the client reads the 413 rather than a connection reset."""

        async def go() -> None:
            hosts = await two_hosts(self)
            size = MAX_BODY + 24 * 1024 * 1024
            head = request_bytes(b"POST", TARGET, [(b"Content-Length", str(size).encode())], close=False)
            data, how = await raw_exchange(hosts.port, head, b"x" * size)
            self.assertIn(how, ("half-close", "close"))
            await self.assert_413(data)
            await self.assert_serving(hosts)

        return ensureDeferred(go())

    def test_linger_ends_a_connection_that_keeps_sending(self) -> object:
        """A client that reads the 413 but never closes is cut off after the linger."""

        async def go() -> None:
            hosts = await two_hosts(self)
            head = request_bytes(b"POST", TARGET, [(b"Transfer-Encoding", b"chunked")], close=False)
            started = time.monotonic()
            data, how = await raw_exchange(hosts.port, head, chunked(b"y" * (MAX_BODY + 1), 1 << 20)[:-5],
                                           wait_close=True, timeout=20, trickle=b"1\r\ny\r\n")
            elapsed = time.monotonic() - started
            self.assertEqual(how, "close")
            await self.assert_413(data)
            self.assertGreater(elapsed, 0.9)  # the linger (patched to 1 s) ran first
            self.assertLess(elapsed, 15)
            await self.assert_serving(hosts)

        return ensureDeferred(go())

    def test_chunked_over_limit_cut_off(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            head = request_bytes(b"POST", TARGET, [(b"Transfer-Encoding", b"chunked")], close=False)
            # One byte over the limit, in 1 MiB chunks: refused at the crossing chunk.
            data, _ = await raw_exchange(hosts.port, head, chunked(b"z" * (MAX_BODY + 1), 1 << 20))
            await self.assert_413(data)
            # An endless chunked body is cut off too (only ~17 MiB of it is ever sent).
            data, _ = await raw_exchange(hosts.port, head, chunked(b"z" * (MAX_BODY + (1 << 20)), 1 << 16)[:-5])
            await self.assert_413(data)
            self.assertEqual(upstream_requests(hosts.a) + upstream_requests(hosts.b), [])
            await self.assert_serving(hosts)

        return ensureDeferred(go())

    def test_chunked_within_limit_forwarded_with_content_length(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            doc = json.dumps({"model": "model-a", "pad": "p" * 100000}).encode()
            head = request_bytes(b"POST", TARGET, [(b"Transfer-Encoding", b"chunked")])
            data, _ = await raw_exchange(hosts.port, head, chunked(doc, 4096))
            [response] = parse_responses(data)
            self.assertEqual((response.status, response.one(b"x-crossbar-host")), (200, b"a"))
            seen = upstream_requests(hosts.a)[-1]
            self.assertEqual(seen.body, doc)
            self.assertEqual(seen.headers.getRawHeaders(b"content-length"), [str(len(doc)).encode()])
            self.assertIsNone(seen.headers.getRawHeaders(b"transfer-encoding"))

            # Exactly the limit, chunked and with Content-Length: accepted.
            body = b"q" * MAX_BODY
            data, _ = await raw_exchange(hosts.port, head, chunked(body, 1 << 20), timeout=30)
            [response] = parse_responses(data)
            self.assertEqual(response.status, 200)
            seen = upstream_requests(hosts.b)[-1]
            self.assertEqual(len(seen.body), MAX_BODY)
            self.assertEqual(seen.headers.getRawHeaders(b"content-length"), [str(MAX_BODY).encode()])
            self.assertIsNone(seen.headers.getRawHeaders(b"transfer-encoding"))
            data, _ = await raw_exchange(hosts.port, request_bytes(
                b"POST", TARGET, [(b"Content-Length", str(MAX_BODY).encode())], body), timeout=30)
            self.assertEqual(parse_responses(data)[0].status, 200)
            self.assertEqual(len(upstream_requests(hosts.b)[-1].body), MAX_BODY)
            await self.assert_serving(hosts)

        return ensureDeferred(go())
