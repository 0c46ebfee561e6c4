"""Model names and paths through a real crossbar over fake hosts (docs/design.md §The
proxy rules 3-4, §Model names): aliases choose the target's host, a GET's ``model``
query parameter chooses too (and is rewritten), the forbidden list is 403 and no host
sees it, llama.cpp's native endpoints are forwarded, other paths are 404."""

from __future__ import annotations

import json

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

from tests.harness import FakeLlama, listen, port_of, start_crossbar, upstream_requests
from tests.raw import parse_responses, raw_exchange, request_bytes

FORBIDDEN = [
    (b"GET", b"/slots"), (b"POST", b"/slots/0?action=save"), (b"GET", b"/v1/slots"), (b"GET", b"//slots"),
    (b"GET", b"/%73lots"), (b"POST", b"/models/load"), (b"POST", b"/v1/models/unload"), (b"GET", b"/models/sse"),
    (b"POST", b"/models"), (b"POST", b"/props"), (b"POST", b"/lora-adapters"), (b"GET", b"/metrics"),
    (b"GET", b"/v1/metrics"), (b"POST", b"/tools"), (b"GET", b"/cors-proxy"),
]
NATIVE_POST = [b"/completion", b"/completions", b"/infill", b"/tokenize", b"/detokenize", b"/embedding",
               b"/embeddings", b"/rerank", b"/reranking", b"/apply-template", b"/chat/completions", b"/responses",
               b"/score", b"/extra/x/y"]


class Fleet:
    def __init__(self, a: FakeLlama, b: FakeLlama, port: int) -> None:
        self.a, self.b, self.port = a, b, port

    async def send(self, method: bytes, target: bytes, body: bytes = b"") -> tuple[int, bytes, bytes | None]:
        headers = [(b"Content-Length", str(len(body)).encode()), (b"Content-Type", b"application/json")] if method not in (b"GET", b"HEAD") else []
        data, _ = await raw_exchange(self.port, request_bytes(method, target, headers, body))
        [response] = parse_responses(data)
        return response.status, response.body, response.one(b"x-crossbar-host")


async def fleet(case: TestCase) -> Fleet:
    a, b = FakeLlama(["model-a"]), FakeLlama(["model-b"])
    url_a, url_b = await listen(case, a), await listen(case, b)
    service, base = await start_crossbar(case, f"""\
health: {{interval: 60, timeout: 5}}
hosts:
  a: {url_a}
  b: {url_b}
routes:
  r:
    hosts: [b, a]
    default_model: model-b
    paths: [/score, /extra/]
    aliases:
      gpt-4o: model-a
      "claude-*": model-a
""")
    await service.poller.when_first_round_done()
    return Fleet(a, b, port_of(base))


class ModelNameTests(TestCase):
    def test_alias_chooses_the_targets_host(self) -> object:
        async def go() -> None:
            f = await fleet(self)
            for name in ("gpt-4o", "claude-sonnet-4-5", "claude-3-haiku"):
                body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]}).encode()
                status, _, host = await f.send(b"POST", b"/r/v1/chat/completions", body)
                self.assertEqual((status, host), (200, b"a"), name)
            status, _, host = await f.send(b"POST", b"/r/v1/chat/completions", b'{"model": "model-b"}')
            self.assertEqual((status, host), (200, b"b"))

        return ensureDeferred(go())

    def test_get_takes_the_model_from_the_query_and_rewrites_an_alias(self) -> object:
        async def go() -> None:
            f = await fleet(self)
            status, _, host = await f.send(b"GET", b"/r/props?model=gpt-4o&autoload=false")
            self.assertEqual(host, b"a")
            self.assertEqual(upstream_requests(f.a)[-1].uri, b"/props?model=model-a&autoload=false")
            status, _, host = await f.send(b"GET", b"/r/props?autoload=false&model=model-b")
            self.assertEqual(host, b"b")
            self.assertEqual(upstream_requests(f.b)[-1].uri, b"/props?autoload=false&model=model-b")

        return ensureDeferred(go())


class PathTests(TestCase):
    def test_forbidden_paths_are_403_and_reach_no_host(self) -> object:
        async def go() -> None:
            f = await fleet(self)
            before = len(f.a.seen) + len(f.b.seen)
            for method, rest in FORBIDDEN:
                status, body, host = await f.send(method, b"/r" + rest, b"{}" if method == b"POST" else b"")
                self.assertEqual((status, json.loads(body), host), (403, {"error": "forbidden path"}, None), rest)
            self.assertEqual(len(f.a.seen) + len(f.b.seen), before)

        return ensureDeferred(go())

    def test_native_endpoints_and_route_paths_are_forwarded(self) -> object:
        async def go() -> None:
            f = await fleet(self)
            for rest in NATIVE_POST:
                status, _, host = await f.send(b"POST", b"/r" + rest, b'{"input_prefix": "x"}')
                self.assertEqual(host, b"b", rest)
                self.assertEqual(upstream_requests(f.b)[-1].uri, rest)
            for rest in (b"/health", b"/props", b"/lora-adapters", b"/v1/models/model-b"):
                status, _, host = await f.send(b"GET", b"/r" + rest)
                self.assertEqual(host, b"b", rest)
            for method, rest in ((b"POST", b"/health"), (b"GET", b"/slotsx"), (b"POST", b"/infill/x"),
                                 (b"POST", b"/extra"), (b"GET", b"/models/model-b")):
                status, body, host = await f.send(method, b"/r" + rest, b"{}" if method == b"POST" else b"")
                self.assertEqual((status, json.loads(body)), (404, {"error": "not found"}), rest)

        return ensureDeferred(go())

    def test_models_is_the_route_model_list(self) -> object:
        async def go() -> None:
            f = await fleet(self)
            for rest in (b"/models", b"/v1/models"):
                status, body, host = await f.send(b"GET", b"/r" + rest)
                self.assertEqual((status, host), (200, None))
                ids = [e["id"] for e in json.loads(body)["data"]]
                self.assertEqual(ids, ["gpt-4o", "model-a", "model-b"])

        return ensureDeferred(go())
