"""Several crossbars sharing counts through a real Redis (docs/design.md §Several crossbars).

Two crossbar services (two instances, each with its own id in Redis) in front of one
loopback host with ``max_inflight: 2``; Debian's ``redis-server`` is started on a free
port per test (:mod:`tests.redis_server`).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.config import ConfigError, parse_config
from crossbar.process.service import CrossbarService
from crossbar.state import cluster as cluster_module
from crossbar.state.cluster import RESYNC, TTL
from twisted.logger import formatEvent

from tests.logs import LogCapture
from tests.harness import FakeLlama, http_client, listen, start_crossbar, wait_for
from tests.redis_server import RedisServer, start_redis


class Held:
    """A chat handler that answers the head and one event, then holds the stream open
    until :meth:`end` (a request's host slot stays taken meanwhile).

    :ivar open: the streams not ended yet; :ivar most: the most open at once.
    :ivar arrived: reactor seconds at which each request arrived.
    """

    def __init__(self) -> None:
        self.open: list[Request] = []
        self.most = 0
        self.arrived: list[float] = []

    def __call__(self, request: Request, body: bytes) -> Any:
        self.arrived.append(reactor.seconds())
        request.setHeader(b"content-type", b"text/event-stream")
        request.write(b'data: {"choices": []}\n\n')
        self.open.append(request)
        self.most = max(self.most, len(self.open))
        request.notifyFinish().addBoth(lambda _: request in self.open and self.open.remove(request))
        return NOT_DONE_YET

    def end(self, n: int = 1) -> None:
        """Finish the ``n`` oldest open streams."""
        for request in self.open[:n]:
            request.write(b"data: [DONE]\n\n")
            request.finish()


async def _held_hosts(case: TestCase, *names: str) -> tuple[dict[str, Held], dict[str, str]]:
    """A fake host serving model ``m`` per name whose chat answers wait in a :class:`Held`:
    (name -> its Held, name -> its URL)."""
    held = {name: Held() for name in names}
    urls = {}
    for name, handler in held.items():
        fake = FakeLlama(["m"])
        fake.handlers[b"/v1/chat/completions"] = handler
        urls[name] = await listen(case, fake)
    return held, urls


def config(host_url: str, redis_url: str, queue_timeout: float = 30) -> str:
    return (
        f"cluster:\n  redis: {redis_url}\n"
        "health: {interval: 60, timeout: 5}\n"
        f"hosts:\n  h:\n    url: {host_url}\n    max_inflight: 2\n"
        f"routes:\n  r:\n    hosts: [h]\n    queue: {{max: 50, timeout: {queue_timeout}}}\n"
    )


class ConfigTests(TestCase):
    """``cluster.redis`` in the config: one-line errors, the password never quoted."""

    def parse(self, url: str, environ: dict[str, str] | None = None) -> Any:
        text = (f"listen: tcp:0\ncluster:\n  redis: {url}\nhosts:\n  h: http://127.0.0.1:1\n"
                "routes:\n  r:\n    hosts: [h]\n")
        return parse_config(text, "c.yaml", environ or {})

    def test_urls(self) -> None:
        r = self.parse("redis://10.0.0.2:6380/3").cluster.redis
        self.assertEqual((r.tls, r.host, r.port, r.db, r.password), (False, "10.0.0.2", 6380, 3, None))
        r = self.parse("rediss://:${PW}@cache.example/0", {"PW": "s3cr%40t"}).cluster.redis
        self.assertEqual((r.tls, r.host, r.port, r.password), (True, "cache.example", 6379, "s3cr@t"))
        self.assertNotIn("s3cr", repr(r))
        r = self.parse("redis://user:pw@[::1]:7000").cluster.redis
        self.assertEqual((r.host, r.port, r.username, r.password, r.db), ("::1", 7000, "user", "pw", 0))
        self.assertEqual(r.display(), "redis://[::1]:7000/0")
        self.assertIsNone(parse_config("listen: tcp:0\nhosts:\n  h: http://h:1\nroutes:\n  r:\n    hosts: [h]\n",
                                       "c.yaml", {}).cluster)

    def test_errors(self) -> None:
        for url, problem in [
            ("http://h:1", "must be redis://"),
            ("redis://:hunter2@h:0/0", "the port must be a number from 1 to 65535"),
            ("redis://:hunter2@h:1/x", "the database"),
            ("redis://:${NOPE}@h", "environment variable NOPE is not set"),
        ]:
            with self.assertRaises(ConfigError) as e:
                self.parse(url)
            self.assertIn("c.yaml: cluster.redis: ", str(e.exception))
            self.assertIn(problem, str(e.exception))
            self.assertNotIn("hunter2", str(e.exception))
            self.assertNotIn("\n", str(e.exception))
        with self.assertRaises(ConfigError) as e:
            parse_config("listen: tcp:0\ncluster: {url: x}\nhosts:\n  h: http://h:1\nroutes:\n  r:\n    hosts: [h]\n",
                         "c.yaml", {})
        self.assertIn("cluster.url: unknown key", str(e.exception))


class TwoInstances(TestCase):
    """Two instances, one Redis, one host with ``max_inflight: 2``."""

    timeout = 90

    async def start(self, queue_timeout: float = 30, password: str | None = None
                    ) -> tuple[RedisServer, Held, list[tuple[CrossbarService, str]]]:
        # What is shared is under test here, not the fallback when Redis is slow: a
        # reply bound of 1 s instead of 50 ms, so on a loaded machine a late reply does
        # not send an instance alone (each then admits max_inflight: 2 + 2 at the host).
        self.patch(cluster_module, "BOUND", 1.0)
        redis = start_redis(self, password)
        fake = FakeLlama(["m"])
        held = Held()
        fake.handlers[b"/v1/chat/completions"] = held
        url = await listen(self, fake)
        instances = [await start_crossbar(self, config(url, redis.url, queue_timeout)) for _ in range(2)]
        for service, _ in instances:
            await service.poller.when_first_round_done()
        await wait_for(lambda: all(s.cluster is not None and s.cluster.joined and s.cluster.instances() == 2
                                   for s, _ in instances), what="both instances joined")
        return redis, held, instances

    def post(self, base: str) -> Deferred[Any]:
        client = http_client(self)
        return client.post(base + "/r/v1/chat/completions", json={"model": "m", "stream": True})

    async def test_room_is_shared(self) -> None:
        """Requests spread over both instances never put more than 2 + (2 - 1) at the
        host; the rest wait (in either instance's queue) and all are served."""
        redis, held, instances = await self.start()
        answers = [self.post(instances[i % 2][1]) for i in range(8)]
        await wait_for(lambda: len(held.open) + sum(len(s.runtime.queues) for s, _ in instances) == 8,
                       what="every request at the host or queued")
        self.assertEqual([s.cluster.lost for s, _ in instances if s.cluster is not None], [0, 0],
                         "an instance lost Redis and counted alone")
        self.assertLessEqual(held.most, 3)
        self.assertGreaterEqual(sum(len(s.runtime.queues) for s, _ in instances), 5)
        while len(held.arrived) < 8:
            held.end(1)
            await deferLater(reactor, 0.05)
            self.assertLessEqual(held.most, 3)
        held.end(len(held.open))
        results = await DeferredList(answers, consumeErrors=True)
        codes = [r.code for ok, r in results if ok]
        self.assertEqual(codes, [200] * 8)
        for r in [r for ok, r in results if ok]:
            await r.content()
        self.assertLessEqual(held.most, 3)

    async def test_burst_takes_room_atomically(self) -> None:
        """A burst reaching both instances at once: the host never has more than its
        max_inflight (each place is taken in Redis before the request goes), status
        never shows more than the host has, and all are served in turn."""
        redis, held, instances = await self.start()
        http = [http_client(self) for _ in instances]
        for _ in range(3):  # a few bursts: each instance's view is fresh each time
            before = len(held.arrived)
            answers = [http[i % 2].post(instances[i % 2][1] + "/r/v1/chat/completions",
                                        json={"model": "m", "stream": True}) for i in range(8)]
            await wait_for(lambda: len(held.open) + sum(len(s.runtime.queues) for s, _ in instances) == 8,
                           what="every request at the host or queued")
            self.assertEqual([s.cluster.slow_checks.count for s, _ in instances if s.cluster is not None], [0, 0])
            self.assertEqual(held.most, 2)
            await wait_for(lambda: all(s.runtime.inflight.host("h") == 2 for s, _ in instances),
                           what="each instance counts the host's two")
            give_up = reactor.seconds() + 35  # (queue.timeout is 30 s: one never sent is answered by then)
            while (held.open or len(held.arrived) < before + 8) and reactor.seconds() < give_up:
                held.end(1)  # (not while one is on its way to the host)
                await deferLater(reactor, 0.02)
                self.assertLessEqual(len(held.open), 2)
                for service, _ in instances:
                    self.assertLessEqual(service.runtime.inflight.host("h"), 2)
            results = await DeferredList(answers, consumeErrors=True)
            answered = [(r.code, await r.content()) for ok, r in results if ok]
            self.assertEqual([code for code, _ in answered], [200] * 8, answered)
            self.assertEqual(held.most, 2)
            held.most = 0

    async def test_freed_slot_wakes_the_other_instance(self) -> None:
        """A slot freed on B dispatches the request waiting on A at once: through the
        published change, not the next full read (none comes within the test)."""
        redis, held, (a, b) = await self.start()
        for service, _ in (a, b):
            assert service.cluster is not None
            service.cluster._resync.stop()  # no full read: only the published change can wake A
        first = [self.post(b[1]) for _ in range(2)]
        await wait_for(lambda: a[0].runtime.inflight.host("h") == 2, what="A sees B's two requests")
        waiting = self.post(a[1])
        await wait_for(lambda: len(a[0].runtime.queues) == 1, what="A's request waits")
        self.assertEqual(len(held.arrived), 2)
        released: list[float] = []
        dispatched: list[float] = []
        b_release = b[0].runtime.inflight.on_release
        b[0].runtime.inflight.on_release = lambda: (released.append(reactor.seconds()), b_release and b_release())
        a_enter = a[0].runtime.inflight.enter
        a[0].runtime.inflight.enter = lambda r, h, limit=None: (  # type: ignore[method-assign]
            dispatched.append(reactor.seconds()), a_enter(r, h, limit))[1]
        held.end(1)
        await wait_for(lambda: dispatched, what="A dispatches")
        # The design's 20 ms, with room for a loaded machine: a wake there took 0.5-11 ms,
        # and once 88 ms (three processes scheduled in turn: B, Redis, A).
        self.assertLess(dispatched[0] - released[0], 0.5)
        await wait_for(lambda: len(held.arrived) == 3, what="A's request at the host")  # else it is held forever
        held.end(len(held.open))
        for d in [*first, waiting]:
            await (await d).content()

    async def test_dead_instance_stops_counting(self) -> None:
        """An instance that dies without a word (its connections cut, nothing removed):
        its requests stop counting at the other within 10 s."""
        redis, held, (a, b) = await self.start()
        answers = [self.post(b[1]) for _ in range(2)]
        await wait_for(lambda: a[0].runtime.inflight.host("h") == 2, what="A sees B's requests")
        cluster = b[0].cluster
        assert cluster is not None
        for loop in (cluster._resync, cluster._heartbeat):
            loop.stop()
        cluster.joined = False  # like a process gone: nothing more is written or removed
        cluster.link.factory.disconnect()
        cluster.link.subscriber.disconnect()
        started = reactor.seconds()
        await wait_for(lambda: a[0].runtime.inflight.host("h") == 0, timeout=10, what="B's counts expire", step=0.1)
        self.assertLess(reactor.seconds() - started, TTL + RESYNC + 0.5)
        held.end(len(held.open))
        for d in answers:
            await (await d).content()

    async def test_redis_down_and_back(self) -> None:
        """Redis stopped mid-load: no request fails, each instance goes on alone
        (metric 0, still ready); after Redis is back both agree on the counts again."""
        redis, held, (a, b) = await self.start(password="pw-1")
        logs = LogCapture(self)
        first = [self.post(a[1]), self.post(b[1])]
        await wait_for(lambda: a[0].runtime.inflight.host("h") == 2 == b[0].runtime.inflight.host("h"),
                       what="both see both")
        redis.stop()
        await wait_for(lambda: not a[0].cluster.joined and not b[0].cluster.joined,  # type: ignore[union-attr]
                       what="both alone")
        self.assertTrue(a[0].runtime.ready and b[0].runtime.ready)
        self.assertIn(b"crossbar_cluster_up 0.0", a[0].metrics.render())
        status = await (await http_client(self).get(a[1] + "/_crossbar/status")).json()
        self.assertEqual(status["cluster"], {"shared": False, "instances": 1})
        await deferLater(reactor, 2.5)  # reconnection attempts meanwhile
        said = [formatEvent(e) for e in logs.events if e.get("log_namespace") == "crossbar.cluster"]
        self.assertEqual(len(said), 2, said)  # one line per instance
        self.assertIn("counting this instance's requests alone", said[0])
        self.assertNotIn("pw-1", " ".join(formatEvent(e) or "" for e in logs.events))
        self.assertEqual(logs.errors(), [])
        self.assertFalse([e for e in logs.events if "retry" in (formatEvent(e) or "").lower()])
        # Alone, each counts its own one request: each takes one more.
        more = [self.post(a[1]), self.post(b[1])]
        await wait_for(lambda: len(held.arrived) == 4, what="served while Redis is down")
        self.assertEqual(a[0].runtime.inflight.host("h"), 2)
        redis.start()
        await wait_for(lambda: a[0].cluster.joined and b[0].cluster.joined,  # type: ignore[union-attr]
                       timeout=10, what="both rejoined")
        await wait_for(lambda: a[0].runtime.inflight.host("h") == 4 == b[0].runtime.inflight.host("h"),
                       what="the counts agree again")
        self.assertIn(b"crossbar_cluster_up 1.0", a[0].metrics.render())
        status = await (await http_client(self).get(a[1] + "/_crossbar/status")).json()
        self.assertEqual(status["cluster"], {"shared": True, "instances": 2})
        self.assertEqual(status["hosts"]["h"]["inflight"], 4)
        held.end(len(held.open))
        results = await DeferredList([*first, *more], consumeErrors=True)
        self.assertEqual([r.code for ok, r in results if ok], [200] * 4)
        for _, r in results:
            await r.content()
        await wait_for(lambda: a[0].runtime.inflight.host("h") == 0 == b[0].runtime.inflight.host("h"),
                       what="all released")


class AffinityBound(TestCase):
    """The affinity bound counts both instances' requests (docs/design.md §Cache affinity):
    four requests of one conversation, alternately through two instances, hosts without
    limits, ``balance: 1.25``. The bound ceil(1.25 x (tier's in-flight + 1) / 2) over
    the fleet's load sends the third to the other host: 3 + 1 (alone, each instance
    would see only its own 2 and keep all four home: 4 + 0)."""

    timeout = 60

    async def test_bound_over_both(self) -> None:
        redis = start_redis(self)
        held, urls = await _held_hosts(self, "a", "b")
        text = (f"cluster:\n  redis: {redis.url}\nhealth: {{interval: 60, timeout: 5}}\nhosts:\n"
                + "".join(f"  {n}: {u}\n" for n, u in urls.items()) + "routes:\n  r:\n    hosts: [a, b]\n")
        instances = [await start_crossbar(self, text) for _ in range(2)]
        for service, _ in instances:
            await service.poller.when_first_round_done()
        await wait_for(lambda: all(s.cluster is not None and s.cluster.instances() == 2 for s, _ in instances),
                       what="joined")
        http = http_client(self)
        prompt = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "one conversation"}]}
        answers = []
        for i in range(4):
            answers.append(http.post(instances[i % 2][1] + "/r/v1/chat/completions", json=prompt))
            await wait_for(lambda: sum(len(h.arrived) for h in held.values()) == i + 1, what=f"request {i}")
            await wait_for(lambda: all(s.runtime.inflight.host("a") + s.runtime.inflight.host("b") == i + 1
                                       for s, _ in instances), what="both instances see it")
        self.assertEqual(sorted(len(h.open) for h in held.values()), [1, 3])
        spills = sum(s.runtime.affinity("r", "spill") for s, _ in instances)
        self.assertEqual(spills, 1)
        for h in held.values():
            h.end(len(h.open))
        for d in answers:
            await (await d).content()


class Processes(TestCase):
    """Real ``twistd crossbar`` processes: one with ``workers: 2`` (each worker an
    instance of its own) and one alone, over one Redis; the lone one is killed -9."""

    timeout = 90

    async def test_workers_and_kill_9(self) -> None:
        from tests.process import start_twistd

        redis = start_redis(self)
        fake = FakeLlama(["m"])
        held = Held()
        fake.handlers[b"/v1/chat/completions"] = held
        url = await listen(self, fake)
        text = "drain: {delay: 0.01, grace: 0.01}\n" + config(url, redis.url)
        x = await start_twistd(self, "workers: 2\n" + text)
        y = await start_twistd(self, text)
        await wait_for(lambda: redis.command("ZCARD", "crossbar:live") == 3, timeout=20, what="three instances")
        http = http_client(self)

        async def all_see_three() -> bool:
            for base in (x.base, x.base, x.base, x.base, y.base):
                doc = await (await http.get(base + "/_crossbar/status")).json()
                if doc["cluster"] != {"shared": True, "instances": 3}:
                    return False
            return True

        await wait_for(all_see_three, timeout=10, what="every instance sees three")

        def post(base: str) -> Deferred[Any]:
            return http.post(base + "/r/v1/chat/completions", json={"model": "m", "stream": True})

        answers = [post((x, y)[i % 2].base) for i in range(8)]
        await wait_for(lambda: len(held.arrived) >= 2, what="the first requests")
        while len(held.arrived) < 8:
            await deferLater(reactor, 0.2)
            self.assertLessEqual(held.most, 2 + 2)  # max_inflight + (instances - 1)
            held.end(1)
        held.end(len(held.open))
        for d in answers:
            response = await d
            self.assertEqual(response.code, 200)
            await response.content()

        async def status(base: str) -> Any:
            return await (await http.get(base + "/_crossbar/status")).json()

        # Two requests through y; x's next request waits for room.
        on_y = [post(y.base), post(y.base)]
        await wait_for(lambda: len(held.arrived) == 10, what="y's two requests")

        async def x_sees_two() -> bool:
            return all([(await status(x.base))["hosts"]["h"]["inflight"] == 2 for _ in range(4)])

        await wait_for(x_sees_two, what="both of x's workers see y's requests")
        waiting = post(x.base)
        await deferLater(reactor, 0.3)
        self.assertEqual(len(held.arrived), 10)
        killed_at = reactor.seconds()
        y.signal("KILL")
        await wait_for(lambda: len(held.arrived) == 11, timeout=12, what="x's request dispatched", step=0.1)
        self.assertLess(held.arrived[-1] - killed_at, 10)
        held.end(len(held.open))
        self.assertEqual((await waiting).code, 200)
        for d in on_y:
            d.addErrback(lambda _: None)
        # x's kept-alive connections to the host close with it (and its workers),
        # before the test ends.
        x.signal("TERM")
        await x.ended
        await y.ended
        await deferLater(reactor, 0.2)


class BehindHAProxy(TestCase):
    """The issue's scenario: two crossbar processes sharing a Redis behind the shipped
    ``contrib/haproxy/haproxy.cfg``, two hosts with 2 slots each (``max_inflight: 2``),
    four streams with one prompt (one affinity key): they spread over both hosts
    instead of four at the first (which is what the same test gives without
    ``cluster``: [0, 4])."""

    timeout = 90

    async def test_four_streams_one_prompt(self) -> None:
        from tests.process import Twistd, start_twistd, twistd_env
        from tests.test_contrib_haproxy import CONFIG, free_port, require_haproxy

        executable = require_haproxy(self)
        redis = start_redis(self)
        held, urls = await _held_hosts(self, "a", "b")
        text = (
            f"drain: {{delay: 0.01, grace: 0.01}}\ncluster:\n  redis: {redis.url}\n"
            "health: {interval: 60, timeout: 5}\nhosts:\n"
            + "".join(f"  {n}: {{url: {u}, max_inflight: 2}}\n" for n, u in urls.items())
            + "routes:\n  r:\n    hosts: [a, b]\n"
        )
        cb = [await start_twistd(self, text) for _ in range(2)]
        lb_port = free_port()
        lb = Twistd()
        reactor.spawnProcess(lb, executable, [executable, "-db", "-f", CONFIG], env={**twistd_env(), **{
            "CROSSBAR_LB_BIND": f"127.0.0.1:{lb_port}", "CROSSBAR_1": f"127.0.0.1:{cb[0].port}",
            "CROSSBAR_2": f"127.0.0.1:{cb[1].port}", "CROSSBAR_LB_LOG": "stdout"}})

        async def stop_lb() -> None:
            if lb.exit is None:
                lb.signal("KILL")
                await lb.ended

        self.addCleanup(stop_lb)
        base = f"http://127.0.0.1:{lb_port}"
        http = http_client(self)

        async def lb_ready() -> bool:
            try:
                response = await http.get(base + "/_crossbar/readyz")
            except Exception:
                return False
            await response.content()
            return bool(response.code == 200)

        await wait_for(lb_ready, 20, "HAProxy answering")
        await wait_for(lambda: redis.command("ZCARD", "crossbar:live") == 2, what="both instances in Redis")
        prompt = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "the same prompt"}]}
        streams = []
        for i in range(4):
            streams.append(http.post(base + "/r/v1/chat/completions", json=prompt))
            await wait_for(lambda: sum(len(h.arrived) for h in held.values()) == i + 1, what=f"stream {i} at a host")
        self.assertEqual(sorted(len(h.open) for h in held.values()), [2, 2])
        for h in held.values():
            h.end(len(h.open))
        for d in streams:
            response = await d
            self.assertEqual(response.code, 200)
            await response.content()
        for proc in [*cb, lb]:
            proc.signal("TERM")
            await proc.ended
        await deferLater(reactor, 0.2)


def _keyed(host_url: str, redis_url: str, rpm: int) -> str:
    return (
        f"cluster:\n  redis: {redis_url}\nhealth: {{interval: 60, timeout: 5}}\nhosts:\n  h: {host_url}\n"
        "routes:\n  r:\n    hosts: [h]\n    keys:\n      ci:\n        secret: ci-secret-1\n"
        f"        limits: {{requests_per_minute: {rpm}}}\n"
    )


class Readiness(TestCase):
    """An instance with ``cluster.redis`` is ready only once its first connection to
    Redis has succeeded or failed (docs/design.md §Several crossbars)."""

    timeout = 60

    async def test_ready_only_once_joined(self) -> None:
        """Two fresh instances, a key with 6 requests a minute, 8 requests sent the
        moment each is ready: 6 are admitted fleet-wide (counting alone, 8 were)."""
        # Joining is under test, not the fallback when Redis is slow: a reply bound of
        # 1 s, so on a loaded machine a late reply does not send an instance alone.
        self.patch(cluster_module, "BOUND", 1.0)
        redis = start_redis(self)
        url = await listen(self, FakeLlama(["m"]))
        instances = [await start_crossbar(self, _keyed(url, redis.url, 6)) for _ in range(2)]
        for service, _ in instances:
            await wait_for(lambda: service.runtime.ready, step=0.001, what="ready")
            assert service.cluster is not None
            self.assertTrue(service.cluster.joined, "ready before joining Redis")
        http = http_client(self)
        answers = [http.post(instances[i % 2][1] + "/r/v1/chat/completions", json={"model": "m"},
                             headers={"Authorization": "Bearer ci-secret-1"}) for i in range(8)]
        codes = []
        for d in answers:
            response = await d
            codes.append(response.code)
            await response.content()
        self.assertEqual(sorted(codes), [200] * 6 + [429] * 2)

    async def test_ready_when_redis_refuses(self) -> None:
        """Nothing listens where Redis should be: ready at the first refused
        connection, well before the 2 s cap, counting alone."""
        from tests.redis_server import _free_port

        url = await listen(self, FakeLlama(["m"]))
        started = reactor.seconds()
        service, _ = await start_crossbar(self, config(url, f"redis://127.0.0.1:{_free_port()}/0"))
        await wait_for(lambda: service.runtime.ready, what="ready", step=0.01)
        self.assertLess(reactor.seconds() - started, cluster_module.SETTLE)
        assert service.cluster is not None
        self.assertFalse(service.cluster.joined)


class Drains(TestCase):
    """A host drained through one instance is drained on every instance within a
    second, and an instance that joins later learns it from Redis (docs/design.md
    §Several crossbars, §Operations)."""

    timeout = 60

    async def test_drain_through_one_reaches_all(self) -> None:
        redis = start_redis(self)
        fake = FakeLlama(["m"])
        held = Held()
        fake.handlers[b"/v1/chat/completions"] = held
        url = await listen(self, fake)
        text = "ops: {token: ops-token-1}\n" + config(url, redis.url, queue_timeout=0.3)
        a, b = [await start_crossbar(self, text) for _ in range(2)]
        for service, _ in (a, b):
            await wait_for(lambda: service.runtime.ready, what="ready")
        http = http_client(self)
        auth = {"Authorization": "Bearer ops-token-1"}
        response = await http.post(a[1] + "/_crossbar/hosts/h/drain", headers=auth)
        self.assertEqual(response.code, 200)
        await response.content()
        await wait_for(lambda: b[0].runtime.drained == {"h"}, timeout=1.0, what="B drains h", step=0.01)
        # B sends the host nothing new: its request waits, then 503.
        response = await http.post(b[1] + "/r/v1/chat/completions", json={"model": "m", "stream": True})
        self.assertEqual(response.code, 503)
        await response.content()
        self.assertEqual(held.arrived, [])
        # An instance started now learns the drain from Redis.
        c = await start_crossbar(self, text)
        await wait_for(lambda: c[0].runtime.ready, what="C ready")
        self.assertEqual(c[0].runtime.drained, {"h"})
        # Undrained through B: every instance takes requests for h again.
        response = await http.post(b[1] + "/_crossbar/hosts/h/undrain", headers=auth)
        self.assertEqual(response.code, 200)
        await response.content()
        await wait_for(lambda: not a[0].runtime.drained and not c[0].runtime.drained, timeout=1.0,
                       what="A and C undrain h", step=0.01)
        answer = http.post(c[1] + "/r/v1/chat/completions", json={"model": "m", "stream": True})
        await wait_for(lambda: len(held.arrived) == 1, what="C's request at the host")
        held.end(1)
        await (await answer).content()
        self.assertEqual(redis.command("HKEYS", "crossbar:drained"), [])
