"""Issue 11 item 8: a GET or HEAD that carries a body has it forwarded unchanged
(docs/design.md §The proxy, rule 6), whether the client framed it with ``Content-Length``
or chunked; a GET without a body gets no framing header upstream."""

from __future__ import annotations

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

from tests.harness import FakeLlama, Seen, listen, port_of, start_routes, upstream_requests
from tests.raw import parse_responses, raw_exchange, request_bytes

BODY = b'{"model": "tiny-a", "why": "a GET with a body"}'


class GetBodyTests(TestCase):
    timeout = 30

    async def _through(self, method: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Seen:
        """Send one raw request to route ``r`` and return what the upstream saw."""
        upstream = FakeLlama()
        _, base = await start_routes(self, {"a": await listen(self, upstream)})
        data, _ = await raw_exchange(port_of(base), request_bytes(method, b"/r/v1/chat/completions", headers, body))
        [answer] = parse_responses(data, head=method == b"HEAD")
        self.assertEqual(answer.status, 200, data)
        [seen] = upstream_requests(upstream)
        self.assertEqual(seen.method, method)
        return seen

    def _assert_forwarded(self, seen: Seen) -> None:
        self.assertEqual(seen.body, BODY)
        self.assertEqual(seen.headers.getRawHeaders(b"content-length"), [b"%d" % len(BODY)])
        self.assertIsNone(seen.headers.getRawHeaders(b"transfer-encoding"))

    def test_get_with_content_length_body(self) -> object:
        async def go() -> None:
            seen = await self._through(b"GET", [(b"Content-Length", b"%d" % len(BODY))], BODY)
            self._assert_forwarded(seen)

        return ensureDeferred(go())

    def test_get_with_chunked_body(self) -> object:
        async def go() -> None:
            chunked = b"%x\r\n" % 10 + BODY[:10] + b"\r\n" + b"%x\r\n" % len(BODY[10:]) + BODY[10:] + b"\r\n0\r\n\r\n"
            seen = await self._through(b"GET", [(b"Transfer-Encoding", b"chunked")], chunked)
            self._assert_forwarded(seen)

        return ensureDeferred(go())

    def test_head_with_content_length_body(self) -> object:
        async def go() -> None:
            seen = await self._through(b"HEAD", [(b"Content-Length", b"%d" % len(BODY))], BODY)
            self._assert_forwarded(seen)

        return ensureDeferred(go())

    def test_get_without_body_has_no_framing_upstream(self) -> object:
        async def go() -> None:
            seen = await self._through(b"GET", [], b"")
            self.assertEqual(seen.body, b"")
            self.assertIsNone(seen.headers.getRawHeaders(b"content-length"))
            self.assertIsNone(seen.headers.getRawHeaders(b"transfer-encoding"))

        return ensureDeferred(go())
