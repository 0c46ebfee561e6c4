"""CappedRequest peeks the body as it arrives (docs/design.md §The proxy rule 4, §"Quality
bar"): ``request.peeked`` is right once the body is complete, whether it came with a
Content-Length or chunked, in one piece or many. Real loopback sockets."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from crossbar.proxy.peek import Peeked, peek
from crossbar.proxy.request import CappedRequest
from tests.raw import parse_responses, raw_exchange, request_bytes
from tests.test_request_body import chunked


class _Recorder(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bytes, Peeked, int]] = []

    def render(self, request: Any) -> bytes:
        self.seen.append((request.method, request.peeked, sum(len(c) for c in request.body_chunks)))
        return b"ok"


class RequestPeekTests(TestCase):
    async def serve(self) -> tuple[_Recorder, int]:
        recorder = _Recorder()
        site = Site(recorder, requestFactory=CappedRequest)
        site.noisy = False
        port: Any = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
        self.addCleanup(port.stopListening)
        return recorder, port.getHost().port

    async def send(self, port: int, method: bytes, headers: list[tuple[bytes, bytes]], *pieces: bytes) -> None:
        data, _ = await raw_exchange(port, request_bytes(method, b"/r/v1/chat/completions", headers), *pieces)
        self.assertEqual([r.status for r in parse_responses(data)], [200], data[:200])

    def test_content_length_and_chunked(self) -> object:
        async def go() -> None:
            recorder, port = await self.serve()
            doc = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}],
                              "pad": "p" * 300000}).encode()
            want = peek(doc)
            self.assertEqual(want.model, "m1")
            self.assertIsNotNone(want.affinity_key)
            length = [(b"Content-Length", str(len(doc)).encode())]
            await self.send(port, b"POST", length, doc)
            await self.send(port, b"POST", length, doc[:1000], doc[1000:200000], doc[200000:])
            await self.send(port, b"POST", [(b"Transfer-Encoding", b"chunked")], chunked(doc, 4096))
            await self.send(port, b"PUT", [(b"Transfer-Encoding", b"chunked")], chunked(doc, 65536))
            self.assertEqual(recorder.seen, [(b"POST", want, len(doc))] * 3 + [(b"PUT", want, len(doc))])

        return ensureDeferred(go())

    def test_no_peek_for_get_head_and_non_json(self) -> object:
        async def go() -> None:
            recorder, port = await self.serve()
            doc = b'{"model": "m1"}'
            length = [(b"Content-Length", str(len(doc)).encode())]
            await self.send(port, b"GET", length, doc)
            await self.send(port, b"POST", [(b"Content-Length", b"9")], b"not json!")
            await self.send(port, b"POST", [])
            nothing = Peeked(None, None)
            self.assertEqual(recorder.seen, [(b"GET", nothing, len(doc)), (b"POST", nothing, 9), (b"POST", nothing, 0)])

        return ensureDeferred(go())
