"""Routing rules 1-5 (docs/design.md §The proxy): the pure rules, then crossbar's answers on
real loopback sockets, then the model peek's edge cases end to end."""

from __future__ import annotations

import json

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

from crossbar.hosts.balance import Chosen, Rotation, choose
from crossbar.config import Host, Route
from crossbar.hosts.health import HostStatus
from crossbar.proxy.peek import peek
from crossbar.paths import PathKind, classify_path
from crossbar.proxy.routing import (
    has_dot_segment, is_forwardable, split_route, split_target,
)
from tests.harness import TwoHosts, two_hosts, upstream_requests
from tests.raw import parse_responses, raw_exchange, request_bytes


class SplitTests(TestCase):
    def test_split_target(self) -> None:
        self.assertEqual(split_target(b"/a/v1/x?y=1"), (b"/a/v1/x", b"?y=1"))
        self.assertEqual(split_target(b"/a/v1/x?"), (b"/a/v1/x", b"?"))
        self.assertEqual(split_target(b"/a"), (b"/a", b""))
        self.assertEqual(split_target(b"/a?b?c"), (b"/a", b"?b?c"))

    def test_split_target_absolute_form(self) -> None:
        """RFC 9112 §3.2.2: a server must accept absolute-form targets; the authority
        never chooses the upstream."""
        self.assertEqual(split_target(b"http://crossbar:7777/a/v1/x?y=1"), (b"/a/v1/x", b"?y=1"))
        self.assertEqual(split_target(b"HTTPS://h/a"), (b"/a", b""))
        self.assertEqual(split_target(b"http://h"), (b"/", b""))
        self.assertEqual(split_target(b"http://h?q"), (b"/", b"?q"))
        self.assertEqual(split_target(b"/http://h/a"), (b"/http://h/a", b""))

    def test_split_route(self) -> None:
        self.assertEqual(split_route(b"/a/v1/x"), ("a", b"/v1/x"))
        self.assertEqual(split_route(b"/a"), ("a", b"/"))
        self.assertEqual(split_route(b"/a/"), ("a", b"/"))
        self.assertEqual(split_route(b"/a/v1/x%2Fy"), ("a", b"/v1/x%2Fy"))
        self.assertEqual(split_route(b"/a//x"), ("a", b"//x"))

    def test_missing_route(self) -> None:
        for path in (b"/", b"//x", b"", b"noslash", b"*", b"http://h/a/v1/x"):
            self.assertIsNone(split_route(path), path)

    def test_non_utf8_route_matches_nothing(self) -> None:
        split = split_route(b"/\xff/v1/x")
        assert split is not None
        self.assertNotEqual(split[0], "\xff")


class DotSegmentTests(TestCase):
    def test_dot_segments(self) -> None:
        for rest in (b"/v1/../slots", b"/v1/%2e%2e/slots", b"/v1/%2E%2e/x", b"/v1/./x", b"/v1/%2e/x",
                     b"/..", b"/v1/..", b"/v1/..%2Fslots", b"/v1/..%2fslots", b"/v1\\..\\slots",
                     b"/v1/%2e%2E%2fslots", b"/v1/..\\x"):
            self.assertTrue(has_dot_segment(rest), rest)

    def test_no_dot_segments(self) -> None:
        for rest in (b"/v1/chat/completions", b"/v1/a.b", b"/v1/...", b"/v1/..a", b"/v1/.well",
                     b"/v1/%252e%252e/x", b"/health", b"/v1/x%2Fy"):
            self.assertFalse(has_dot_segment(rest), rest)

    def test_forwardable(self) -> None:
        self.assertTrue(is_forwardable(b"POST", b"/v1/x%2Fy?a=1&b=%FF"))
        self.assertTrue(is_forwardable(b"M-SEARCH", b"/health"))
        for target in (b"/v1/\x7f", b"/v1/caf\xc3\xa9", b"/v1/a b", b"/v1/x?\x96", b"/v1/\x00", b"/v1/\t"):
            self.assertFalse(is_forwardable(b"GET", target), target)
        for method in (b"G\x00T", b"GE T", b"", b"G\xc3\xa9T", b"GET/"):
            self.assertFalse(is_forwardable(method, b"/v1/x"), method)

    def test_allowed(self) -> None:
        for rest in (b"/v1/chat/completions", b"/v1/", b"/health", b"/props", b"/v1/x%2Fy"):
            self.assertIs(classify_path(b"GET", rest), PathKind.FORWARD, rest)
        for rest in (b"/", b"/slots", b"/v1", b"/health/", b"/props/x", b"/healthz", b"/_crossbar/status",
                     b"//v1/x", b"/%761/x", b"/v2/x", b"/metrics"):
            self.assertIsNot(classify_path(b"GET", rest), PathKind.FORWARD, rest)

    def test_forbidden_whatever_the_spelling(self) -> None:
        """Rule 3: the forbidden list on the path with and without /v1, decoded and with
        doubled slashes, whatever the route's own paths say."""
        for method, rest in (
            (b"GET", b"/slots"), (b"POST", b"/slots/0?action=save"), (b"GET", b"/v1/slots"), (b"GET", b"//slots"),
            (b"GET", b"/%73lots"), (b"POST", b"/slots/0"), (b"POST", b"/models/load"), (b"POST", b"/v1/models/unload"),
            (b"GET", b"/models/sse"), (b"POST", b"/models"), (b"DELETE", b"/v1/models/x"), (b"POST", b"/props"),
            (b"POST", b"/v1/props"), (b"POST", b"/lora-adapters"), (b"GET", b"/metrics"), (b"GET", b"/v1/metrics"),
            (b"POST", b"/tools"), (b"GET", b"/cors-proxy"), (b"GET", b"/v1//metrics"), (b"PUT", b"/models"),
        ):
            self.assertIs(classify_path(method, rest, ("/slots", "/metrics", "/models/")), PathKind.FORBIDDEN,
                          (method, rest))

    def test_native_endpoints(self) -> None:
        for rest in (b"/completion", b"/completions", b"/infill", b"/tokenize", b"/detokenize", b"/embedding",
                     b"/embeddings", b"/rerank", b"/reranking", b"/apply-template", b"/chat/completions",
                     b"/responses"):
            self.assertIs(classify_path(b"POST", rest), PathKind.FORWARD, rest)
        for rest in (b"/health", b"/props", b"/lora-adapters"):
            self.assertIs(classify_path(b"GET", rest), PathKind.FORWARD, rest)
            self.assertIs(classify_path(b"HEAD", rest), PathKind.FORWARD, rest)
        self.assertIs(classify_path(b"POST", b"/health"), PathKind.NOT_FOUND)
        self.assertIs(classify_path(b"POST", b"/infill/x"), PathKind.NOT_FOUND)

    def test_model_lists(self) -> None:
        for rest in (b"/v1/models", b"/models"):
            self.assertIs(classify_path(b"GET", rest), PathKind.MODEL_LIST)
            self.assertIs(classify_path(b"HEAD", rest), PathKind.MODEL_LIST)
        self.assertIs(classify_path(b"GET", b"/v1/models/tiny-a"), PathKind.FORWARD)
        self.assertIs(classify_path(b"GET", b"/models/tiny-a"), PathKind.NOT_FOUND)

    def test_route_paths(self) -> None:
        paths = ("/score", "/extra/")
        self.assertIs(classify_path(b"POST", b"/score", paths), PathKind.FORWARD)
        self.assertIs(classify_path(b"POST", b"/score/x", paths), PathKind.NOT_FOUND)
        self.assertIs(classify_path(b"POST", b"/extra/a/b", paths), PathKind.FORWARD)
        self.assertIs(classify_path(b"POST", b"/extra", paths), PathKind.NOT_FOUND)
        self.assertIs(classify_path(b"POST", b"/score"), PathKind.NOT_FOUND)


def peek_model(body: bytes) -> str | None:
    """The model crossbar's own peek finds in ``body`` (rule 4)."""
    return peek(body).model


class PeekModelTests(TestCase):
    def test_string_model(self) -> None:
        self.assertEqual(peek_model(b'{"model": "m1", "messages": []}'), "m1")
        self.assertEqual(peek_model(b' \r\n\t{"model":"m1"}'), "m1")

    def test_no_model(self) -> None:
        cases = [
            b"", b"not json", b"{", b"null", b'"model"', b"[]", b'[{"model": "m1"}]',
            b'{"model": 1}', b'{"model": null}', b'{"model": {"id": "m1"}}', b'{"model": ["m1"]}',
            b'{"x": {"model": "m1"}}', b'{"model": ""}', b'{"model": true}',
            b'{"model": "m1"} trailing', b'{"model": "m1\xff"}',
            b"--boundary\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm1\r\n--boundary--\r\n",
        ]
        for body in cases:
            self.assertIsNone(peek_model(body), body)

    def test_bom(self) -> None:
        self.assertEqual(peek_model(b'\xef\xbb\xbf{"model": "m1"}'), "m1")

    def test_invalid_utf8_elsewhere(self) -> None:
        self.assertIsNone(peek_model(b'{"model": "m1", "x": "\xc3\x28"}'))

    def test_deeply_nested(self) -> None:
        self.assertIsNone(peek_model(b"[" * 100000))
        self.assertIsNone(peek_model(b'{"model": "m1", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"))
        self.assertIsNone(peek_model(b'{"x":' + b"{\"a\":" * 100000))

    def test_duplicate_model_last_wins(self) -> None:
        self.assertEqual(peek_model(b'{"model": "m1", "model": "m2"}'), "m2")
        self.assertIsNone(peek_model(b'{"model": "m1", "model": 3}'))


class ChooseTests(TestCase):
    """The fit rules of :func:`crossbar.hosts.balance.choose` for idle hosts and keyless
    requests (docs/design.md §Choosing a host: fit tier, then route order among equals)."""

    healthy = {"a": True, "b": True, "c": True}
    loaded = {"a": ("m1",), "b": ("m2",), "c": ("m2", "m3")}

    def pick(self, hosts: list[str], model: str | None, exclude: tuple[str, ...] = ()) -> str | None:
        route = Route(name="r", hosts=tuple(hosts), default_model=None)
        configured = {h: Host(name=h, url=f"http://{h}:1") for h in ("a", "b", "c")}
        statuses = {h: HostStatus(healthy=self.healthy.get(h, False), loaded=self.loaded.get(h, ())) for h in configured}
        chosen = choose(route, configured, statuses, lambda h: 0, model, None, Rotation(), exclude)
        return chosen.host if isinstance(chosen, Chosen) else None

    def test_loaded_model_preferred_in_route_order(self) -> None:
        self.assertEqual(self.pick(["a", "b", "c"], "m2"), "b")
        self.assertEqual(self.pick(["c", "b"], "m2"), "c")
        self.assertEqual(self.pick(["a", "b", "c"], "m3"), "c")

    def test_fallback_to_first_healthy(self) -> None:
        self.assertEqual(self.pick(["b", "a"], "nowhere"), "b")
        self.assertEqual(self.pick(["a", "b"], None), "a")

    def test_unhealthy_skipped(self) -> None:
        self.healthy = {"a": False, "b": True, "c": True}
        self.assertEqual(self.pick(["a", "b"], "m1"), "b")
        self.assertEqual(self.pick(["a", "c"], "m2"), "c")
        self.healthy = {}
        self.assertIsNone(self.pick(["a", "b"], "m1"))
        self.assertIsNone(self.pick([], "m1"))

    def test_exclusion(self) -> None:
        self.assertEqual(self.pick(["a", "b", "c"], "m2", exclude=("b",)), "c")
        self.assertEqual(self.pick(["a", "b"], "m1", exclude=("a",)), "b")
        self.assertIsNone(self.pick(["a", "b"], "m1", exclude=("a", "b")))


class ErrorAnswerTests(TestCase):
    """Every JSON error answer of rules 1-5, on a real socket, and nothing marked down."""

    async def answer(self, hosts: TwoHosts, target: bytes, method: bytes = b"GET") -> tuple[int, object, bytes | None]:
        data, _ = await raw_exchange(hosts.port, request_bytes(method, target))
        [response] = parse_responses(data)
        return response.status, json.loads(response.body), response.one(b"content-type")

    def test_error_answers(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            cases = [
                (b"/", 400, "missing route"),
                (b"//v1/models", 400, "missing route"),
                (b"/?x=1", 400, "missing route"),
                (b"/nope/v1/models", 404, "unknown route"),
                (b"/_crossbarx/v1/models", 404, "unknown route"),
                (b"/r/v1/../slots", 400, "bad path"),
                (b"/r/v1/%2e%2e/slots", 400, "bad path"),
                (b"/r/slots", 403, "forbidden path"),  # rule 3: the forbidden list
                (b"/r/v1/slots", 403, "forbidden path"),
                (b"/r/metrics", 403, "forbidden path"),
                (b"/r/_crossbar/status", 404, "not found"),
                (b"/r/", 404, "not found"),
                (b"/r", 404, "not found"),
                (b"/r/v1", 404, "not found"),
                (b"/d/v1/models", 503, "no healthy host"),
            ]
            for target, code, message in cases:
                got = await self.answer(hosts, target)
                kind = {400: "invalid_request_error", 403: "permission_error", 404: "invalid_request_error",
                        503: "unavailable_error"}[code]
                error = {"error": {"code": code, "message": message, "type": kind}}
                self.assertEqual(got, (code, error, b"application/json"), target)
            got = await self.answer(hosts, b"/d/v1/chat/completions", b"POST")
            self.assertEqual(got, (503, {"error": {"code": 503, "message": "no healthy host", "type": "unavailable_error"}}, b"application/json"))
            self.assertEqual(upstream_requests(hosts.a) + upstream_requests(hosts.b), [])
            for name in ("a", "b"):
                status = hosts.service.table.get(name)
                assert status is not None
                self.assertTrue(status.healthy, name)
                self.assertEqual(status.last_err, "")

        return ensureDeferred(go())


class ModelPeekEndToEndTests(TestCase):
    """Each odd body routes by the rule, reaches the upstream byte-identical, and no
    error happens. Host ``a`` has ``model-a`` loaded, ``b`` has ``model-b`` (the
    route's default), so the chosen host shows which model was taken."""

    def test_edge_bodies(self) -> object:
        nested = b'{"x": ' + b"[" * 100000 + b"]" * 100000 + b', "model": "model-a"}'
        multipart = (
            b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nmodel-a\r\n"
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            b"Content-Type: audio/wav\r\n\r\nRIFF\x00\x01\x02\xff\xfe\r\n--XyZ--\r\n"
        )
        cases: list[tuple[bytes, bytes, str]] = [
            (b'{"model": "model-a"}', b"application/json", "a"),
            (b"hello, not json", b"text/plain", "b"),
            (multipart, b"multipart/form-data; boundary=XyZ", "b"),
            (b'[{"model": "model-a"}]', b"application/json", "b"),
            (b'{"model": 7}', b"application/json", "b"),
            (b'{"model": null}', b"application/json", "b"),
            (b'{"model": {"name": "model-a"}}', b"application/json", "b"),
            (b'{"x": {"model": "model-a"}}', b"application/json", "b"),
            (b'\xef\xbb\xbf{"model": "model-a"}', b"application/json", "a"),
            (b'{"model": "model-a", "x": "\xff\xfe"}', b"application/json", "b"),
            (b"[" * 100000, b"application/json", "b"),
            (nested, b"application/json", "b"),
            (b'{"model": "model-b", "model": "model-a"}', b"application/json", "a"),
            (b'{"model": "model-a", "model": "model-b"}', b"application/json", "b"),
            (b'{"model": "unknown"}', b"application/json", "a"),  # nowhere loaded: first healthy
        ]

        async def go() -> None:
            hosts = await two_hosts(self)
            for i, (body, ctype, expect) in enumerate(cases):
                data, _ = await raw_exchange(hosts.port, request_bytes(
                    b"POST", b"/r/v1/anything",
                    [(b"Content-Type", ctype), (b"Content-Length", str(len(body)).encode())], body))
                [response] = parse_responses(data)
                # FakeLlama answers 404 for an unknown path: relayed, not crossbar's own.
                self.assertEqual(response.one(b"x-crossbar-host"), expect.encode(), (i, body[:60]))
                chosen = hosts.a if expect == "a" else hosts.b
                seen = upstream_requests(chosen)[-1]
                self.assertEqual(seen.body, body, i)
                self.assertEqual(seen.headers.getRawHeaders(b"content-type"), [ctype])
                self.assertEqual(seen.headers.getRawHeaders(b"content-length"), [str(len(body)).encode()])
            self.assertEqual(len(hosts.chosen()), len(cases))
            for name in ("a", "b"):
                self.assertTrue(hosts.service.table.is_healthy(name))

        return ensureDeferred(go())

    def test_options_preflight_and_empty_post(self) -> object:
        async def go() -> None:
            hosts = await two_hosts(self)
            data, _ = await raw_exchange(hosts.port, request_bytes(b"OPTIONS", b"/r/v1/chat/completions", [
                (b"Origin", b"http://app.test"), (b"Access-Control-Request-Method", b"POST")]))
            [response] = parse_responses(data)
            self.assertEqual(response.one(b"x-crossbar-host"), b"b")
            seen = upstream_requests(hosts.b)[-1]
            self.assertEqual((seen.method, seen.uri), (b"OPTIONS", b"/v1/chat/completions"))
            self.assertEqual(seen.headers.getRawHeaders(b"origin"), [b"http://app.test"])
            self.assertEqual(seen.headers.getRawHeaders(b"access-control-request-method"), [b"POST"])

            data, _ = await raw_exchange(hosts.port, request_bytes(
                b"POST", b"/r/v1/chat/completions", [(b"Content-Length", b"0")]))
            [response] = parse_responses(data)
            self.assertEqual(response.status, 200)
            seen = upstream_requests(hosts.b)[-1]
            self.assertEqual((seen.method, seen.body), (b"POST", b""))
            self.assertEqual(seen.headers.getRawHeaders(b"content-length"), [b"0"])

            # A POST with no Content-Length at all (and no body) is an empty body too.
            data, _ = await raw_exchange(hosts.port, request_bytes(b"POST", b"/r/v1/chat/completions"))
            [response] = parse_responses(data)
            self.assertEqual(response.status, 200)
            self.assertEqual(upstream_requests(hosts.b)[-1].headers.getRawHeaders(b"content-length"), [b"0"])

        return ensureDeferred(go())
