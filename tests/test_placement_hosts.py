"""Where models live, end to end against fake router-mode hosts (tests/fake_router.py:
loading time, ``--models-max``, eviction of the least recently used idle model, the host's
queue, ``/models/load`` and ``/models/unload`` as llama-server answers them) (docs/design.md §Where models live, rules 1-7)."""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.trial.unittest import TestCase

from crossbar.process.service import CrossbarService
from tests.fake_router import FakeRouter, placement_yaml
from tests.harness import FakeLlama, http_client, listen, start_crossbar, wait_for

MODELS = ["m1", "m2", "m3", "m4"]


class CommandTests(TestCase):
    """The load and unload commands as llama-server's router mode answers them."""

    def test_answers(self) -> Deferred[None]:
        async def go() -> None:
            from crossbar.config import Host
            from crossbar.hosts.commands import CommandFailed, HTTPModelCommands
            from crossbar.upstream.pools import UpstreamPools
            from twisted.internet import reactor
            router = FakeRouter(MODELS, models_max=2, load_time=0.05)
            self.addCleanup(router.stop)
            host = Host(name="a", url=await listen(self, router))
            pools = UpstreamPools(reactor, 5)
            self.addCleanup(pools.close)
            commands = HTTPModelCommands(pools)
            await commands.send(host, "load", "m1")
            await commands.send(host, "load", "m1")  # 400 "model is already running": done
            failed = await self.assertFailure(commands.send(host, "load", "nope"), CommandFailed)
            self.assertEqual(failed.reason, "HTTP 404")
            await commands.send(host, "unload", "m1")
            self.assertEqual(router.commands, [("load", "m1"), ("load", "m1"), ("load", "nope"), ("unload", "m1")])
            self.assertEqual(router.state["m1"], "unloaded")
        return ensureDeferred(go())

    async def post(self, url: str, model: str, **extra: Any) -> Any:
        response = await http_client(self).post(url, json={"model": model, "messages": [], **extra})
        return response.code, await treq.content(response)

    def test_a_model_in_use_is_never_evicted(self) -> Deferred[None]:
        """As llama-server 0.7.0 does (tests/test_placement_real.py pins the real one): a
        request for another model waits at the host until the model in use falls idle;
        ``/models/load`` then is 500; ``/models/unload`` cuts the answers in flight."""
        async def go() -> None:
            router = FakeRouter(MODELS, models_max=1, load_time=0.05)
            self.addCleanup(router.stop)
            router.state.update(m1="loaded")
            url = await listen(self, router)
            stream = ensureDeferred(self.post(url + "/v1/chat/completions", "m1", stream=True, n=10, delay=0.05))
            await wait_for(lambda: router.inflight == 1, what="the stream")
            other = ensureDeferred(self.post(url + "/v1/chat/completions", "m2"))
            await wait_for(lambda: router.queue == ["m2"], what="m2 waiting at the host")
            self.assertEqual(await self.post(url + "/models/load", "m3"), (
                500, b'{"error":{"code":500,"message":"model limit reached, try again later","type":"server_error"}}'))
            self.assertEqual(router.state, {"m1": "loaded", "m2": "unloaded", "m3": "unloaded", "m4": "unloaded"})
            code, body = await stream
            self.assertEqual((code, body.endswith(b"data: [DONE]\n\n")), (200, True))  # not cut
            self.assertEqual((await other)[0], 200)
            self.assertEqual((router.loads, router.evictions, router.loaded()), (["m2"], ["m1"], ["m2"]))
            cut = ensureDeferred(self.post(url + "/v1/chat/completions", "m2", stream=True, n=40, delay=0.05))
            await wait_for(lambda: router.inflight == 1, what="a stream on m2")
            self.assertEqual(await self.post(url + "/models/unload", "m2"), (200, b'{"success":true}'))
            await self.assertFailure(cut, Exception)
            self.assertEqual(router.cut, 1)
            await wait_for(lambda: router.inflight == 0, what="the cut answer's end")
        return ensureDeferred(go())


class PlacementHostsTests(TestCase):
    timeout = 30

    async def fleet(self, routers: dict[str, FakeRouter], placement: str = "{}", host_extra: str = "",
                    others: dict[str, Any] | None = None) -> tuple[CrossbarService, str]:
        urls = {name: await listen(self, r) for name, r in {**routers, **(others or {})}.items()}
        text = placement_yaml({name: (url, routers[name].models_max if name in routers else None)
                               for name, url in urls.items()}, placement, "health: {interval: 0.1, timeout: 2}\n",
                              10, host_extra)
        service, base = await start_crossbar(self, text)
        await service.poller.when_first_round_done()
        return service, base

    async def chat(self, base: str, model: str, **extra: Any) -> Any:
        http = http_client(self)
        response = await http.post(base + "/r/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], **extra})
        await treq.content(response)
        return response

    def test_a_burst_for_a_model_loaded_nowhere_loads_it_on_one_host(self) -> Deferred[None]:
        async def go() -> None:
            routers = {n: FakeRouter(MODELS, models_max=2, load_time=0.5) for n in ("a", "b", "c")}
            service, base = await self.fleet(routers)
            results = await DeferredList([ensureDeferred(self.chat(base, "m3")) for _ in range(20)])
            codes = [r.code for ok, r in results]
            self.assertEqual(codes, [200] * 20)
            self.assertEqual(sorted(len(r.loads) for r in routers.values()), [0, 0, 1])
            self.assertEqual(sum(len(r.completions) for r in routers.values()), 20)
            metrics = (await treq.content(await http_client(self).get(base + "/_crossbar/metrics"))).decode()
            self.assertIn('crossbar_model_loads_total{host=', metrics)
            self.assertIn('reason="request"} 1.0', metrics)
            doc: Any = await treq.json_content(await http_client(self).get(base + "/_crossbar/dashboard.json"))
            whys = sorted(e["why"].split(" affinity=")[0] for e in doc["recent"])
            self.assertEqual([w for w in whys if w.startswith("available")], ["available load"], whys)  # the why
        return ensureDeferred(go())

    def test_a_load_goes_to_a_free_place_first_then_an_idle_lru_never_a_model_in_use(self) -> Deferred[None]:
        async def go() -> None:
            models = MODELS + ["m5", "m6"]
            a, b, c = (FakeRouter(models, models_max=2) for _ in range(3))
            a.state.update(m1="loaded", m2="loaded")  # both in use below
            b.state.update(m3="loaded", m4="loaded")  # idle
            c.state.update(m3="loaded")               # a free place
            service, base = await self.fleet({"a": a, "b": b, "c": c})
            streams = [ensureDeferred(self.chat(base, m, stream=True, n=30, delay=0.05)) for m in ("m1", "m2")]
            await wait_for(lambda: a.inflight == 2, what="two streams on a")
            response = await self.chat(base, "m5")
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"c"])
            await wait_for(lambda: "m5" in service.table.get("c").loaded, what="a poll showing m5 on c")  # type: ignore[union-attr]
            # now c is full too (m3, m5 both used just now? m3 never: its LRU is idle) and so is b
            response = await self.chat(base, "m6")
            self.assertIn(response.headers.getRawHeaders(b"x-crossbar-host"), ([b"b"], [b"c"]))
            self.assertEqual(a.evictions, [])
            self.assertEqual(a.loads, [])
            await DeferredList(streams)
        return ensureDeferred(go())

    def test_every_host_busy_waits_rather_than_evict(self) -> Deferred[None]:
        async def go() -> None:
            a = FakeRouter(MODELS, models_max=1)
            a.state.update(m1="loaded")
            service, base = await self.fleet({"a": a})
            stream = ensureDeferred(self.chat(base, "m1", stream=True, n=10, delay=0.05))
            await wait_for(lambda: a.inflight == 1, what="the stream")
            second = ensureDeferred(self.chat(base, "m2"))
            await wait_for(lambda: service.runtime.queued("r") == 1, what="m2 waiting")
            self.assertEqual(a.loads, [])  # m1 is in use: not evicted
            await stream
            response = await second  # m1 fell idle: now m2 may evict it
            self.assertEqual(response.code, 200)
            self.assertEqual(a.loads, ["m2"])
        return ensureDeferred(go())

    def test_spread_after_waiting(self) -> Deferred[None]:
        async def go() -> None:
            a, b = FakeRouter(MODELS, models_max=2), FakeRouter(MODELS, models_max=2)
            a.state.update(m1="loaded")
            service, base = await self.fleet({"a": a, "b": b}, "{spread_after: 0.5}", ", max_inflight: 1")
            stream = ensureDeferred(self.chat(base, "m1", stream=True, n=40, delay=0.05))
            await wait_for(lambda: a.inflight == 1, what="the stream")
            started = service.reactor.seconds()
            response = await self.chat(base, "m1")
            self.assertEqual(response.code, 200)
            self.assertEqual(response.headers.getRawHeaders(b"x-crossbar-host"), [b"b"])
            self.assertGreaterEqual(service.reactor.seconds() - started, 0.5)
            self.assertEqual(b.loads, ["m1"])
            self.assertEqual(service.runtime.placement.last_load["b"].reason, "spread")
            await stream
        return ensureDeferred(go())

    def test_idle_unload(self) -> Deferred[None]:
        async def go() -> None:
            a = FakeRouter(MODELS, models_max=2)
            a.state.update(m1="loaded", m2="loaded")
            service, base = await self.fleet({"a": a}, "{idle_unload: 0.6, keep_loaded: [m2]}")
            self.assertEqual((await self.chat(base, "m1")).code, 200)
            await wait_for(lambda: ("unload", "m1") in a.commands, what="m1 unloaded")
            await wait_for(lambda: "m1" not in service.table.get("a").loaded, what="a poll without m1")  # type: ignore[union-attr]
            self.assertEqual(a.loaded(), ["m2"])  # kept
            self.assertEqual([c for c in a.commands if c[0] == "unload"], [("unload", "m1")])
            status: Any = await treq.json_content(await http_client(self).get(base + "/_crossbar/status"))
            self.assertEqual(status["hosts"]["a"]["last_unload"]["reason"], "idle")
            self.assertEqual(status["hosts"]["a"]["models_max"], 2)
            self.assertEqual(status["hosts"]["a"]["models"]["m2"], {"inflight": 0, "last_use": None, "unloading": False})
            metrics = (await treq.content(await http_client(self).get(base + "/_crossbar/metrics"))).decode()
            self.assertIn('crossbar_model_unloads_total{host="a",model="m1",reason="idle"} 1.0', metrics)
        return ensureDeferred(go())

    def test_a_request_for_a_model_being_unloaded_on_its_only_host_waits_for_the_unload(self) -> Deferred[None]:
        """Rule 4: a streamed request for m1 sent while the host stops m1 (it takes 1 s
        and cuts what it serves of m1 meanwhile, as llama-server does) is not sent into
        the unload as a load of an "available" model: it waits until a poll shows m1
        gone, then loads it again; nothing is cut and the host stays healthy."""
        async def go() -> None:
            a = FakeRouter(MODELS, models_max=2, unload_time=1.0)
            a.state.update(m1="loaded")
            service, base = await self.fleet({"a": a}, "{idle_unload: 0.3}")
            await wait_for(lambda: ("unload", "m1") in a.commands, what="the idle unload")
            response = await self.chat(base, "m1", stream=True)
            self.assertEqual(response.code, 200)
            self.assertEqual((a.cut, a.loads, a.completions), (0, ["m1"], ["m1"]))
            self.assertTrue(service.table.get("a").healthy)  # type: ignore[union-attr]
            whys = [e["why"] for e in (await treq.json_content(
                await http_client(self).get(base + "/_crossbar/dashboard.json")))["recent"]]
            self.assertEqual([w.split(" affinity=")[0] for w in whys], ["available load queued"])
        return ensureDeferred(go())

    def test_keep_loaded_after_start_and_after_a_restart(self) -> Deferred[None]:
        async def go() -> None:
            a, b = FakeRouter(MODELS, models_max=2), FakeRouter(MODELS, models_max=2)
            service, base = await self.fleet({"a": a, "b": b}, "{keep_loaded: [m2]}")
            await wait_for(lambda: a.loaded() + b.loaded() == ["m2"], what="m2 kept loaded")
            holder = a if a.loaded() else b
            holder.restart()
            await wait_for(lambda: a.loaded() + b.loaded() == ["m2"], what="m2 loaded again")
            self.assertEqual(len(a.loads) + len(b.loads), 2)
            loads = [c for r in (a, b) for c in r.commands if c[0] == "load"]
            self.assertEqual(loads, [("load", "m2")] * 2)
        return ensureDeferred(go())

    def test_single_model_hosts_are_never_loaded_or_unloaded(self) -> Deferred[None]:
        async def go() -> None:
            single = FakeLlama(["m2"])
            service, base = await self.fleet({}, "{idle_unload: 0.2, keep_loaded: [m2]}", others={"s": single})
            self.assertEqual((await self.chat(base, "m2")).code, 200)
            await wait_for(lambda: len([x for x in single.seen if x.uri == b"/v1/models"]) > 8, what="polls")
            self.assertEqual([x.uri for x in single.seen if x.uri.startswith(b"/models")], [])
        return ensureDeferred(go())

    def test_clients_still_may_not_load_models(self) -> Deferred[None]:
        async def go() -> None:
            a = FakeRouter(MODELS, models_max=2)
            service, base = await self.fleet({"a": a})
            response = await http_client(self).post(base + "/r/models/load", json={"model": "m1"})
            await treq.content(response)
            self.assertEqual(response.code, 403)
            self.assertEqual(a.commands, [])
        return ensureDeferred(go())
