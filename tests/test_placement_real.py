"""Where models live against real llama-servers in router mode (``--models-max``), with
the tiny models (docs/design.md §Where models live): a burst for a model loaded nowhere
makes exactly one host load it; a spread after ``spread_after``; an idle unload;
``keep_loaded`` after start and after the host restarts; and what tests/fake_router.py
copies of the host itself: a load never evicts a model with a request in flight.

Skipped when no llama-server can be had (``python tools/llama_server.py provision``),
except under CI (env ``CI=true``), where that is a failure.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from crossbar.process.service import CrossbarService
from tests.fake_router import placement_yaml
from tests.harness import http_client, port_of, require_llama_server, start_crossbar, wait_for
from tools.llama_server import LlamaServer


class RouterPlacementTests(TestCase):
    timeout = 240

    def start_servers(self, count: int, models_max: int) -> list[LlamaServer]:
        require_llama_server(self)
        servers = []
        for _ in range(count):
            server = LlamaServer("router", extra_args=["--models-max", str(models_max)])
            self.addCleanup(server.stop)
            server.start(timeout=90)  # blocking, before any reactor work of the test
            servers.append(server)
        return servers

    async def crossbar(self, servers: list[LlamaServer], models_max: int, placement: str,
                       host_extra: str = "") -> tuple[CrossbarService, str]:
        names = [f"llama{i}" for i in range(len(servers))]
        text = placement_yaml({name: (server.url, models_max) for name, server in zip(names, servers)}, placement,
                              "health: {interval: 0.2, timeout: 5}\ntimeouts: {first_byte: 60}\n", 60, host_extra)
        service, base = await start_crossbar(self, text)
        await service.poller.when_first_round_done()
        return service, base

    async def states(self, server: LlamaServer) -> dict[str, str]:
        listed: Any = await treq.json_content(await http_client(self).get(server.url + "/v1/models"))
        return {m["id"]: m["status"]["value"] for m in listed["data"]}

    async def chat(self, base: str, model: str) -> Any:
        response = await http_client(self).post(base + "/r/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=120)
        body = await treq.json_content(response)
        self.assertEqual(response.code, 200, body)
        return response

    def test_a_burst_for_a_model_loaded_nowhere_loads_it_on_one_host(self) -> Deferred[None]:
        servers = self.start_servers(2, 2)

        async def go() -> None:
            service, base = await self.crossbar(servers, 2, "{}")
            for server in servers:
                self.assertEqual((await self.states(server))["tiny-b"], "unloaded")
            results = await DeferredList([ensureDeferred(self.chat(base, "tiny-b")) for _ in range(20)],
                                         consumeErrors=True)
            self.assertTrue(all(ok for ok, _ in results), results)
            held = [s for s in servers if (await self.states(s))["tiny-b"] in ("loaded", "loading")]
            self.assertEqual(len(held), 1)
            metrics = (await treq.content(await http_client(self).get(base + "/_crossbar/metrics"))).decode()
            loads = [line for line in metrics.splitlines() if line.startswith("crossbar_model_loads_total{")]
            self.assertEqual(len(loads), 1, loads)
            self.assertTrue(loads[0].endswith(" 1.0") and 'reason="request"' in loads[0], loads)

        return ensureDeferred(go())

    def test_spread_after_waiting(self) -> Deferred[None]:
        servers = self.start_servers(2, 2)

        async def go() -> None:
            service, base = await self.crossbar(servers, 2, "{spread_after: 0.5}", ", max_inflight: 1")
            first = await self.chat(base, "tiny-a")
            (holder,) = first.headers.getRawHeaders(b"x-crossbar-host")
            holder_name = holder.decode()
            await wait_for(lambda: "tiny-a" in service.table.get(holder_name).loaded,  # type: ignore[union-attr]
                           timeout=30, what="a poll showing tiny-a loaded")
            stalled = await deferToThread(stall, port_of(base))  # holds the holder's one slot
            self.addCleanup(stalled.close)
            await wait_for(lambda: service.runtime.inflight.host(holder_name) == 1, what="the held slot")
            started = reactor.seconds()
            spread = await self.chat(base, "tiny-a")
            self.assertGreaterEqual(reactor.seconds() - started, 0.5)
            (other,) = spread.headers.getRawHeaders(b"x-crossbar-host")
            self.assertNotEqual(other, holder)
            self.assertEqual(service.runtime.placement.last_load[other.decode()].reason, "spread")
            states = [await self.states(s) for s in servers]
            self.assertEqual([s["tiny-a"] for s in states], ["loaded", "loaded"])

        return ensureDeferred(go())

    def test_idle_unload(self) -> Deferred[None]:
        (server,) = self.start_servers(1, 2)

        async def go() -> None:
            service, base = await self.crossbar([server], 2, "{idle_unload: 1}")
            await self.chat(base, "tiny-a")
            self.assertEqual((await self.states(server))["tiny-a"], "loaded")

            async def unloaded() -> bool:
                return (await self.states(server))["tiny-a"] == "unloaded"

            await wait_for(unloaded, timeout=30, what="tiny-a unloaded", step=0.2)

            async def counted() -> Any:  # an unload counts once crossbar's poll shows it done
                doc: Any = await treq.json_content(await http_client(self).get(base + "/_crossbar/status"))
                return doc["hosts"]["llama0"]["last_unload"] and doc

            status = await wait_for(counted, timeout=10, what="the unload in status", step=0.2)
            self.assertEqual(status["hosts"]["llama0"]["last_unload"]["model"], "tiny-a")
            self.assertEqual(status["hosts"]["llama0"]["last_unload"]["reason"], "idle")

        return ensureDeferred(go())

    def test_keep_loaded_after_start_and_after_a_restart(self) -> Deferred[None]:
        (server,) = self.start_servers(1, 1)

        async def go() -> None:
            service, base = await self.crossbar([server], 1, "{keep_loaded: [tiny-b]}")

            async def kept() -> bool:
                return (await self.states(server))["tiny-b"] == "loaded"

            await wait_for(kept, timeout=30, what="tiny-b loaded after start", step=0.2)
            await deferToThread(server.stop)
            await wait_for(lambda: not service.table.is_healthy("llama0"), timeout=30, what="the host down")
            await deferToThread(server.start, 90)
            await wait_for(kept, timeout=60, what="tiny-b loaded after the restart", step=0.2)
            self.assertEqual(service.runtime.placement.last_load["llama0"].reason, "keep")

        return ensureDeferred(go())

    def test_the_host_never_evicts_a_model_in_use(self) -> Deferred[None]:
        """llama-server's router (``--models-max 1``) keeps a model with a request in
        flight: a request for another model waits at the host, the model it will evict
        listed loaded, until the first one's answer ends (tests/fake_router.py does the
        same; bench/README.md §Where models live)."""
        (server,) = self.start_servers(1, 1)

        async def go() -> None:
            await treq.content(await http_client(self).post(server.url + "/v1/chat/completions", json={
                "model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
            stalled = await deferToThread(stall, server.port, b"/completion")
            self.addCleanup(stalled.close)
            other = http_client(self).post(server.url + "/v1/chat/completions", json={
                "model": "tiny-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=120)
            waited: list[bool] = []
            other.addBoth(lambda r: (waited.append(True), r)[1])
            for _ in range(10):  # 2 s: tiny-b would load in milliseconds were tiny-a evicted
                await deferLater(reactor, 0.2)
                self.assertEqual(await self.states(server), {"tiny-a": "loaded", "tiny-b": "unloaded"})
            self.assertEqual(waited, [])
            stalled.close()
            response = await other
            self.assertEqual(response.code, 200, await treq.content(response))
            self.assertEqual(await self.states(server), {"tiny-a": "unloaded", "tiny-b": "loaded"})

        return ensureDeferred(go())


def stall(port: int, path: bytes = b"/r/completion") -> socket.socket:
    """A client that asks crossbar (or a host: ``path`` ``/completion``) for a long
    streamed answer (token probabilities) of tiny-a and reads none of it, with a tiny
    receive window: its host's slot stays taken."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": "tiny-a", "prompt": "hi", "n_predict": 480, "n_probs": 100, "stream": True}).encode()
    sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock
