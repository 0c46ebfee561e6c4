"""Pooled connections and the host's keep-alive timeout, on real sockets (docs/design.md
§The proxy, rule 7; issue 20 item 6).

``PeerClosedTests``: the pool never hands out a connection whose host already closed it
while the reactor had not read that yet (a raw socket as the host, closed while the
reactor is held). ``LlamaKeepAliveTests``: against a real llama-server (it says
``Keep-Alive: timeout=5`` and closes idle connections at 5 s), requests arriving around
that timeout all succeed and mark nothing down.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.http_headers import Headers

from crossbar.upstream.h1answer import keep_alive_timeout
from crossbar.upstream.h1client import PEEK_AFTER, H1Agent, H1Pool, retire_after
from crossbar.upstream.pools import ConnectTracker, UpstreamEndpoints
from tests.harness import http_client, require_llama_server, start_crossbar
from tools.llama_server import LlamaServer

_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class KeepAliveHeaderTests(TestCase):
    def test_timeout_parameter(self) -> None:
        self.assertEqual(keep_alive_timeout(b"timeout=5, max=100"), 5.0)  # llama-server
        self.assertEqual(keep_alive_timeout(b"max=100, Timeout = 30"), 30.0)
        for value in (b"max=100", b"timeout=", b"timeout=-1", b"timeout=1e9", b"timeout=nan", b"", b"timeout=99999999999"):
            self.assertIsNone(keep_alive_timeout(value), value)

    def test_retired_before_the_timeout(self) -> None:
        self.assertEqual(retire_after(5.0), 4.0)
        self.assertEqual(retire_after(1.0), 0.5)
        self.assertEqual(retire_after(0.0), 0.0)


class PeerClosedTests(TestCase):
    timeout = 20

    def test_connection_closed_by_the_host_is_not_handed_out(self) -> Deferred[None]:
        """The host closes an idle pooled connection; before the reactor has read the
        end of file, a request comes: the pool sees the close on the socket and the
        request goes on a new connection (never written on the dead one)."""

        async def go() -> None:
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen(8)
            server.setblocking(False)
            self.addCleanup(server.close)
            port = server.getsockname()[1]
            url = b"http://127.0.0.1:%d/v1/x" % port
            pool = H1Pool(reactor)
            self.addCleanup(pool.close)
            endpoints = UpstreamEndpoints(reactor, 5.0)

            async def accept() -> socket.socket:
                for _ in range(500):
                    try:
                        conn, _ = server.accept()
                        self.addCleanup(conn.close)
                        return conn
                    except BlockingIOError:
                        await deferLater(reactor, 0.01)
                self.fail("no connection")

            async def request_head(conn: socket.socket) -> bytes:
                # Read while the reactor runs: the kernel accepts the connection before the
                # reactor has seen it connected and written the request, so a blocking
                # recv() here could wait for a write that only the reactor makes.
                conn.setblocking(False)
                data = b""
                for _ in range(500):
                    try:
                        data += conn.recv(65536)
                    except BlockingIOError:
                        pass
                    if b"\r\n\r\n" in data:
                        return data
                    await deferLater(reactor, 0.01)
                self.fail(f"no whole request head from the pool within 5 s: {data!r}")

            d = H1Agent(ConnectTracker(endpoints), pool).request(b"GET", url, Headers(), None)
            host_side = await accept()
            self.assertTrue((await request_head(host_side)).startswith(b"GET /v1/x HTTP/1.1"))
            host_side.setblocking(True)
            host_side.settimeout(5)
            host_side.sendall(_ANSWER)
            response = await d
            self.assertEqual(await treq.content(response), b"ok")
            await deferLater(reactor, 0.05)  # the connection is back in the pool
            key = (b"http", b"127.0.0.1", port)
            self.assertEqual(len(pool._idle.get(key, [])), 1)
            host_side.close()  # the host closes it while idle...
            time.sleep(PEEK_AFTER + 0.05)  # ...and the reactor has not run since: the EOF is unread
            self.assertIsNone(pool.take(key), "a connection its host had closed was handed out")

        return ensureDeferred(go())


class LlamaKeepAliveTests(TestCase):
    timeout = 120

    def setUp(self) -> None:
        require_llama_server(self)
        self.server = LlamaServer("single")
        self.addCleanup(self.server.stop)
        self.server.start(timeout=60)

    async def _crossbar(self) -> tuple[Any, str]:
        """A crossbar with route ``r`` to the real llama-server, after its first poll."""
        service, base = await start_crossbar(
            self,
            "health: {interval: 60, timeout: 5}\n"
            f"hosts:\n  a: {self.server.url}\n"
            "routes:\n  r:\n    hosts: [a]\n    default_model: tiny-a\n",
        )
        await service.poller.when_first_round_done()
        return service, base

    def test_requests_around_the_keep_alive_timeout_all_succeed(self) -> Deferred[None]:
        """llama-server closes a connection idle for 5 s: requests after 3.9 to 5.6 s
        of quiet (before, at and after its timeout) all get their 200, nothing is
        marked down, and crossbar's pool never holds a connection past 4 s idle."""

        async def go() -> None:
            service, base = await self._crossbar()
            http = http_client(self)
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            codes = []
            for gap in (0.0, 3.9, 4.4, 5.0, 5.05, 5.6):
                await deferLater(reactor, gap)
                response = await http.post(base + "/r/v1/chat/completions", data=json.dumps(body).encode(),
                                           headers={"Content-Type": "application/json"})
                await treq.content(response)
                codes.append(response.code)
            self.assertEqual(codes, [200] * 6)
            status = service.runtime.table.get("a")
            assert status is not None
            self.assertTrue(status.healthy)
            self.assertEqual(status.last_err, "")
            for connections in service.pools.pool._idle.values():
                for connection in connections:
                    self.assertEqual(connection.keep_alive, 5.0)  # the host's word was read

        return ensureDeferred(go())

    def test_a_request_crossbar_reads_as_the_host_closes_the_idle_connection(self) -> Deferred[None]:
        """The soak's case: crossbar is busy (the reactor held) across llama-server's
        keep-alive timeout, with a request already waiting on a client connection; the
        host's close of the idle pooled connection is pending when crossbar takes it.
        The request still gets its 200 (a retired or fresh connection), never a 502."""

        async def go() -> None:
            service, base = await self._crossbar()
            port = int(base.rsplit(":", 1)[1])
            client = socket.create_connection(("127.0.0.1", port))
            self.addCleanup(client.close)
            client.setblocking(False)
            body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
            request = (b"POST /r/v1/chat/completions HTTP/1.1\r\nHost: crossbar\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body)) + body
            client.sendall(request)
            self.assertEqual(await _status_of_answer(client), 200)
            idle_from = time.monotonic()
            await deferLater(reactor, 4.95)
            client.sendall(request)  # waiting for crossbar, which is busy...
            time.sleep(max(0.0, idle_from + 5.3 - time.monotonic()))  # ...until after the host's 5 s
            self.assertEqual(await _status_of_answer(client), 200)
            status = service.runtime.table.get("a")
            assert status is not None
            self.assertEqual((status.healthy, status.last_err), (True, ""))

        return ensureDeferred(go())


async def _status_of_answer(sock: socket.socket, timeout: float = 30.0) -> int:
    """Read one whole HTTP/1.1 answer (Content-Length or chunked) from a non-blocking
    ``sock`` while the reactor runs; its status code."""
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            await deferLater(reactor, 0.01)
            continue
        if not chunk:
            break
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            continue
        lines = head.split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        if b"content-length" in headers and len(rest) >= int(headers[b"content-length"]):
            return int(lines[0].split()[1])
        if headers.get(b"transfer-encoding") == b"chunked" and rest.endswith(b"0\r\n\r\n"):
            return int(lines[0].split()[1])
    raise AssertionError(f"no whole answer: {data[:200]!r}")
