"""Rules 1 and 4 across processes (docs/design.md §Where models live, rule 7): a burst for a
model loaded nowhere that reaches two workers (real ``twistd`` with ``workers: 2``), or
two crossbar instances sharing ``cluster.redis``, makes exactly one host load it; while
one process's idle unload of a model is under way no process sends a request for it to
that host (the host would cut it), nor a second unload."""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from crossbar.state import cluster as cluster_module
from tests.fake_router import FakeRouter
from tests.harness import http_client, listen, start_crossbar, wait_for
from tests.process import start_twistd
from tests.redis_server import start_redis

MODELS = ["m1", "m2", "m3"]


def fleet_config(urls: list[str], extra: str = "") -> str:
    text = "health: {interval: 0.5, timeout: 2}\n" + extra + "hosts:\n"
    text += "".join(f"  h{i}: {{url: \"{u}\", models_max: 2}}\n" for i, u in enumerate(urls))
    text += f"routes:\n  r:\n    hosts: [{', '.join(f'h{i}' for i in range(len(urls)))}]\n    placement: {{}}\n"
    return text


def unload_config(urls: list[str], extra: str = "", idle_unload: float | None = 2.0) -> str:
    """h0 and h1 (``urls``) in route ``r``, whose models fall idle after ``idle_unload``
    seconds (None: never); h1 keeps ``m1`` loaded (route ``keep``), so only h0's goes."""
    text = "health: {interval: 0.5, timeout: 2}\n" + extra + "hosts:\n"
    text += "".join(f"  h{i}: {{url: \"{u}\", models_max: 2}}\n" for i, u in enumerate(urls))
    idle = "" if idle_unload is None else f"idle_unload: {idle_unload:g}"
    return text + ("routes:\n  keep:\n    hosts: [h1]\n    placement: {keep_loaded: [m1]}\n"
                   f"  r:\n    hosts: [h0, h1]\n    placement: {{{idle}}}\n")


async def burst(case: TestCase, bases: list[str], model: str, count: int = 20) -> list[int]:
    async def one(i: int) -> int:
        # a client of its own per request: a new connection each (SO_REUSEPORT spreads them)
        response = await http_client(case).post(bases[i % len(bases)] + "/r/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}]})
        await treq.content(response)
        return int(response.code)

    results = await DeferredList([ensureDeferred(one(i)) for i in range(count)])
    return [code for _, code in results]


class FleetBurstTests(TestCase):
    timeout = 120

    async def routers(self) -> tuple[list[FakeRouter], list[str]]:
        routers = [FakeRouter(MODELS, models_max=2, load_time=1.0) for _ in range(3)]
        for r in routers:
            self.addCleanup(r.stop)
        return routers, [await listen(self, r) for r in routers]

    async def unloading_routers(self) -> tuple[list[FakeRouter], list[str]]:
        """h0 and h1 with m1 loaded; h0 takes 3 s to unload a model (still serving it)."""
        routers = [FakeRouter(MODELS, models_max=2, unload_time=3.0) for _ in range(2)]
        for r in routers:
            r.state["m1"] = "loaded"
            self.addCleanup(r.stop)
        return routers, [await listen(self, r) for r in routers]

    async def no_request_into_the_unload(self, routers: list[FakeRouter], bases: list[str]) -> None:
        """A burst for m1 while h0 unloads it goes to h1 alone; one unload, nothing cut."""
        codes = await burst(self, bases, "m1")
        self.assertEqual(codes, [200] * 20)
        await wait_for(lambda: routers[0].state["m1"] == "unloaded", 10, "m1 unloaded on h0")
        await deferLater(reactor, 1.5)  # every process polled h0 since (no second unload)
        self.assertEqual((routers[0].completions, routers[1].completions.count("m1")), ([], 20))
        self.assertEqual([c for c in routers[0].commands if c[0] == "unload"], [("unload", "m1")])
        self.assertEqual(routers[0].cut, 0)

    def test_workers(self) -> Deferred[None]:
        async def go() -> None:
            routers, urls = await self.routers()
            proc = await start_twistd(self, fleet_config(urls, "workers: 2\ndrain: {delay: 0.001, grace: 0.001}\n"))
            http = http_client(self)

            async def both_workers_polled() -> bool:  # each worker answers status alike
                doc: Any = await treq.json_content(await http.get(proc.base + "/_crossbar/status"))
                return all(h["healthy"] for h in doc["hosts"].values())

            await wait_for(both_workers_polled, 30, "the hosts healthy")
            codes = await burst(self, [proc.base], "m2")
            self.assertEqual(codes, [200] * 20)
            # Shared like the in-flight counts (a host's max_inflight may be exceeded by
            # at most workers - 1): one load, or at most one more from the other worker
            # when both chose in the same moment (seen under a loaded box's full suite).
            loads = sorted(len(r.loads) for r in routers)
            self.assertIn(loads, ([0, 0, 1], [0, 1, 1]))
            proc.signal("TERM")  # its connections to the hosts close before the test ends
            await proc.ended
            await deferLater(reactor, 0.2)
        return ensureDeferred(go())

    def test_workers_unloading(self) -> Deferred[None]:
        async def go() -> None:
            routers, urls = await self.unloading_routers()
            proc = await start_twistd(self, unload_config(urls, "workers: 2\ndrain: {delay: 0.001, grace: 0.001}\n"))
            await wait_for(lambda: ("unload", "m1") in routers[0].commands, 30, "the idle unload")
            await self.no_request_into_the_unload(routers, [proc.base])
            proc.signal("TERM")
            await proc.ended
            await deferLater(reactor, 0.2)
        return ensureDeferred(go())

    def test_instances_sharing_redis(self) -> Deferred[None]:
        async def go() -> None:
            self.patch(cluster_module, "BOUND", 1.0)  # what is shared is under test, not a slow Redis
            redis = start_redis(self)
            routers, urls = await self.routers()
            instances = [await start_crossbar(self, fleet_config(urls, f"cluster: {{redis: \"{redis.url}\"}}\n"))
                         for _ in range(2)]
            for service, _ in instances:
                await service.poller.when_first_round_done()
            await wait_for(lambda: all(s.cluster is not None and s.cluster.joined and s.cluster.instances() == 2
                                       for s, _ in instances), what="both instances joined")
            first = ensureDeferred(burst(self, [instances[0][1]], "m2", 1))
            await wait_for(lambda: sum(len(r.loads) for r in routers) == 1, what="the first load")
            await wait_for(lambda: any(s.cluster.others(f"pl\0{h}\0m2") for s, _ in instances[1:]  # type: ignore[union-attr]
                                       for h in ("h0", "h1", "h2")), what="the load shared")
            codes = await burst(self, [base for _, base in instances], "m2", 19)
            self.assertEqual(await first + codes, [200] * 20)
            self.assertEqual(sorted(len(r.loads) for r in routers), [0, 0, 1])
        return ensureDeferred(go())

    def test_instances_sharing_redis_unloading(self) -> Deferred[None]:
        """The first instance unloads h0's idle m1; the second (no ``idle_unload`` of its
        own) sends m1 to h1 alone while it is under way."""
        async def go() -> None:
            self.patch(cluster_module, "BOUND", 1.0)
            redis = start_redis(self)
            routers, urls = await self.unloading_routers()
            shared = f"cluster: {{redis: \"{redis.url}\"}}\n"
            instances = [await start_crossbar(self, unload_config(urls, shared, idle_unload))
                         for idle_unload in (2.0, None)]
            await wait_for(lambda: all(s.cluster is not None and s.cluster.joined and s.cluster.instances() == 2
                                       for s, _ in instances), what="both instances joined")
            await wait_for(lambda: ("unload", "m1") in routers[0].commands, 30, "the idle unload")
            second = instances[1][0].cluster
            assert second is not None
            await wait_for(lambda: second.others("pd\0h0\0m1"), what="the unload shared")
            await self.no_request_into_the_unload(routers, [instances[1][1]])
        return ensureDeferred(go())
