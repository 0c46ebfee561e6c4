"""Failing hosts and leaving clients on real loopback sockets (docs/design.md §The proxy,
rule 7): fail over on a refused connection, one retry on a fresh connection to the same
host when a reused one closes with no byte of the answer (never another host), 502/504
otherwise once the request was sent, truncated answers on mid-answer
death or idle silence, and a client that leaves cancels the upstream at once. After
every kind of ending ``inflight`` in ``/_crossbar/status`` is back to 0.
"""

from __future__ import annotations

import json
import time
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.server import Site

from tests.harness import FakeLlama, http_client, listen, start_crossbar, start_routes, upstream_requests, wait_for
from tests.logs import LogCapture
from tests.raw import connect_raw, post_bytes
from tests.upstreams import Die, Hang, KillReused, host_status

_STREAM = json.dumps({"model": "tiny-a", "stream": True, "messages": []}).encode()
# No messages: no affinity key, so idle equal hosts are chosen in route order (these
# tests say which host fails first).
_PLAIN = {"model": "tiny-a"}


async def _within(d: Deferred[Any], seconds: float) -> float:
    """Wait for ``d``; fail if it takes longer than ``seconds``. Returns the time taken."""
    start = time.monotonic()
    timer = reactor.callLater(seconds, d.cancel)  # type: ignore[attr-defined]
    try:
        await d
    finally:
        if timer.active():
            timer.cancel()
    return time.monotonic() - start


async def _primary_a(case: TestCase, a: str, b: str) -> tuple[Any, str]:
    """crossbar with route ``r`` over hosts ``a`` (its ``primary``: it takes every
    request it has room for) and ``b``, once the first poll round is done."""
    text = (f"health: {{interval: 60, timeout: 5}}\nhosts: {{a: '{a}', b: '{b}'}}\n"
            "routes:\n  r: {hosts: [a, b], primary: a}\n")
    service, base = await start_crossbar(case, text)
    await service.poller.when_first_round_done()
    return service, base


async def _stoppable(case: TestCase, upstream: FakeLlama) -> tuple[str, Any]:
    """Serve ``upstream`` (so the first poll finds it healthy); returns its URL and a
    function that stops listening (after which connecting is refused)."""
    site = Site(upstream)
    site.noisy = False
    port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
    state = {"listening": True}

    def stop() -> Any:
        if state["listening"]:
            state["listening"] = False
            return port.stopListening()
        return None

    case.addCleanup(stop)
    return f"http://127.0.0.1:{port.getHost().port}", stop  # type: ignore[attr-defined]


class ClientGoneTests(TestCase):
    async def _mid_stream(self, abort: bool) -> None:
        watch = LogCapture(self)
        upstream = FakeLlama()
        upstream.events = 1000
        upstream.event_delay = 0.05
        service, base = await start_routes(self, {"a": await listen(self, upstream)})
        client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", _STREAM))
        await client.wait_for(b'"i": 2')
        self.assertEqual((await host_status(self, base))["a"]["inflight"], 1)
        if abort:
            client.transport.abortConnection()  # type: ignore[union-attr]
        else:
            client.transport.loseConnection()  # type: ignore[union-attr]
        await _within(upstream.streams_closed[0], 1.0)
        await wait_for(lambda: not service.runtime.active, 1.0)
        status = (await host_status(self, base))["a"]
        self.assertTrue(status["healthy"])
        self.assertEqual(status["last_err"], "")
        self.assertEqual(status["inflight"], 0)
        await deferLater(reactor, 0.2)  # a late write or finish would log here
        self.assertEqual(watch.errors(), [])

    def test_client_closes_mid_stream(self) -> object:
        """A client that closes its connection mid-stream: the upstream sees its peer
        close within a second; nothing marked down or logged as an error."""
        return ensureDeferred(self._mid_stream(abort=False))

    def test_client_resets_mid_stream(self) -> object:
        """The same with a reset (abortConnection) instead of a clean close."""
        return ensureDeferred(self._mid_stream(abort=True))

    def test_client_closes_before_headers(self) -> object:
        """A client that leaves while the upstream has not answered yet: the upstream
        connection is closed within a second; nothing marked down or logged."""

        async def go() -> None:
            watch = LogCapture(self)
            hang = Hang()
            upstream = FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = hang
            service, base = await start_routes(self, {"a": await listen(self, upstream)})
            client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", _STREAM))
            await wait_for(lambda: hang.requests == 1)
            self.assertEqual((await host_status(self, base))["a"]["inflight"], 1)
            client.transport.loseConnection()  # type: ignore[union-attr]
            await _within(hang.closed, 1.0)
            await wait_for(lambda: not service.runtime.active, 1.0)
            status = (await host_status(self, base))["a"]
            self.assertTrue(status["healthy"])
            self.assertEqual(status["last_err"], "")
            self.assertEqual(status["inflight"], 0)
            await deferLater(reactor, 0.2)
            self.assertEqual(watch.errors(), [])

        return ensureDeferred(go())


class HostFailureTests(TestCase):
    def test_refused_host_fails_over_to_the_next(self) -> object:
        """First host refuses the connection, the second answers: 200 from the second,
        the first marked down."""

        async def go() -> None:
            first, second = FakeLlama(), FakeLlama()
            url_a, stop_a = await _stoppable(self, first)
            _, base = await start_routes(self, {"a": url_a, "b": await listen(self, second)})
            await stop_a()
            response = await http_client(self).post(base + "/r/v1/chat/completions", json=_PLAIN)
            body = await treq.json_content(response)
            self.assertEqual(response.code, 200)
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"b"])
            self.assertEqual(body["object"], "chat.completion")
            hosts = await host_status(self, base)
            self.assertFalse(hosts["a"]["healthy"])
            self.assertTrue(hosts["a"]["last_err"].startswith("marked down: connect"), hosts["a"]["last_err"])
            self.assertTrue(hosts["b"]["healthy"])
            self.assertEqual((hosts["a"]["inflight"], hosts["b"]["inflight"]), (0, 0))

        return ensureDeferred(go())

    def test_all_hosts_refused_is_502(self) -> object:
        """Every host refuses: 502 JSON naming the last host tried; both marked down."""

        async def go() -> None:
            url_a, stop_a = await _stoppable(self, FakeLlama())
            url_b, stop_b = await _stoppable(self, FakeLlama())
            _, base = await start_routes(self, {"a": url_a, "b": url_b})
            await stop_a()
            await stop_b()
            response = await http_client(self).post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(response.code, 502)
            self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
            self.assertEqual(await treq.json_content(response), {"error": {"code": 502, "message": "upstream failed", "type": "server_error", "host": "b"}})
            hosts = await host_status(self, base)
            for name in ("a", "b"):
                self.assertFalse(hosts[name]["healthy"])
                self.assertTrue(hosts[name]["last_err"].startswith("marked down: connect"))
                self.assertEqual(hosts[name]["inflight"], 0)

        return ensureDeferred(go())

    def test_stale_pooled_connection_is_retried_fresh_on_the_same_host(self) -> object:
        """Issue 29 item 1, rule 7: the host closes a reused kept-alive connection as a POST
        reaches it, with no byte of the answer: the POST goes once more, on a fresh
        connection to the same host (llama-server cancels the work of a closed
        connection), the client gets its 200, and nothing is marked down."""

        async def go() -> None:
            kill = KillReused()
            upstream = FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = kill
            other = FakeLlama()
            _, base = await _primary_a(self, await listen(self, upstream), await listen(self, other))
            http = http_client(self)
            first = await http.post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(first.code, 200)
            self.assertEqual(first.headers.getRawHeaders("x-crossbar-host"), ["a"])
            await treq.content(first)
            second = await http.post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(second.code, 200)
            self.assertEqual(second.headers.getRawHeaders("x-crossbar-host"), ["a"])
            self.assertEqual((await treq.json_content(second))["object"], "chat.completion")
            self.assertEqual(kill.killed, 1, "crossbar did not reuse its pooled connection")
            self.assertEqual((kill.requests, len(kill.connections)), (3, 2), "not retried on a fresh connection")
            self.assertEqual(upstream_requests(other), [])
            status = (await host_status(self, base))["a"]
            self.assertTrue(status["healthy"])
            self.assertEqual((status["last_err"], status["inflight"]), ("", 0))

        return ensureDeferred(go())

    def test_stale_connection_whose_retry_fails_too_is_a_host_failure(self) -> object:
        """Rule 7: the fresh connection fails as well: 502 naming the host, marked down,
        and the request never goes to another host (the host may have read it)."""

        async def go() -> None:
            kill = KillReused(every=True)
            upstream = FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = kill
            other = FakeLlama()
            _, base = await _primary_a(self, await listen(self, upstream), await listen(self, other))
            http = http_client(self)
            first = await http.post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(first.code, 200)
            await treq.content(first)
            second = await http.post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual((second.code, second.headers.getRawHeaders("x-crossbar-host")), (502, ["a"]))
            error = (await treq.json_content(second))["error"]
            self.assertEqual((error["message"], error["host"]), ("upstream failed", "a"))
            self.assertEqual((kill.requests, kill.killed), (3, 2))
            self.assertEqual(upstream_requests(other), [])
            status = (await host_status(self, base))["a"]
            self.assertFalse(status["healthy"])
            self.assertEqual(status["inflight"], 0)

        return ensureDeferred(go())

    def test_idle_keepalive_closed_by_upstream(self) -> object:
        """An upstream that closes each kept-alive connection right after its answer:
        the next POST still succeeds and nothing is marked down."""

        async def go() -> None:
            upstream = FakeLlama()
            plain = upstream.render

            def close_after(request: Any, body: bytes) -> Any:
                transport = request.channel.transport
                request.notifyFinish().addBoth(lambda _: transport.loseConnection())
                request.content.seek(0)
                del upstream.handlers[b"/v1/chat/completions"]
                try:
                    return plain(request)
                finally:
                    upstream.handlers[b"/v1/chat/completions"] = close_after

            upstream.handlers[b"/v1/chat/completions"] = close_after
            _, base = await start_routes(self, {"a": await listen(self, upstream)})
            http = http_client(self)
            for n in range(3):
                response = await http.post(base + "/r/v1/chat/completions", json=_PLAIN)
                self.assertEqual(response.code, 200, f"request {n}")
                await treq.content(response)
                await deferLater(reactor, 0.01 * n)
            status = (await host_status(self, base))["a"]
            self.assertTrue(status["healthy"])
            self.assertEqual(status["last_err"], "")

        return ensureDeferred(go())

    def test_host_dies_after_request_sent(self) -> object:
        """The host takes the request on a fresh connection and dies before the headers:
        502 naming it, marked down, and neither retried nor sent to the next host."""

        async def go() -> None:
            die = Die(events=None, delay=0.0)
            upstream, other = FakeLlama(), FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = die
            _, base = await start_routes(self, {"a": await listen(self, upstream), "b": await listen(self, other)})
            response = await http_client(self).post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(response.code, 502)
            self.assertEqual(await treq.json_content(response), {"error": {"code": 502, "message": "upstream failed", "type": "server_error", "host": "a"}})
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"a"])
            self.assertEqual(die.requests, 1)
            self.assertEqual([s.uri for s in other.seen if s.uri.startswith(b"/v1/chat")], [])
            hosts = await host_status(self, base)
            self.assertFalse(hosts["a"]["healthy"])
            self.assertTrue(hosts["a"]["last_err"].startswith("marked down: request failed"), hosts["a"]["last_err"])
            self.assertTrue(hosts["b"]["healthy"])
            self.assertEqual((hosts["a"]["inflight"], hosts["b"]["inflight"]), (0, 0))

        return ensureDeferred(go())

    def test_no_headers_within_first_byte_is_504(self) -> object:
        """No headers within ``timeouts.first_byte``: 504 JSON, marked down, the upstream
        connection closed."""

        async def go() -> None:
            hang = Hang()
            upstream = FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = hang
            _, base = await start_routes(self, {"a": await listen(self, upstream)}, timeouts="{first_byte: 0.5}")
            start = time.monotonic()
            response = await http_client(self).post(base + "/r/v1/chat/completions", json=_PLAIN)
            took = time.monotonic() - start
            self.assertEqual(response.code, 504)
            self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
            self.assertEqual(await treq.json_content(response), {"error": {"code": 504, "message": "upstream timed out", "type": "server_error", "host": "a"}})
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"a"])
            self.assertGreaterEqual(took, 0.45)
            self.assertLess(took, 5.0)
            await _within(hang.closed, 1.0)
            self.assertEqual(hang.requests, 1)
            status = (await host_status(self, base))["a"]
            self.assertFalse(status["healthy"])
            self.assertIn("no response headers within 0.5s", status["last_err"])
            self.assertEqual(status["inflight"], 0)

        return ensureDeferred(go())

    def test_busy_host_slow_on_one_request_is_not_marked_down(self) -> object:
        """Issue 20 item 5: a long non-streamed generation gets its 504 (naming the
        host), but the host answered another request meanwhile: busy, not dead, so it
        stays healthy and serves the next request."""

        async def go() -> None:
            hang = Hang()
            upstream = FakeLlama()

            def chat(request: Any, body: bytes) -> Any:
                if b'"slow"' in body:
                    return hang(request, body)
                request.setHeader(b"content-type", b"application/json")
                return b'{"object": "chat.completion"}'

            upstream.handlers[b"/v1/chat/completions"] = chat
            _, base = await start_routes(self, {"a": await listen(self, upstream)}, timeouts="{first_byte: 1}")
            client = http_client(self)
            slow = client.post(base + "/r/v1/chat/completions", json={"slow": True})
            await deferLater(reactor, 0.3)
            other = await client.post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(other.code, 200)
            await treq.content(other)
            response = await slow
            self.assertEqual(response.code, 504)
            self.assertEqual(await treq.json_content(response), {"error": {"code": 504, "message": "upstream timed out", "type": "server_error", "host": "a"}})
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"a"])
            status = (await host_status(self, base))["a"]
            self.assertTrue(status["healthy"], status)
            self.assertEqual(status["inflight"], 0)
            after = await client.post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(after.code, 200)
            await treq.content(after)

        return ensureDeferred(go())

    def test_busy_host_that_answers_its_polls_is_not_marked_down(self) -> object:
        """A good poll that finished after the request was sent is a sign of life too."""

        async def go() -> None:
            hang = Hang()
            upstream = FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = hang
            text = ("health: {interval: 0.2, timeout: 1}\ntimeouts: {first_byte: 1}\n"
                    f"hosts:\n  a: {await listen(self, upstream)}\nroutes:\n  r:\n    hosts: [a]\n")
            service, base = await start_crossbar(self, text)
            await service.poller.when_first_round_done()
            response = await http_client(self).post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(response.code, 504)
            await treq.content(response)
            status = (await host_status(self, base))["a"]
            self.assertTrue(status["healthy"], status)
            self.assertEqual(status["last_err"], "")

        return ensureDeferred(go())

    def test_host_dies_mid_answer(self) -> object:
        """The host dies mid-answer: marked down, and the client's connection is cut so
        its chunked body has no terminating chunk."""

        async def go() -> None:
            upstream = FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = Die(events=3, delay=0.3)
            service, base = await start_routes(self, {"a": await listen(self, upstream)})
            client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", _STREAM))
            await client.wait_for(b'"i": 2')
            self.assertEqual((await host_status(self, base))["a"]["inflight"], 1)
            await _within(client.closed, 5.0)
            response = client.response()
            assert response is not None
            self.assertEqual(response.status, 200)
            self.assertEqual(response.one(b"transfer-encoding"), b"chunked")
            self.assertFalse(response.complete, "the client saw a clean end of a failed answer")
            self.assertIn(b'"i": 2', response.body)
            status = (await host_status(self, base))["a"]
            self.assertFalse(status["healthy"])
            self.assertTrue(status["last_err"].startswith("marked down: failed mid-answer"), status["last_err"])
            self.assertEqual(status["inflight"], 0)

        return ensureDeferred(go())

    def test_failure_of_a_host_url_replaced_by_reload_marks_nothing(self) -> object:
        """A reload points host ``a`` at a new URL while a stream to the old one is in
        flight; the old host then dies: that says nothing of the new ``a``, which stays
        healthy (the client's answer is still cut)."""

        async def go() -> None:
            from dataclasses import replace
            from types import MappingProxyType

            from crossbar.config import Host

            old = FakeLlama()
            old.handlers[b"/v1/chat/completions"] = Die(events=3, delay=0.3)
            service, base = await start_routes(self, {"a": await listen(self, old)})
            client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", _STREAM))
            await client.wait_for(b'"i": 2')
            new_url = await listen(self, FakeLlama())
            config = service.runtime.config
            service.runtime.config = replace(
                config, hosts=MappingProxyType({"a": Host(name="a", url=new_url)})
            )
            await _within(client.closed, 5.0)
            response = client.response()
            assert response is not None
            self.assertFalse(response.complete)
            status = (await host_status(self, base))["a"]
            self.assertTrue(status["healthy"], status)
            self.assertEqual(status["inflight"], 0)

        return ensureDeferred(go())

    def test_idle_silence_mid_answer(self) -> object:
        """The host goes silent for ``timeouts.idle`` mid-answer: marked down, the client's
        connection cut (no terminating chunk), the upstream connection closed."""

        async def go() -> None:
            hang = Hang(events=2)
            upstream = FakeLlama()
            upstream.handlers[b"/v1/chat/completions"] = hang
            _, base = await start_routes(self, {"a": await listen(self, upstream)}, timeouts="{idle: 0.5}")
            client = await connect_raw(self, base, post_bytes(b"/r/v1/chat/completions", _STREAM))
            await client.wait_for(b'"i": 1')
            took = await _within(client.closed, 5.0)
            self.assertGreaterEqual(took, 0.3)
            response = client.response()
            assert response is not None
            self.assertEqual(response.status, 200)
            self.assertFalse(response.complete, "the client saw a clean end of a failed answer")
            await _within(hang.closed, 1.0)
            status = (await host_status(self, base))["a"]
            self.assertFalse(status["healthy"])
            self.assertIn("no body byte within 0.5s", status["last_err"])
            self.assertEqual(status["inflight"], 0)

        return ensureDeferred(go())


class CrossbarBugTests(TestCase):
    """A bug in crossbar itself (here: the upstream agent raising synchronously) still
    gets the client a JSON 500, one log line, and leaves no request counted in flight
    (docs/design.md §The proxy, rules 8-9)."""

    def test_synchronous_error_in_forwarding(self) -> object:
        async def go() -> None:
            log = LogCapture(self)
            service, base = await start_routes(self, {"a": await listen(self, FakeLlama())})

            class Broken:
                def request(self, *args: Any, **kwargs: Any) -> Any:
                    raise ValueError("boom")

            real_agent = service.pools.agent
            service.pools.agent = lambda fresh=False: (Broken(), real_agent(fresh)[1])  # type: ignore[method-assign]
            response = await http_client(self).post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(response.code, 500)
            self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
            self.assertEqual(await treq.json_content(response), {"error": {"code": 500, "message": "internal error", "type": "server_error"}})
            self.assertEqual(service.runtime.active, set())
            self.assertEqual(service.runtime.inflight.host("a"), 0)
            self.assertEqual([e["status"] for e in log.proxied()], [500])
            self.flushLoggedErrors(ValueError)
            service.pools.agent = real_agent  # type: ignore[method-assign]
            ok = await http_client(self).post(base + "/r/v1/chat/completions", json=_PLAIN)
            self.assertEqual(ok.code, 200)
            await ok.content()

        return ensureDeferred(go())
