"""Client keys and host keys end to end (docs/design.md §Access): a real crossbar loaded
from a config file with ``${NAME}`` secrets, real loopback FakeLlama hosts that record
every header they get, treq and raw sockets as clients."""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Any

import treq
from twisted.internet.defer import ensureDeferred
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request

from tests.accesskit import auth_headers, start_file
from tests.harness import FakeLlama, http_client, listen, port_of, upstream_requests, wait_for
from tests.logs import LogCapture

ALICE = "alice-Zq8v1-secret"
CI = "ci-Pp4m9-secret"
BOB = "bob-Xx7w2-secret"
HOST_KEY = "host-Kk3j5-secret"
SECRETS = (ALICE, CI, BOB, HOST_KEY)
ENV = {"T_ALICE_KEY": ALICE, "T_CI_KEY": CI, "T_BOB_KEY": BOB, "T_HOST_KEY": HOST_KEY}

_CONFIG = """\
health: {{interval: 60, timeout: 5}}
hosts:
  a: {{url: {a}, max_inflight: 1}}
  k: {{url: {k}, api_key: ${{T_HOST_KEY}}}}
routes:
  r:
    hosts: [a]
    queue: {{max: 10, timeout: 30}}
    keys:
      alice: ${{T_ALICE_KEY}}
      ci: {{secret: ${{T_CI_KEY}}, max_inflight: 1}}
  s:
    hosts: [a]
    keys: {{bob: ${{T_BOB_KEY}}}}
  u:
    hosts: [k]
    keys: {{alice2: alice-two-{extra}}}
  o:
    hosts: [k]
  p:
    hosts: [a]
"""

CHAT = json.dumps({"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}]}).encode()


def bearer(secret: str) -> dict[bytes, list[bytes]]:
    return {b"Authorization": [b"Bearer " + secret.encode()], b"Content-Type": [b"application/json"]}


class KeysTests(TestCase):
    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.log = LogCapture(self)
        self.a, self.k = FakeLlama(["tiny-a"]), FakeLlama(["tiny-a"])
        self.a_url, self.k_url = await listen(self, self.a), await listen(self, self.k)
        self.text = _CONFIG.format(a=self.a_url, k=self.k_url, extra="x")
        self.service, self.base, self.path = await start_file(self, self.text, ENV)
        await self.service.poller.when_first_round_done()
        self.client = http_client(self)

    async def post(self, route: str, headers: dict[bytes, list[bytes]] | None = None, body: bytes = CHAT,
                   query: str = "") -> tuple[int, Any, bytes]:
        response = await self.client.post(f"{self.base}/{route}/v1/chat/completions{query}", data=body,
                                          headers=headers or {b"Content-Type": [b"application/json"]})
        return response.code, response.headers, await response.content()

    async def assert_401(self, route: str, headers: dict[bytes, list[bytes]] | None = None, query: str = "") -> None:
        before = len(upstream_requests(self.a)) + len(upstream_requests(self.k))
        code, headers_in, body = await self.post(route, headers, query=query)
        self.assertEqual(code, 401, body)
        self.assertEqual(json.loads(body), {"error": {"code": 401, "message": "invalid api key", "type": "authentication_error"}})
        self.assertEqual(headers_in.getRawHeaders(b"www-authenticate"), [b"Bearer"])
        self.assertEqual(len(upstream_requests(self.a)) + len(upstream_requests(self.k)), before, "reached a host")

    async def test_missing_wrong_and_other_routes_key(self) -> None:
        await self.assert_401("r")
        await self.assert_401("r", bearer(ALICE + "x"))
        await self.assert_401("r", bearer(ALICE[:-1]))
        await self.assert_401("r", bearer(BOB))  # right key, another route
        await self.assert_401("s", bearer(ALICE))
        await self.assert_401("r", {b"Authorization": [b"Basic " + ALICE.encode()]})
        await self.assert_401("r", {b"Authorization": [ALICE.encode()]})
        # Two Authorization headers, even with the right key in one of them.
        await self.assert_401("r", {b"Authorization": [b"Bearer " + ALICE.encode(), b"Bearer nope"]})
        await self.assert_401("r", {b"Authorization": [b"Bearer " + ALICE.encode()] * 2})

    async def test_key_as_a_query_parameter_is_refused(self) -> None:
        for name in ("api_key", "key", "token", "access_token"):
            await self.assert_401("r", query=f"?{name}={ALICE}")

    async def test_right_key_in_any_case_of_bearer(self) -> None:
        for scheme in (b"Bearer", b"bearer", b"BEARER", b"bEaReR"):
            code, _, body = await self.post("r", {b"Authorization": [scheme + b" " + ALICE.encode()]})
            self.assertEqual(code, 200, body)
        code, _, body = await self.post("s", bearer(BOB))
        self.assertEqual(code, 200, body)
        # Routes without keys need none.
        code, _, body = await self.post("p")
        self.assertEqual(code, 200, body)
        # The client's Authorization never reaches the host of a keyed route.
        for seen in upstream_requests(self.a):
            if seen.uri.startswith(b"/v1/chat"):
                self.assertNotIn(b"authorization", [k.lower() for k, _ in seen.headers.getAllRawHeaders()])

    async def test_health_needs_no_key_and_never_gets_one(self) -> None:
        """Issue 29 item 12: llama.cpp's own suite probes ``GET /health`` with no key on
        a keyed route; llama-server never asks for one there, and crossbar neither."""
        response = await self.client.get(f"{self.base}/r/health")
        self.assertEqual((response.code, await response.content()), (200, b'{"status":"ok"}'))
        head = await self.client.head(f"{self.base}/r/health")
        self.assertEqual(head.code, 200)
        response = await self.client.get(f"{self.base}/r/v1/health")  # the fake host has no such path
        await response.content()
        self.assertEqual((response.code, response.headers.getRawHeaders(b"x-crossbar-host")), (404, [b"a"]))
        response = await self.client.get(f"{self.base}/r/v1/health", headers=bearer(ALICE))
        await response.content()
        seen = [s for s in upstream_requests(self.a) if s.uri == b"/v1/health"]
        self.assertEqual(len(seen), 2)
        headers = [k.lower() for s in seen for k, _ in s.headers.getAllRawHeaders()]
        self.assertNotIn(b"authorization", headers)
        await self.assert_401("r", query="")  # a completion still needs its key

    async def test_options_needs_no_key(self) -> None:
        response = await self.client.request("OPTIONS", f"{self.base}/r/v1/chat/completions")
        await response.content()
        self.assertNotEqual(response.code, 401)
        self.assertEqual([s.method for s in upstream_requests(self.a)], [b"OPTIONS"])

    async def test_keyless_preflight_never_waits_in_the_queue(self) -> None:
        """While the keyed route's host is full, a preflight (no key) is answered 503 at
        once instead of taking a queue place from the route's clients."""
        self.a.handlers[b"/v1/chat/completions"] = held = Held()
        alice = ensureDeferred(self.post("r", bearer(ALICE)))
        await wait_for(lambda: len(held.requests) == 1, what="alice's request at the host")
        response = await self.client.request("OPTIONS", f"{self.base}/r/v1/chat/completions")
        body = await response.content()
        self.assertEqual((response.code, json.loads(body)), (503, {"error": {"code": 503, "message": "all hosts busy", "type": "unavailable_error"}}))
        self.assertEqual(self.service.runtime.queues.queued("r"), 0)
        held.release()
        self.assertEqual((await alice)[0], 200)
        del self.a.handlers[b"/v1/chat/completions"]

    async def test_options_with_a_body_is_no_preflight(self) -> None:
        """A CORS preflight never has a body: an ``OPTIONS`` with one needs a key like
        any request (it could otherwise send work to the hosts unauthenticated)."""
        response = await self.client.request("OPTIONS", f"{self.base}/r/v1/chat/completions",
                                             data=b'{"model": "tiny-a"}')
        body = await response.content()
        self.assertEqual(response.code, 401, body)
        self.assertEqual(upstream_requests(self.a), [])

    async def test_key_name_in_log_and_metrics(self) -> None:
        self.assertEqual((await self.post("r", bearer(CI)))[0], 200)
        self.assertEqual((await self.post("r", bearer(ALICE)))[0], 200)
        await self.assert_401("r", bearer("nope"))
        self.assertEqual((await self.post("p"))[0], 200)
        lines = await wait_for(lambda: len(self.log.proxied()) >= 4 and self.log.proxied(), what="4 log lines")
        self.assertEqual([(e["status"], e["key"]) for e in lines], [(200, "ci"), (200, "alice"), (401, ""), (200, "")])
        from twisted.logger import formatEvent
        self.assertIn("key=ci", formatEvent(lines[0]))
        self.assertNotIn("key=", formatEvent(lines[3]))
        metrics = (await (await self.client.get(self.base + "/_crossbar/metrics")).text()).splitlines()
        requests = [m for m in metrics if m.startswith("crossbar_requests_total{")]
        for expected in ('route="r"', 'code="200"', 'key="ci"'), ('key="alice"',), ('code="401"', 'key=""'):
            self.assertTrue(any(all(e in m for e in expected) for m in requests), (expected, requests))
        self.assertTrue(any('route="p"' in m and 'key=""' in m for m in requests), requests)
        for secret in SECRETS:
            self.log.assert_never_contains(self, secret.encode())
            self.assertNotIn(secret, "\n".join(metrics))

    async def test_per_key_max_inflight(self) -> None:
        """``ci`` (max_inflight 1): one request in flight, or one waiting for the host
        (``a`` takes one at a time), is all it may have; the next is 429 with
        ``Retry-After: 1``; another key is not limited by it."""
        self.a.handlers[b"/v1/chat/completions"] = held = Held()
        ci_first = ensureDeferred(self.post("r", bearer(CI)))  # in flight on a
        await wait_for(lambda: len(held.requests) == 1, what="ci's request at the host")
        code, headers, body = await self.post("r", bearer(CI))
        self.assertEqual((code, json.loads(body)), (429, {"error": {"code": 429, "message": "too many requests", "type": "rate_limit_error"}}))
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
        again = await self.client.post(f"{self.base}/r/v1/chat/completions", data=CHAT, headers=bearer(CI))
        self.assertEqual((again.code, again.phrase), (429, b"Too Many Requests"))  # not "Unknown Status"
        await again.content()
        alice = ensureDeferred(self.post("r", bearer(ALICE)))  # waits: a is full; ci's limit is not alice's
        await wait_for(lambda: self.service.runtime.queues.queued("r") == 1, what="alice waiting")
        held.release()
        self.assertEqual((await ci_first)[0], 200)
        await wait_for(lambda: len(held.requests) == 1, what="alice's request at the host")
        # Now ci waits behind alice: a waiting request counts too.
        ci_waiting = ensureDeferred(self.post("r", bearer(CI)))
        await wait_for(lambda: self.service.runtime.queues.queued("r") == 1, what="ci waiting")
        code, headers, _ = await self.post("r", bearer(CI))
        self.assertEqual(code, 429)
        self.assertEqual(headers.getRawHeaders(b"retry-after"), [b"1"])
        held.release()
        self.assertEqual((await alice)[0], 200)
        await wait_for(lambda: len(held.requests) == 1, what="ci's second request at the host")
        held.release()
        self.assertEqual((await ci_waiting)[0], 200)
        self.assertEqual(self.service.runtime.key_inflight[("r", "ci")], 0)
        del self.a.handlers[b"/v1/chat/completions"]
        self.assertEqual((await self.post("r", bearer(CI)))[0], 200)

    async def test_reload_removes_a_key(self) -> None:
        """A reload that drops ``alice``: her request in flight finishes; her next one
        is 401; ``ci`` still works."""
        self.a.handlers[b"/v1/chat/completions"] = lambda request, body: self.a._stream(request, 6, 0.1)
        response = await self.client.post(f"{self.base}/r/v1/chat/completions", data=CHAT, headers=bearer(ALICE))
        self.assertEqual(response.code, 200)
        with open(self.path, encoding="utf-8") as f:
            text = f.read()
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(text.replace("      alice: ${T_ALICE_KEY}\n", ""))
        self.assertTrue(self.service.reload())
        self.assertNotIn("alice", self.service.config.routes["r"].keys)
        code, _, _ = await self.post("r", bearer(ALICE))
        self.assertEqual(code, 401)
        body = await response.content()  # the in-flight stream finishes
        self.assertTrue(body.endswith(b"data: [DONE]\n\n"), body[-200:])
        self.assertEqual(body.count(b"data: {"), 6)
        self.assertEqual((await self.post("r", bearer(CI)))[0], 200)
        for secret in SECRETS:
            self.log.assert_never_contains(self, secret.encode())

    async def test_host_key_replaces_the_clients(self) -> None:
        """Host ``k`` has ``api_key``: it gets ``Bearer <api_key>`` on polls and on
        requests of a keyed route and of an open route, never the client's value."""
        code, _, body = await self.post("o", bearer("client-own-value"))
        self.assertEqual(code, 200, body)
        code, _, body = await self.post("u", bearer("alice-two-x"))
        self.assertEqual(code, 200, body)
        code, _, body = await self.post("o")
        self.assertEqual(code, 200, body)
        polls = [s for s in self.k.seen if s.uri in (b"/health", b"/v1/models")]
        self.assertTrue(polls)
        for seen in self.k.seen:
            self.assertEqual(auth_headers(seen), [b"Bearer " + HOST_KEY.encode()], seen.uri)
        self.assertEqual(len(upstream_requests(self.k)), 3)
        # A route without keys to a host without api_key passes the client's through.
        code, _, _ = await self.post("p", bearer("client-own-value"))
        self.assertEqual(code, 200)
        self.assertEqual(auth_headers(upstream_requests(self.a)[-1]), [b"Bearer client-own-value"])
        self.assertTrue(self.service.table.is_healthy("k"))

    async def test_x_api_key_is_a_key_and_never_reaches_a_host(self) -> None:
        """Issue 20 item 9: ``X-Api-Key`` was forwarded to the host of a keyed route
        unchanged. It is accepted as the key (what Anthropic-style clients send) and,
        like ``Authorization``, never reaches a host of a keyed route (§Access)."""
        plain = {b"Content-Type": [b"application/json"]}
        code, _, body = await self.post("r", {**plain, b"X-Api-Key": [ALICE.encode()]})
        self.assertEqual(code, 200, body)
        code, _, body = await self.post("u", {**plain, b"X-Api-Key": [b"alice-two-x"]})
        self.assertEqual(code, 200, body)
        code, _, body = await self.post("r", {**bearer(ALICE), b"X-Api-Key": [ALICE.encode()]})
        self.assertEqual(code, 200, body)
        await self.assert_401("r", {**plain, b"X-Api-Key": [b"nope"]})
        await self.assert_401("r", {**plain, b"X-Api-Key": [BOB.encode()]})  # another route's
        await self.assert_401("r", {**plain, b"X-Api-Key": [ALICE.encode(), ALICE.encode()]})
        await self.assert_401("r", {**bearer(CI), b"X-Api-Key": [ALICE.encode()]})  # two keys at once
        for seen in upstream_requests(self.a) + upstream_requests(self.k):
            names = [k.lower() for k, _ in seen.headers.getAllRawHeaders()]
            self.assertNotIn(b"x-api-key", names, seen.uri)
        for seen in upstream_requests(self.k):
            self.assertEqual(auth_headers(seen), [b"Bearer " + HOST_KEY.encode()])
        self.assertEqual(len(upstream_requests(self.a)) + len(upstream_requests(self.k)), 3)
        self.assertEqual(sorted(e["key"] for e in self.log.proxied() if e["status"] == 200),
                         ["alice", "alice", "alice2"])
        # A route without keys passes a client's X-Api-Key through (it is not crossbar's).
        code, _, _ = await self.post("p", {**plain, b"X-Api-Key": [b"for-the-host"]})
        self.assertEqual(code, 200)
        self.assertEqual(upstream_requests(self.a)[-1].headers.getRawHeaders(b"x-api-key"), [b"for-the-host"])

    async def test_keyless_preflight_never_carries_the_hosts_key(self) -> None:
        """Issue 20 item 9: a keyless ``OPTIONS`` on keyed route ``u`` was forwarded with
        host ``k``'s ``api_key`` (a host echoing headers would show it). It goes without
        any ``Authorization``; a keyed request and an open route still carry it."""
        response = await self.client.request("OPTIONS", f"{self.base}/u/v1/chat/completions",
                                             headers={b"Origin": [b"https://app.example"]})
        await response.content()
        [preflight] = upstream_requests(self.k)
        self.assertEqual(preflight.method, b"OPTIONS")
        self.assertEqual(auth_headers(preflight), [])
        response = await self.client.request("OPTIONS", f"{self.base}/o/v1/chat/completions")
        await response.content()
        self.assertEqual(auth_headers(upstream_requests(self.k)[-1]), [b"Bearer " + HOST_KEY.encode()])


class Held:
    """A completion handler that holds each request until :meth:`release`.

    :ivar requests: the requests held now, oldest first."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def __call__(self, request: Request, body: bytes) -> Any:
        self.requests.append(request)
        return NOT_DONE_YET

    def release(self) -> None:
        """Answer the oldest held request 200."""
        request = self.requests.pop(0)
        request.setHeader(b"content-type", b"application/json")
        request.write(b'{"object": "chat.completion", "choices": []}')
        request.finish()


def _send_16_mib_without_key(port: int, route: str) -> tuple[int, bytes, float]:
    """A blocking client that sends a 16 MiB upload's head, then its body in 64 KiB
    writes for as long as no answer is readable. Returns (body bytes sent when the
    answer arrived, the answer's first bytes, seconds from connect to answer)."""
    total = 16 * 1024 * 1024
    head = (f"POST /{route}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {total}\r\n\r\n").encode()
    chunk = b"x" * 65536
    sent = 0
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        sock.setblocking(False)
        while time.monotonic() - start < 10:
            readable, writable, _ = select.select([sock], [sock] if sent < total else [], [], 1.0)
            if readable:
                sock.setblocking(True)
                answer = b""
                while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                    data = sock.recv(65536)
                    if not data:
                        break
                    answer += data
                return sent, answer, time.monotonic() - start
            if writable:
                try:
                    sent += sock.send(chunk)
                except BlockingIOError:
                    pass
    raise AssertionError(f"no answer within 10 s; {sent} body bytes sent")


class EarlyRefusalTests(TestCase):
    timeout = 60

    async def test_16_mib_without_a_key_is_refused_on_the_head(self) -> None:
        """The 401 reaches the client while it is still sending: it had sent only what
        the socket buffers took (measured below) of the 16 MiB, and the host saw nothing."""
        host = FakeLlama()
        url = await listen(self, host)
        service, base, _ = await start_file(
            self, f"hosts: {{a: {url}}}\nroutes:\n  r: {{hosts: [a], keys: {{alice: {ALICE}}}}}\n"
        )
        sent, answer, seconds = await deferToThread(_send_16_mib_without_key, port_of(base), "r")
        self.assertTrue(answer.startswith(b"HTTP/1.1 401 "), answer[:200])
        self.assertIn(b"WWW-Authenticate: Bearer\r\n", answer)
        self.assertTrue(answer.endswith(b'{"error": {"code": 401, "message": "invalid api key", '
                                        b'"type": "authentication_error"}}'), answer)
        self.assertLess(sent, 4 * 1024 * 1024, f"{sent} bytes sent before the 401")
        print(f"\n16 MiB upload without key: 401 after {sent} body bytes sent, {seconds * 1000:.1f} ms")
        self.assertEqual(upstream_requests(host), [])
        # The client has closed its socket: crossbar's side closes too (no timer left).
        await wait_for(lambda: not service.site.open_channels, 5.0, "the refused connection closed")
