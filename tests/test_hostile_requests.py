"""Requests found by attacking crossbar with hostile clients (docs/design.md §The proxy,
rules 3, 8 and 9; §Access; RFC 9110/9112), each once answered wrongly: a ``#`` that
hid a dot segment and cut the target, a HEAD refusal with a body, asterisk-form
targets answered by Twisted (its version header, no JSON, no log line), a non-UTF-8
ops path that logged a traceback, TRACE forwarded with the host's key, HTTP/1.1
without a ``Host``, a 413 recorded without its key.

Loopback: crossbar in front of a :class:`~tests.harness.FakeLlama` with an open route
``r`` and a keyed route ``k``; raw requests through :mod:`tests.raw`.
"""

from __future__ import annotations

import json

from twisted.trial.unittest import TestCase

from crossbar.process.service import CrossbarService
from tests.harness import FakeLlama, listen, port_of, start_crossbar, upstream_requests
from tests.logs import LogCapture
from tests.raw import RawResponse, parse_responses, raw_exchange, request_bytes

_KEY = b"alice-s3cret-0123456789"
_HOST_KEY = "host-api-key-77aa"


class _Setup:
    def __init__(self, service: CrossbarService, port: int, host: FakeLlama, watch: LogCapture) -> None:
        self.service = service
        self.port = port
        self.host = host
        self.watch = watch


async def _setup(case: TestCase) -> _Setup:
    watch = LogCapture(case)
    host = FakeLlama(["model-a"])
    url = await listen(case, host)
    service, base = await start_crossbar(case, f"""
health: {{interval: 60, timeout: 5}}
hosts:
  a: {{url: {url}, api_key: {_HOST_KEY}, max_inflight: 1}}
routes:
  r:
    hosts: [a]
    default_model: model-a
  k:
    hosts: [a]
    default_model: model-a
    keys:
      alice: {{secret: {_KEY.decode()}, max_inflight: 1}}
""")
    await service.poller.when_first_round_done()
    return _Setup(service, port_of(base), host, watch)


async def _one(setup: _Setup, raw: bytes, head: bool = False) -> RawResponse:
    data, _ = await raw_exchange(setup.port, raw, timeout=10)
    [answer] = parse_responses(data, head=head, at_eof=True)
    return answer


class HostileRequestTests(TestCase):
    async def test_a_fragment_mark_is_a_bad_path(self) -> None:
        setup = await _setup(self)
        for target in (b"/r/v1/..#", b"/r/v1/%2e%2e#/x", b"/r/v1/chat/completions#?stream=true"):
            answer = await _one(setup, request_bytes(b"GET", target))
            self.assertEqual((answer.status, json.loads(answer.body)), (400, {"error": {"code": 400, "message": "bad path", "type": "invalid_request_error"}}), target)
        self.assertEqual(upstream_requests(setup.host), [])

    async def test_head_refusals_have_no_body(self) -> None:
        setup = await _setup(self)
        unauthorized = await _one(setup, request_bytes(b"HEAD", b"/k/v1/models"), head=True)
        too_large = await _one(setup, request_bytes(b"HEAD", b"/r/v1/x", [(b"Content-Length", b"99999999")]),
                               head=True)
        for answer, code in ((unauthorized, 401), (too_large, 413)):
            self.assertEqual((answer.status, answer.body), (code, b""))
            self.assertEqual(answer.one(b"content-type"), b"application/json")
        self.assertEqual(sorted((e["status"], e["bytes"]) for e in setup.watch.proxied()), [(401, 0), (413, 0)])

    async def test_asterisk_form_is_crossbars_own_answer(self) -> None:
        setup = await _setup(self)
        for method in (b"GET", b"OPTIONS", b"POST"):
            answer = await _one(setup, request_bytes(method, b"*"))
            self.assertEqual((answer.status, json.loads(answer.body)), (400, {"error": {"code": 400, "message": "missing route", "type": "invalid_request_error"}}), method)
            self.assertIsNone(answer.one(b"server"))
        self.assertEqual([e["status"] for e in setup.watch.proxied()], [400, 400, 400])

    async def test_non_utf8_ops_path_is_a_json_404_without_a_traceback(self) -> None:
        setup = await _setup(self)
        answer = await _one(setup, request_bytes(b"GET", b"/_crossbar/%ff"))
        self.assertEqual((answer.status, json.loads(answer.body)), (404, {"error": {"code": 404, "message": "not found", "type": "invalid_request_error"}}))
        self.assertEqual(setup.watch.errors(), [])

    async def test_trace_and_connect_are_never_forwarded(self) -> None:
        setup = await _setup(self)
        for method, target in ((b"TRACE", b"/r/v1/x"), (b"CONNECT", b"/r/v1/x"), (b"TRACE", b"/k/v1/x")):
            answer = await _one(setup, request_bytes(method, target, [(b"Authorization", b"Bearer " + _KEY)]))
            self.assertEqual((answer.status, json.loads(answer.body)), (405, {"error": {"code": 405, "message": "method not allowed", "type": "invalid_request_error"}}))
        self.assertEqual(upstream_requests(setup.host), [])

    async def test_host_header_rules(self) -> None:
        setup = await _setup(self)
        body = b'{"messages": []}'
        framing = [(b"Content-Length", b"%d" % len(body)), (b"Connection", b"close")]

        def raw(version: bytes, hosts: list[bytes]) -> bytes:
            lines = [b"POST /r/v1/chat/completions " + version] + [b"Host: " + h for h in hosts]
            lines += [n + b": " + v for n, v in framing]
            return b"\r\n".join(lines) + b"\r\n\r\n" + body

        for version, hosts in ((b"HTTP/1.1", []), (b"HTTP/1.1", [b"x", b"y"]), (b"HTTP/1.1", [b"a\x7fb"])):
            answer = await _one(setup, raw(version, hosts))
            # A control byte is refused for any header before the Host rule is reached.
            why = "bad header value" if any(b"\x7f" in h for h in hosts) else "bad host header"
            self.assertEqual((answer.status, json.loads(answer.body)), (400, {"error": {"code": 400, "message": why, "type": "invalid_request_error"}}), hosts)
        self.assertEqual(upstream_requests(setup.host), [])
        answer = await _one(setup, raw(b"HTTP/1.0", []))  # HTTP/1.0 needs none
        self.assertEqual(answer.status, 200)

    async def test_413_on_a_keyed_route_names_the_key(self) -> None:
        setup = await _setup(self)
        answer = await _one(setup, request_bytes(b"POST", b"/k/v1/chat/completions", [
            (b"Authorization", b"Bearer " + _KEY), (b"Content-Length", b"99999999")]))
        self.assertEqual(answer.status, 413)
        [event] = setup.watch.proxied()
        self.assertEqual((event["status"], event["key"], event["route"]), (413, "alice", "k"))

    async def test_methods_outside_the_seven_are_refused_in_any_case(self) -> None:
        """Issue 20 item 7: ``trace`` in lower case was forwarded (only ``TRACE`` was
        refused). Any method but GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS in exact
        case is a 405 with ``Allow``, on the head, on any path (rule 9)."""
        setup = await _setup(self)
        for method in (b"trace", b"Trace", b"get", b"Post", b"BREW", b"PROPFIND", b"connect"):
            for target in (b"/r/v1/chat/completions", b"/k/v1/x", b"/_crossbar/livez"):
                answer = await _one(setup, request_bytes(method, target, [(b"Authorization", b"Bearer " + _KEY)]))
                self.assertEqual((answer.status, json.loads(answer.body)), (405, {"error": {"code": 405, "message": "method not allowed", "type": "invalid_request_error"}}),
                                 (method, target))
                self.assertEqual(answer.one(b"allow"), b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")
                self.assertEqual(answer.one(b"content-type"), b"application/json")
        self.assertEqual(upstream_requests(setup.host), [])
        for method in (b"GET", b"DELETE", b"PATCH", b"PUT"):  # the seven still pass
            answer = await _one(setup, request_bytes(method, b"/r/v1/x"))
            self.assertNotEqual(answer.status, 405, method)
        self.assertEqual([s.method for s in upstream_requests(setup.host)], [b"GET", b"DELETE", b"PATCH", b"PUT"])

    async def test_hostile_heads_are_refused_and_never_forwarded(self) -> None:
        """Issue 20 item 7: control bytes in a header value, ``Content_Length`` /
        ``Transfer_Encoding`` names, a repeated ``Transfer-Encoding`` and an obs-folded
        one were accepted and passed on; each is a JSON 400 now (rule 9)."""
        setup = await _setup(self)
        body = b'{"messages": []}'
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        length = (b"Content-Length", b"%d" % len(body))
        heads = {
            "control byte": ([length, (b"X-Note", b"a\x01b")], body),
            "DEL": ([length, (b"X-Note", b"a\x7fb")], body),
            "escape": ([length, (b"User-Agent", b"x\x1b[2Jy")], body),
            "Content_Length": ([length, (b"Content_Length", b"0")], body),
            "content_length": ([length, (b"content_length", b"5")], body),
            "Transfer_Encoding": ([length, (b"Transfer_Encoding", b"chunked")], body),
            "two TE": ([(b"Transfer-Encoding", b"chunked"), (b"Transfer-Encoding", b"identity")], chunked),
            "TE identity first": ([(b"Transfer-Encoding", b"identity"), (b"Transfer-Encoding", b"chunked")], chunked),
            "folded TE": ([(b"Transfer-Encoding", b"\r\n chunked")], chunked),
            "folded other": ([length, (b"X-Note", b"a\r\n\tb")], body),
        }
        for what, (headers, payload) in heads.items():
            answer = await _one(setup, request_bytes(b"POST", b"/r/v1/chat/completions", headers, payload))
            self.assertEqual(answer.status, 400, what)
            self.assertEqual(answer.one(b"content-type"), b"application/json", what)
            self.assertIn("error", json.loads(answer.body), what)
        self.assertEqual(upstream_requests(setup.host), [])
        self.assertEqual([e["status"] for e in setup.watch.proxied()], [400] * len(heads))
        # A tab inside a value and an underscore elsewhere are fine.
        answer = await _one(setup, request_bytes(b"POST", b"/r/v1/chat/completions",
                                                 [length, (b"X-Note", b"a\tb"), (b"X_Trace_Id", b"7")], body))
        self.assertEqual(answer.status, 200)

    async def test_crossbars_own_answers_carry_cors_headers(self) -> None:
        """Issue 20 item 11: crossbar's own answers (401, 404, the model list, errors)
        had no CORS headers, so a browser client saw a CORS failure instead of the
        message. With an ``Origin`` they answer as llama-server does: the origin echoed."""
        setup = await _setup(self)
        origin = (b"Origin", b"https://app.example")
        cases = [
            (b"GET", b"/k/v1/models", 401),
            (b"GET", b"/nowhere/v1/models", 404),
            (b"GET", b"/r/nothing-here", 404),
            (b"GET", b"/r/v1/models", 200),
            (b"POST", b"/r/v1/../x", 400),
            (b"trace", b"/r/v1/x", 405),
            (b"POST", b"/r/v1/x", 413),
        ]
        for method, target, code in cases:
            extra = [(b"Content-Length", b"99999999")] if code == 413 else []
            answer = await _one(setup, request_bytes(method, target, [origin, *extra]))
            self.assertEqual(answer.status, code, target)
            self.assertEqual(answer.one(b"access-control-allow-origin"), b"https://app.example", target)
            self.assertEqual(answer.one(b"vary"), b"Origin", target)
            plain = await _one(setup, request_bytes(method, target, extra))
            self.assertIsNone(plain.one(b"access-control-allow-origin"), target)
        self.assertEqual(upstream_requests(setup.host), [])
