"""Balancing against real llama-servers (docs/design.md §Choosing a host; §The proxy, rule 10).

Two single-model servers with the same model behind one route share concurrent streamed
requests made with the real ``openai`` client; a router-mode server takes a request for a
model it has only ``available`` and serves it; ``GET /{route}/v1/models`` merges both
kinds of host. Skipped when no llama-server can be had, except under CI (env
``CI=true``), where that is a failure.
"""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from tests.harness import http_client, require_llama_server, start_crossbar, wait_for
from tests.logs import LogCapture
from tests.test_openai_real import _stream
from tests.upstreams import host_status
from tools.llama_server import LlamaServer


class TwoSingleHostsTests(TestCase):
    timeout = 240

    def setUp(self) -> None:
        require_llama_server(self)

    def test_concurrent_streams_are_served_by_both(self) -> Deferred[None]:
        async def go() -> None:
            servers = [LlamaServer("single"), LlamaServer("single")]
            for server in servers:
                self.addCleanup(server.stop)
            await DeferredList([deferToThread(s.start, 90) for s in servers], fireOnOneErrback=True)
            log = LogCapture(self)
            service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 5}}
hosts:
  a: {servers[0].url}
  b: {servers[1].url}
routes:
  r:
    hosts: [a, b]
    affinity: {{key: none}}
""")
            await service.poller.when_first_round_done()
            self.assertTrue(service.table.is_healthy("a") and service.table.is_healthy("b"))
            results: Any = await DeferredList([deferToThread(_stream, base) for _ in range(4)],
                                              fireOnOneErrback=True, consumeErrors=True)
            served = [value for _, value in results]
            hosts = [host for host, _, _ in served]
            self.assertEqual(sorted(set(hosts)), ["a", "b"], hosts)
            for _, tokens, finish in served:
                self.assertGreater(len(tokens), 1)
                self.assertIn(finish, ("length", "stop"))
            lines = log.proxied()
            self.assertEqual(sorted(line["host"] for line in lines), sorted(hosts))
            self.assertTrue(all(line["why"].startswith("loaded ") for line in lines), lines)
            await wait_for(lambda: not service.runtime.inflight.by_host(), what="nothing in flight")
            status = await host_status(self, base)
            self.assertEqual((status["a"]["inflight"], status["b"]["inflight"]), (0, 0))

        return ensureDeferred(go())


class RouterAndSingleTests(TestCase):
    timeout = 240

    def setUp(self) -> None:
        require_llama_server(self)
        self.router = LlamaServer("router")
        self.addCleanup(self.router.stop)
        self.router.start(timeout=90)  # blocking, before any reactor work of the test

    def test_available_model_goes_to_router_and_models_merge(self) -> Deferred[None]:
        async def go() -> None:
            single = LlamaServer("single")
            self.addCleanup(single.stop)
            await deferToThread(single.start, 90)
            log = LogCapture(self)
            service, base = await start_crossbar(self, f"""
health: {{interval: 0.5, timeout: 5}}
hosts:
  single: {single.url}
  router: {self.router.url}
routes:
  r:
    hosts: [single, router]
    affinity: {{key: none}}
""")
            await service.poller.when_first_round_done()
            http = http_client(self)

            models: Any = await treq.json_content(await http.get(base + "/r/v1/models"))
            by_id = {m["id"]: m for m in models["data"]}
            self.assertEqual(sorted(by_id), ["tiny-a", "tiny-b"])
            self.assertEqual(by_id["tiny-a"]["crossbar"]["hosts"]["single"], "loaded")
            self.assertEqual(by_id["tiny-a"]["crossbar"]["hosts"]["router"], "available")
            self.assertNotIn("status", by_id["tiny-a"])  # single's entry: it lists tiny-a first
            self.assertEqual(by_id["tiny-b"]["crossbar"]["hosts"], {"router": "available"})
            self.assertEqual(by_id["tiny-b"]["status"]["value"], "unloaded")  # the router's own entry

            response = await http.post(
                base + "/r/v1/chat/completions",
                json={"model": "tiny-b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=120,
            )
            body: Any = await treq.json_content(response)
            self.assertEqual(response.code, 200, body)
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"router"])
            self.assertEqual(body["model"], "tiny-b")
            self.assertEqual([line["why"] for line in log.proxied() if line["path"] == "/v1/chat/completions"],
                             ["available least-busy affinity=none"])

            await wait_for(lambda: "tiny-b" in service.table.get("router").loaded,  # type: ignore[union-attr]
                           timeout=30, what="a poll sees tiny-b loaded")
            models = await treq.json_content(await http.get(base + "/r/v1/models"))
            by_id = {m["id"]: m for m in models["data"]}
            self.assertEqual(by_id["tiny-b"]["crossbar"]["hosts"], {"router": "loaded"})

        return ensureDeferred(go())
