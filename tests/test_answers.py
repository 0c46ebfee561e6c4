"""Answers (docs/design.md §The proxy, rules 6-7): bodiless answers stay bodiless, upstream
errors are relayed as they are and mark nothing, framing follows the upstream's."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request

from tests.harness import two_hosts, upstream_requests
from tests.raw import parse_responses, raw_exchange, request_bytes


def no_content(request: Request, body: bytes) -> bytes:
    request.setResponseCode(204)
    request.setHeader(b"X-Kept", b"204")
    return b""


def not_modified(request: Request, body: bytes) -> bytes:
    request.setResponseCode(304)
    request.setHeader(b"ETag", b'"v1"')
    return b""


def overloaded(request: Request, body: bytes) -> bytes:
    request.setResponseCode(503, b"Busy Here")
    request.setHeader(b"Content-Type", b"application/json")
    request.setHeader(b"Retry-After", b"7")
    return b'{"error": {"code": 503, "message": "Loading model"}}'


def bad_request_chunked(request: Request, body: bytes) -> Any:
    request.setResponseCode(400)
    request.setHeader(b"Content-Type", b"application/json")
    request.write(b'{"error": ')
    request.write(b'"bad"}')
    request.finish()
    return NOT_DONE_YET


def listing(request: Request, body: bytes) -> bytes:
    """What FakeLlama answers on /v1/models, on another path the proxy forwards."""
    request.setHeader(b"content-type", b"application/json")
    return b'{"object": "list", "data": [{"id": "model-b"}]}'


class AnswerTests(TestCase):
    def test_head_204_304_carry_no_body(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            hosts.b.handlers.update({b"/v1/nc": no_content, b"/v1/nm": not_modified, b"/v1/listing": listing})
            # (GET/HEAD /r/v1/models is answered by crossbar itself: rule 10.)
            data, _ = await raw_exchange(hosts.port, request_bytes(b"HEAD", b"/r/v1/listing"))
            # Strict parse: any byte after the head would be a second, broken response.
            [response] = parse_responses(data, head=True)
            self.assertEqual(response.status, 200)
            self.assertEqual(hosts.b.seen[-1].method, b"HEAD")
            # The upstream's Content-Length for the GET it describes is relayed, not 0.
            self.assertEqual(response.get(b"content-length"), [str(len(b'{"object": "list", "data": [{"id": "model-b"}]}')).encode()])
            self.assertEqual(response.get(b"transfer-encoding"), [])
            for path, code in ((b"/r/v1/nc", 204), (b"/r/v1/nm", 304)):
                for method in (b"GET", b"POST"):
                    data, _ = await raw_exchange(hosts.port, request_bytes(
                        method, path, [(b"Content-Length", b"2")] if method == b"POST" else [],
                        b"{}" if method == b"POST" else b""))
                    [response] = parse_responses(data)
                    self.assertEqual(response.status, code)
                    self.assertTrue(data.endswith(b"\r\n\r\n"), data)  # nothing after the head
                    self.assertEqual(response.get(b"transfer-encoding"), [])
                    self.assertEqual(response.get(b"content-length"), [])
            self.assertEqual(response.get(b"etag"), [b'"v1"'])

        return ensureDeferred(go())

    def test_upstream_errors_relayed_and_nothing_marked_down(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            hosts.b.handlers.update({b"/v1/busy": overloaded, b"/v1/bad": bad_request_chunked})
            data, _ = await raw_exchange(hosts.port, request_bytes(b"GET", b"/r/v1/busy"))
            [response] = parse_responses(data)
            self.assertEqual((response.status, response.reason), (503, b"Busy Here"))
            self.assertEqual(response.body, b'{"error": {"code": 503, "message": "Loading model"}}')
            self.assertEqual(response.get(b"retry-after"), [b"7"])
            self.assertEqual(response.get(b"content-type"), [b"application/json"])
            self.assertEqual(response.get(b"content-length"), [str(len(response.body)).encode()])
            self.assertFalse(response.chunked)
            data, _ = await raw_exchange(hosts.port, request_bytes(b"GET", b"/r/v1/bad"))
            [response] = parse_responses(data)
            self.assertEqual((response.status, response.body), (400, b'{"error": "bad"}'))
            self.assertTrue(response.chunked)
            data, _ = await raw_exchange(hosts.port, request_bytes(b"GET", b"/r/v1/nothing-here"))
            [response] = parse_responses(data)
            self.assertEqual((response.status, response.body), (404, b'{"error":"not found"}'))
            status = hosts.service.table.get("b")
            assert status is not None
            self.assertTrue(status.healthy)
            self.assertEqual(status.last_err, "")

        return ensureDeferred(go())

    def test_framing_follows_upstream(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            data, _ = await raw_exchange(hosts.port, request_bytes(
                b"POST", b"/r/v1/chat/completions", [(b"Content-Length", b"2")], b"{}"))
            [response] = parse_responses(data)
            self.assertFalse(response.chunked)
            self.assertEqual(response.get(b"content-length"), [str(len(response.body)).encode()])
            body = b'{"stream": true}'
            data, _ = await raw_exchange(hosts.port, request_bytes(
                b"POST", b"/r/v1/chat/completions", [(b"Content-Length", b"%d" % len(body))], body))
            [response] = parse_responses(data)
            self.assertTrue(response.chunked)
            self.assertEqual(response.get(b"content-length"), [])

        return ensureDeferred(go())
