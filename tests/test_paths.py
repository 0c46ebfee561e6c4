"""Paths (docs/design.md §The proxy, rules 1 and 3): the rest of the path goes upstream byte
for byte with its query string; dot-segments are refused. Raw sockets, so twisted.web
and the test client normalise nothing before crossbar sees the exact bytes."""

from __future__ import annotations

import json

from twisted.internet.defer import ensureDeferred
from twisted.trial.unittest import TestCase

from tests.harness import two_hosts, upstream_requests
from tests.raw import parse_responses, raw_exchange, request_bytes


class PathTests(TestCase):
    def test_rest_and_query_byte_for_byte(self) -> object:
        cases = [
            (b"/r/v1/x?y=1", b"/v1/x?y=1"),
            (b"/r/v1/a%2Fb/c", b"/v1/a%2Fb/c"),
            (b"/r/v1/a%2fb", b"/v1/a%2fb"),
            (b"/r/v1/x%20y/%7E?q=a%26b&c=%2F&d=..%2F", b"/v1/x%20y/%7E?q=a%26b&c=%2F&d=..%2F"),
            (b"/r/v1//double", b"/v1//double"),
            (b"/r/v1/x?a=/../slots", b"/v1/x?a=/../slots"),  # dots in the query are data
            (b"/r/v1/%252e%252e/x", b"/v1/%252e%252e/x"),
        ]

        async def go() -> None:
            hosts = await two_hosts(self)
            for target, upstream_uri in cases:
                data, _ = await raw_exchange(hosts.port, request_bytes(b"GET", target))
                [response] = parse_responses(data)
                self.assertEqual(response.one(b"x-crossbar-host"), b"b", target)
                self.assertEqual(upstream_requests(hosts.b)[-1].uri, upstream_uri)
            self.assertEqual(len(upstream_requests(hosts.b)), len(cases))
            before = len(hosts.b.seen)
            for target, upstream_uri in ((b"/r/health", b"/health"), (b"/r/props?x=1", b"/props?x=1")):
                data, _ = await raw_exchange(hosts.port, request_bytes(b"GET", target))
                [response] = parse_responses(data)
                self.assertEqual(response.one(b"x-crossbar-host"), b"b", target)
                self.assertEqual(hosts.b.seen[-1].uri, upstream_uri)
            self.assertEqual(len(hosts.b.seen), before + 2)

        return ensureDeferred(go())

    def test_dot_segments_refused(self) -> object:
        targets = [
            b"/r/v1/../slots", b"/r/v1/%2e%2e/slots", b"/r/v1/%2E%2e/x", b"/r/v1/./x", b"/r/v1/%2e/x",
            b"/r/v1/..%2Fslots", b"/r/v1/..%2fslots?x=1", b"/r/v1/..\\slots", b"/r/v1/..", b"/r/..",
            b"/r/v1/%2e%2e%2f%2e%2e%2fslots", b"/r/v1/x/../../slots",
            # Bytes no request-target may hold (twisted.web lets them through).
            b"/r/v1/x\x7f", b"/r/v1/x?q=\x7f",
        ]

        async def go() -> None:
            hosts = await two_hosts(self)
            for target in targets:
                for method in (b"GET", b"POST"):
                    data, _ = await raw_exchange(hosts.port, request_bytes(
                        method, target, [(b"Content-Length", b"2")] if method == b"POST" else [],
                        b"{}" if method == b"POST" else b""))
                    [response] = parse_responses(data)
                    self.assertEqual(response.status, 400, target)
                    self.assertEqual(json.loads(response.body), {"error": {"code": 400, "message": "bad path", "type": "invalid_request_error"}})
                    self.assertEqual(response.one(b"content-type"), b"application/json")
            self.assertEqual(upstream_requests(hosts.a) + upstream_requests(hosts.b), [])
            self.assertTrue(hosts.service.table.is_healthy("a") and hosts.service.table.is_healthy("b"))

        return ensureDeferred(go())


class RememberedKindTests(TestCase):
    """Rule 3's verdict is remembered per (method, path, route paths) for the per-request
    path: never for a long path, never more than 512 of them, and always the verdict
    :func:`crossbar.paths.path_kind` gives."""

    def test_remembered_verdicts_are_the_rule_s(self) -> None:
        from crossbar import paths

        self.patch(paths, "_KINDS", {})
        for method, rest, extra in ((b"POST", b"/v1/chat/completions", ()), (b"GET", b"/v1/models", ()),
                                    (b"POST", b"/slots", ()), (b"GET", b"/metrics", ("/metrics",)),
                                    (b"POST", b"/nowhere", ())):
            for _ in range(2):  # the second answer comes from memory
                self.assertIs(paths.classify_path(method, rest, extra), paths.path_kind(method, rest, extra))
        self.assertEqual(len(paths._KINDS), 5)

    def test_long_paths_are_never_kept_and_the_memory_is_bounded(self) -> None:
        from crossbar import paths

        self.patch(paths, "_KINDS", {})
        paths.classify_path(b"POST", b"/v1/" + b"x" * 300)
        self.assertEqual(paths._KINDS, {})
        for i in range(2000):
            paths.classify_path(b"POST", b"/v1/p%d" % i)
            self.assertLessEqual(len(paths._KINDS), 512)


class ForwardedNativeTests(TestCase):
    def test_input_tokens_is_forwarded(self) -> None:
        """Issue 29 item 12: llama.cpp's ``/chat/completions/input_tokens`` is forwarded
        like its ``/v1/`` form."""
        from crossbar.paths import PathKind, path_kind

        for rest in (b"/chat/completions/input_tokens", b"/v1/chat/completions/input_tokens"):
            self.assertIs(path_kind(b"POST", rest), PathKind.FORWARD, rest)
        self.assertIs(path_kind(b"POST", b"/chat/completions/other"), PathKind.NOT_FOUND)
