"""Model names and paths through a real crossbar over fake hosts (docs/design.md §The
proxy rules 3-4, §Model names): aliases choose the target's host, a GET's ``model``
query parameter chooses too (and is rewritten), the forbidden list is 403 and no host
sees it, llama.cpp's native endpoints are forwarded, other paths are 404."""

from __future__ import annotations

import hashlib
import json

from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred, maybeDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IListeningPort
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Request, Site

from crossbar.config import parse_config
from crossbar.proxy.head import RequestHead, upstream_body, wanted_model
from crossbar.proxy.peek import peek
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
                self.assertEqual((status, json.loads(body), host), (403, {"error": {"code": 403, "message": "forbidden path", "type": "permission_error"}}, None), rest)
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
                self.assertEqual((status, json.loads(body)), (404, {"error": {"code": 404, "message": "not found", "type": "invalid_request_error"}}), rest)

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


_NAMES_CONFIG = """\
listen: tcp:1
hosts: {a: http://h}
routes:
  r:
    hosts: [a]
    default_model: model-b
    aliases: {gpt-4o: model-a, "claude-*": model-a}
"""


def _head(chunks: list[bytes]) -> RequestHead:
    config = parse_config(_NAMES_CONFIG, "x.yaml", environ={})
    head = RequestHead.parse(config, b"POST", b"/r/v1/chat/completions")
    return head.with_body(chunks, peek(b"".join(chunks)))


def _never() -> bool:
    raise AssertionError("router mode asked of a body that names a model")


class UpstreamBodyTests(SynchronousTestCase):
    """The body a chosen host gets (§"Model names", :func:`crossbar.proxy.head.upstream_body`)."""

    def wanted(self, head: RequestHead) -> str | None:
        assert head.route is not None
        return wanted_model(head, head.route)[0]

    def test_an_alias_is_replaced_in_place_and_other_chunks_pass_as_they_are(self) -> None:
        before, value, after = b'{"messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}], ', \
            b'"model": "gpt-4o"', b', "stream": false, "tail": "' + b"y" * 5000 + b'"}'
        chunks = [before[:3000], before[3000:] + value[:12], value[12:] + after[:10], after[10:3000], after[3000:]]
        head = _head(chunks)
        self.assertEqual(self.wanted(head), "model-a")
        out = upstream_body(head, self.wanted(head), _never)
        assert out is not None
        body = b"".join(chunks)
        self.assertEqual(b"".join(out), body.replace(b'"gpt-4o"', b'"model-a"'))
        self.assertIs(out[0], chunks[0])  # untouched chunks: the same objects, not copies
        self.assertIs(out[-1], chunks[-1])
        self.assertIs(out[-2], chunks[-2])

    def test_a_glob_alias_and_an_escaped_name(self) -> None:
        head = _head([b'{"model":"claude-sonnet-4-5","max_tokens":4}'])
        out = upstream_body(head, self.wanted(head), _never)
        self.assertEqual(b"".join(out or ()), b'{"model":"model-a","max_tokens":4}')
        head = _head([b'{"model": "gpt\\u002d4o", "n": 1}'])  # the same name, spelled with an escape
        self.assertEqual(b"".join(upstream_body(head, self.wanted(head), _never) or ()),
                         b'{"model": "model-a", "n": 1}')

    def test_a_model_that_is_no_alias_is_forwarded_as_it_came(self) -> None:
        chunks = [b'{"model": "model-b", ', b'"messages": []}']
        head = _head(chunks)
        self.assertIs(upstream_body(head, self.wanted(head), _never), head.chunks)

    def test_no_model_gets_the_chosen_model_first_on_a_router_host_only(self) -> None:
        chunks = [b' {"prompt": "hi", ', b'"n_predict": 4}']
        head = _head(chunks)
        model = self.wanted(head)
        self.assertEqual(model, "model-b")  # the route's default_model
        self.assertIs(upstream_body(head, model, lambda: False), head.chunks)
        out = upstream_body(head, model, lambda: True)
        self.assertEqual(b"".join(out or ()), b' {"model": "model-b", "prompt": "hi", "n_predict": 4}')
        self.assertIs((out or [])[-1], chunks[-1])

    def test_an_empty_object_and_an_empty_model_on_a_router_host(self) -> None:
        head = _head([b"{}"])
        self.assertEqual(b"".join(upstream_body(head, self.wanted(head), lambda: True) or ()), b'{"model": "model-b"}')
        head = _head([b'{"model": "", "prompt": "x"}'])
        self.assertEqual(b"".join(upstream_body(head, self.wanted(head), lambda: True) or ()),
                         b'{"model": "model-b", "prompt": "x"}')
        self.assertIs(upstream_body(head, self.wanted(head), lambda: False), head.chunks)

    def test_what_is_not_a_json_object_is_never_touched(self) -> None:
        for body in (b'[{"model": "gpt-4o"}]', b"model=gpt-4o", b'{"model": "gpt-4o"', b'{"model": 4}'):
            head = _head([body])
            self.assertIs(upstream_body(head, "model-a", lambda: True), head.chunks, body)


def router_fake(models: list[str]) -> FakeLlama:
    """A fake host in llama-server's router mode: its model entries carry a ``status``."""
    fake = FakeLlama(models)
    fake.models = {"object": "list", "data": [{"id": m, "status": {"value": "loaded"}} for m in models]}
    return fake


def echo(request: Request, body: bytes) -> bytes:
    """A handler answering the model the host was asked for (as llama-server does)."""
    request.setHeader(b"content-type", b"application/json")
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    return json.dumps({"model": doc.get("model") if isinstance(doc, dict) else None, "content": "ok"}).encode()


class RewriteTests(TestCase):
    """Through a real crossbar: the bytes a host receives (§"Model names")."""

    def test_an_alias_is_rewritten_to_its_target_and_every_other_byte_arrives(self) -> object:
        async def go() -> None:
            f = await fleet(self)
            filler = "".join(chr(0x20 + i % 90) for i in range(300_000)).replace("\\", "/").replace('"', "'")
            for name in ("gpt-4o", "claude-3-haiku"):
                sent = ('{"messages": [{"role": "user", "content": "' + filler + '"}], "model": "' + name
                        + '", "stream": false, "after": "\u00e9t\u00e9 ' + filler[:1000] + '"}').encode()
                status, answer, host = await f.send(b"POST", b"/r/v1/chat/completions", sent)
                self.assertEqual((status, host), (200, b"a"), name)
                self.assertEqual(json.loads(answer)["model"], "model-a")  # the answer, not rewritten
                seen = upstream_requests(f.a)[-1]
                expected = sent.replace(b'"' + name.encode() + b'"', b'"model-a"')
                self.assertEqual(hashlib.sha256(seen.body).hexdigest(), hashlib.sha256(expected).hexdigest())
                self.assertEqual(seen.headers.getRawHeaders(b"content-length"),
                                 [str(len(expected)).encode()])

        return ensureDeferred(go())

    def test_a_body_needing_no_rewrite_arrives_byte_for_byte(self) -> object:
        async def go() -> None:
            f = await fleet(self)
            for sent in (b'{"model": "model-b", "messages": []}', b'{"prompt": "no model", "n_predict": 1}',
                         b'not json {"model": "gpt-4o"}'):
                status, _, host = await f.send(b"POST", b"/r/v1/chat/completions", sent)
                self.assertEqual((status, host), (200, b"b"))
                self.assertEqual(upstream_requests(f.b)[-1].body, sent)

        return ensureDeferred(go())

    def test_a_router_host_gets_the_routes_default_model_written_in(self) -> object:
        async def go() -> None:
            router, single = router_fake(["model-r"]), FakeLlama(["model-s"])
            for fake in (router, single):
                fake.handlers[b"/completion"] = echo
            url_r, url_s = await listen(self, router), await listen(self, single)
            service, base = await start_crossbar(self, f"""\
health: {{interval: 60, timeout: 5}}
hosts: {{rt: {url_r}, s: {url_s}}}
routes:
  router: {{hosts: [rt], default_model: model-r}}
  single: {{hosts: [s], default_model: model-s}}
""")
            await service.poller.when_first_round_done()
            port = port_of(base)
            sent = b'{"prompt": "def f(", "n_predict": 4}'
            for route, fake, expected, model in (
                    (b"router", router, b'{"model": "model-r", "prompt": "def f(", "n_predict": 4}', "model-r"),
                    (b"single", single, sent, None)):
                data, _ = await raw_exchange(port, request_bytes(
                    b"POST", b"/" + route + b"/completion", [(b"Content-Length", str(len(sent)).encode())], sent))
                [response] = parse_responses(data)
                self.assertEqual(response.status, 200, response.body)
                self.assertEqual(upstream_requests(fake)[-1].body, expected)
                self.assertEqual(json.loads(response.body)["model"], model)

        return ensureDeferred(go())

    def test_a_failover_decides_per_host(self) -> object:
        """A router-mode host that cannot be reached: the request fails over to a
        single-model host, which gets the body as the client sent it."""
        async def go() -> None:
            router, single = router_fake(["model-r"]), FakeLlama(["model-s"])
            single.handlers[b"/completion"] = echo
            router_port: IListeningPort = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
                Site(router))
            url_s = await listen(self, single)
            rport = router_port.getHost().port  # type: ignore[attr-defined]
            service, base = await start_crossbar(self, f"""\
health: {{interval: 60, timeout: 5}}
hosts: {{rt: "http://127.0.0.1:{rport}", s: {url_s}}}
routes:
  r: {{hosts: [rt, s], default_model: model-r}}
""")
            await service.poller.when_first_round_done()
            await maybeDeferred(router_port.stopListening)  # healthy in the table, refusing connections now
            sent = b'{"prompt": "x", "n_predict": 1}'
            data, _ = await raw_exchange(port_of(base), request_bytes(
                b"POST", b"/r/completion", [(b"Content-Length", str(len(sent)).encode())], sent))
            [response] = parse_responses(data)
            self.assertEqual((response.status, response.one(b"x-crossbar-host")), (200, b"s"), response.body)
            self.assertEqual(upstream_requests(single)[-1].body, sent)
            self.assertEqual(upstream_requests(router), [])

        return ensureDeferred(go())
