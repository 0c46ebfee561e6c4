"""A client key's limits (docs/design.md §Access): requests and tokens per minute, tokens per
UTC day, 429 with a ``Retry-After`` that says when the window allows the next request;
per process alone, per box across the workers of a real ``twistd`` with ``workers: 2``
(their shared memory), fleet-wide through a real Redis with ``cluster.redis``. The
clock of the limits is injected where the test runs in this process."""

from __future__ import annotations

import calendar
import json
from typing import Any

import treq
from twisted.internet.testing import MemoryReactorClock
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.server import Request

from crossbar.config import Config, KeyLimits, ConfigError, load_config, parse_config
from crossbar.process.service import CrossbarService
from crossbar.process.supervisor import Supervisor
from crossbar.state import cluster as cluster_module
from crossbar.state.box_limits import LIMIT_SLOTS, MAX_LIMIT_SLOTS, BoxLimits, limit_slot_map, limit_slots_for
from crossbar.state.limits import KeyLimiter, retry_after_header
from tests.harness import FakeLlama, http_client, listen, start_crossbar, wait_for
from tests.redis_server import RedisServer, start_redis
from tests.test_workers import ask_worker, fresh, metric, served, start_workers

NOON = calendar.timegm((2026, 12, 1, 12, 0, 0))
"""A POSIX time at 12:00 UTC."""


class Clock:
    """An injected POSIX clock."""

    def __init__(self, now: float = NOON) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def admit(limiter: KeyLimiter, limits: KeyLimits, key: str = "k") -> float:
    d = limiter.check("r", key, limits)
    out: list[float] = []
    d.addCallback(out.append)
    return out[0]


class LocalLimits(SynchronousTestCase):
    """One process's sliding windows."""

    def test_requests_per_minute(self) -> None:
        clock = Clock()
        limiter = KeyLimiter(clock)
        limits = KeyLimits(requests_per_minute=3)
        for i in range(3):
            self.assertEqual(admit(limiter, limits), 0)
            clock.now += 10
        # Admitted at 0, 10, 20; now 30: the one at 0 leaves the window at 60.
        self.assertEqual(admit(limiter, limits), 30)
        self.assertEqual(admit(limiter, limits, key="other"), 0)  # keys count apart
        clock.now += 29.5
        self.assertEqual(admit(limiter, limits), 0.5)
        clock.now += 0.5
        self.assertEqual(admit(limiter, limits), 0)
        self.assertEqual(limiter.spending()[("r", "k")].requests_minute, 3)

    def test_tokens_per_minute(self) -> None:
        clock = Clock()
        limiter = KeyLimiter(clock)
        limits = KeyLimits(tokens_per_minute=1000)
        self.assertEqual(admit(limiter, limits), 0)
        limiter.spend("r", "k", 600)
        clock.now += 20
        limiter.spend("r", "k", 500)
        clock.now += 5
        # 1100 spent in the window: over; the 600 leave at 60 s -> 500 < 1000.
        self.assertEqual(admit(limiter, limits), 35)
        clock.now += 35
        self.assertEqual(admit(limiter, limits), 0)
        self.assertEqual(limiter.spending()[("r", "k")].tokens_minute, 500)

    def test_tokens_per_day(self) -> None:
        clock = Clock()
        limiter = KeyLimiter(clock)
        limits = KeyLimits(tokens_per_day=5000)
        limiter.spend("r", "k", 5000)
        clock.now += 3600
        # 13:00 UTC: the day allows the next one at midnight, 11 h on.
        self.assertEqual(admit(limiter, limits), 11 * 3600)
        clock.now += 11 * 3600
        self.assertEqual(admit(limiter, limits), 0)
        self.assertEqual(limiter.spending()[("r", "k")].tokens_day, 0)

    def test_no_limits_no_bookkeeping(self) -> None:
        limiter = KeyLimiter(Clock())
        self.assertEqual(admit(limiter, KeyLimits()), 0)
        self.assertEqual(limiter.spending(), {})

    def test_retry_after_header(self) -> None:
        self.assertEqual([retry_after_header(s) for s in (0.001, 1, 1.2, 30, 59.99)], [1, 1, 2, 30, 60])

    def test_config(self) -> None:
        text = ("listen: tcp:0\nhosts:\n  h: http://h:1\nroutes:\n  r:\n    hosts: [h]\n    keys:\n"
                "      ci:\n        secret: s1\n        limits: {requests_per_minute: 2, tokens_per_day: 9}\n")
        key = parse_config(text, "c.yaml", {}).routes["r"].keys["ci"]
        self.assertEqual(key.limits, KeyLimits(requests_per_minute=2, tokens_per_day=9))
        with self.assertRaises(ConfigError) as e:
            parse_config(text.replace("tokens_per_day: 9", "tokens_per_hour: 9"), "c.yaml", {})
        self.assertIn("c.yaml: routes.r.keys.ci.limits.tokens_per_hour: unknown key", str(e.exception))
        with self.assertRaises(ConfigError) as e:
            parse_config(text.replace("requests_per_minute: 2", "requests_per_minute: 0"), "c.yaml", {})
        self.assertIn("routes.r.keys.ci.limits.requests_per_minute: must be at least 1", str(e.exception))


def keyed(host: str, redis: str | None) -> str:
    cluster = f"cluster:\n  redis: {redis}\n" if redis else ""
    return (
        cluster + "health: {interval: 60, timeout: 5}\n"
        f"hosts:\n  h: {host}\n"
        "routes:\n  r:\n    hosts: [h]\n    keys:\n      ci:\n        secret: ci-secret-1\n"
        "        limits: {requests_per_minute: 3, tokens_per_minute: 1000, tokens_per_day: 5000}\n"
    )


class ThroughCrossbar(TestCase):
    """429 with Retry-After from real crossbar instances, alone and over Redis."""

    timeout = 60

    async def instances(self, n: int, redis: str | None, clock: Clock) -> list[tuple[CrossbarService, str]]:
        url = await listen(self, FakeLlama(["m"]))
        out = [await start_crossbar(self, keyed(url, redis)) for _ in range(n)]
        for service, _ in out:
            service.runtime.limits.now = clock
            await service.poller.when_first_round_done()
        if redis:
            await wait_for(lambda: all(s.cluster is not None and s.cluster.joined for s, _ in out), what="joined")
        return out

    def shared_redis(self) -> RedisServer:
        """A Redis whose counts are under test, not the fallback when it is slow: a
        reply bound of 1 s instead of 50 ms, so on a loaded machine a late reply does
        not send an instance alone (it then counts by itself, and a fleet-wide 429
        comes as a 200)."""
        self.patch(cluster_module, "BOUND", 1.0)
        return start_redis(self)

    async def call(self, base: str) -> tuple[int, str | None]:
        client = http_client(self)
        response = await client.post(base + "/r/v1/chat/completions", json={"model": "m"},
                                     headers={"Authorization": "Bearer ci-secret-1"})
        body = await response.json()
        if response.code == 429:
            self.assertEqual(body, {"error": {"code": 429, "message": "too many requests", "type": "rate_limit_error"}})
        retry = response.headers.getRawHeaders("retry-after")
        return response.code, retry[0] if retry else None

    async def code(self, base: str) -> tuple[int, str | None]:
        """A request of key ``ci``: its status and ``Retry-After`` (the body's shape aside)."""
        response = await http_client(self).post(base + "/r/v1/chat/completions", json={"model": "m"},
                                                headers={"Authorization": "Bearer ci-secret-1"})
        await response.content()
        retry = response.headers.getRawHeaders("retry-after")
        return response.code, retry[0] if retry else None

    async def test_alone(self) -> None:
        clock = Clock()
        [(service, base)] = await self.instances(1, None, clock)
        for _ in range(3):
            self.assertEqual(await self.call(base), (200, None))
            clock.now += 1
        self.assertEqual(await self.call(base), (429, "57"))
        self.assertIn(b'crossbar_key_spent{key="ci",route="r",window="requests_minute"} 3.0',
                      service.metrics.render())
        service.runtime.spend("r", "ci", 42)
        status = await (await http_client(self).get(base + "/_crossbar/status")).json()
        self.assertEqual(status["routes"]["r"]["keys"]["ci"], {
            "limits": {"requests_per_minute": 3, "tokens_per_minute": 1000, "tokens_per_day": 5000},
            "requests_minute": 3, "tokens_minute": 42, "tokens_day": 42,
        })
        self.assertNotIn("cluster", status)
        clock.now += 57
        self.assertEqual((await self.call(base))[0], 200)

    async def test_fleet_wide(self) -> None:
        """Two instances over one Redis share every limit of the key."""
        redis = self.shared_redis()
        clock = Clock()
        (a, base_a), (b, base_b) = await self.instances(2, redis.url, clock)
        for base in (base_a, base_b, base_a):
            self.assertEqual(await self.call(base), (200, None))
        clock.now += 10
        self.assertEqual(await self.call(base_b), (429, "50"))  # the requests per minute, fleet-wide
        clock.now += 50
        # Tokens spent on A count on B: 1000 in the minute -> B refuses for 61 s (the
        # per-second bucket leaves the window a second after its start + 60).
        a.runtime.spend("r", "ci", 1000)
        day_key = "crossbar:limit:r\0ci:day:2026-12-01"
        await wait_for(lambda: redis.command("GET", day_key) == "1000", what="A's spending in Redis")
        code, retry = await self.call(base_b)
        self.assertEqual(code, 429)
        assert retry is not None
        self.assertLessEqual(abs(int(retry) - 61), 1)
        clock.now += 62
        self.assertEqual((await self.call(base_b))[0], 200)
        # The day's budget: 5000 spent in all -> refused until midnight UTC.
        b.runtime.spend("r", "ci", 4000)
        await wait_for(lambda: redis.command("GET", day_key) == "5000", what="B's spending in Redis")
        clock.now += 61
        code, retry = await self.call(base_a)
        self.assertEqual(code, 429)
        midnight = calendar.timegm((2026, 12, 2, 0, 0, 0))
        assert retry is not None
        self.assertLessEqual(abs(int(retry) - (midnight - clock.now)), 1)
        clock.now = midnight + 1
        self.assertEqual((await self.call(base_a))[0], 200)

    async def test_redis_down_counts_alone(self) -> None:
        """Redis gone: each instance goes on with its own counts (no request fails
        because of it)."""
        redis = start_redis(self)
        clock = Clock()
        (a, base_a), (b, base_b) = await self.instances(2, redis.url, clock)
        self.assertEqual((await self.call(base_a))[0], 200)
        redis.stop()
        await wait_for(lambda: not a.cluster.joined and not b.cluster.joined, what="alone")  # type: ignore[union-attr]
        codes: list[Any] = [(await self.call(base_b))[0] for _ in range(4)]
        self.assertEqual(codes, [200, 200, 200, 429])

    async def test_counted_alone_reaches_redis_on_rejoining(self) -> None:
        """What an instance admitted and spent while Redis was away is written to Redis
        when it rejoins: the other instance then refuses what the key's minute no longer
        allows (before, it admitted as if nothing had happened)."""
        redis = self.shared_redis()
        clock = Clock()
        (a, base_a), (b, base_b) = await self.instances(2, redis.url, clock)
        assert a.cluster is not None and b.cluster is not None

        async def outage() -> None:
            redis.stop()
            await wait_for(lambda: not a.cluster.joined and not b.cluster.joined, what="alone")  # type: ignore[union-attr]

        async def back() -> None:
            redis.start()
            await wait_for(lambda: a.cluster.joined and b.cluster.joined, timeout=10, what="rejoined")  # type: ignore[union-attr]

        # Requests per minute: A admits all 3 alone.
        await outage()
        self.assertEqual([(await self.code(base_a))[0] for _ in range(3)], [200, 200, 200])
        await back()
        requests = "crossbar:limit:r\0ci:requests"
        await wait_for(lambda: redis.command("ZCARD", requests) == 3, what="A's requests in Redis")
        code, retry = await self.code(base_b)
        self.assertEqual(code, 429)
        self.assertEqual(retry, "60")
        clock.now += 61
        # Tokens per minute and per day: A spends the minute's 1000 alone.
        await outage()
        a.runtime.spend("r", "ci", 1000)
        await back()
        day_key = "crossbar:limit:r\0ci:day:2026-12-01"
        await wait_for(lambda: redis.command("GET", day_key) == "1000", what="A's tokens in Redis")
        self.assertEqual((await self.code(base_b))[0], 429)
        clock.now += 62
        self.assertEqual((await self.code(base_b))[0], 200)

    async def test_redis_slow_waits_at_most_the_bound(self) -> None:
        """Redis stopped (SIGSTOP: the connection stays, nothing answers): a limited
        key's request waits for it at most 50 ms, then this process's counts decide."""
        from twisted.internet import reactor

        redis = start_redis(self)
        clock = Clock()
        [(a, base)] = await self.instances(1, redis.url, clock)
        self.assertEqual((await self.call(base))[0], 200)
        redis.pause()
        self.addCleanup(redis.resume)
        started = reactor.seconds()
        self.assertEqual((await self.call(base))[0], 200)
        self.assertLess(reactor.seconds() - started, 0.25)
        await wait_for(lambda: not a.cluster.joined, what="alone")  # type: ignore[union-attr]
        self.assertEqual((await self.call(base))[0], 200)
        self.assertEqual((await self.call(base))[0], 429)  # 3 a minute, counted here alone
        redis.resume()
        await wait_for(lambda: a.cluster.joined, timeout=10, what="rejoined")  # type: ignore[union-attr]


def keys_yaml(count: int, limits: str, first: int = 0) -> str:
    """``count`` keys ``k<i>`` of route ``r`` over host ``h`` at ``http://h:1``, each with ``limits``."""
    keys = "".join(f"      k{i}: {{secret: secret-{i:05d}-0123456789, limits: {limits}}}\n"
                   for i in range(first, first + count))
    return f"listen: tcp:0\nworkers: 2\nhosts:\n  h: http://h:1\nroutes:\n  r:\n    hosts: [h]\n    keys:\n{keys}"


class BoxBuckets(SynchronousTestCase):
    """The per-second buckets two workers share (one file, a row each), with the clock
    injected: the sliding minute, the UTC day's rollover, slots changing hands."""

    def workers(self, config: Config, slots: int = LIMIT_SLOTS) -> tuple[Clock, list[KeyLimiter], list[BoxLimits]]:
        path = self.mktemp() + "-limits"
        BoxLimits.create(path, 3, slots)  # two workers and the supervisor's row
        clock = Clock()
        boxes = [BoxLimits(path, 3, row, config) for row in (0, 1)]
        limiters = []
        for box in boxes:
            limiter = KeyLimiter(clock)
            limiter.counts = box
            limiters.append(limiter)
        return clock, limiters, boxes

    def config(self, limits: str = "{requests_per_minute: 3}", count: int = 1, first: int = 0) -> Config:
        return parse_config(keys_yaml(count, limits, first), "c.yaml", {})

    def test_requests_per_minute_summed_over_workers(self) -> None:
        clock, (w0, w1), _ = self.workers(self.config())
        limits = KeyLimits(requests_per_minute=3)
        clock.now = NOON + 0.2
        self.assertEqual(admit(w0, limits, "k0"), 0)
        clock.now = NOON + 10.5
        self.assertEqual(admit(w1, limits, "k0"), 0)
        clock.now = NOON + 20
        self.assertEqual(admit(w0, limits, "k0"), 0)
        clock.now = NOON + 30
        # The bucket of second NOON leaves the window at NOON + 61 (a second after its
        # start + 60): 31 s on, whichever worker asks.
        self.assertEqual(admit(w1, limits, "k0"), 31)
        self.assertEqual(admit(w0, limits, "k0"), 31)
        for limiter in (w0, w1):  # status and metrics: the box's
            self.assertEqual(limiter.spending()[("r", "k0")].requests_minute, 3)
        clock.now = NOON + 60.5
        self.assertEqual(admit(w1, limits, "k0"), 0.5)
        clock.now = NOON + 61
        self.assertEqual(admit(w1, limits, "k0"), 0)
        self.assertEqual(w0.spending()[("r", "k0")].requests_minute, 3)  # 10.5, 20 and 61
        clock.now = NOON + 61 + 2 * 64  # the ring has come round twice: nothing old counts
        self.assertEqual(w0.spending()[("r", "k0")].requests_minute, 0)
        for _ in range(3):
            self.assertEqual(admit(w0, limits, "k0"), 0)
        self.assertEqual(admit(w1, limits, "k0"), 61)

    def test_tokens_per_minute_summed_over_workers(self) -> None:
        clock, (w0, w1), _ = self.workers(self.config("{tokens_per_minute: 1000}"))
        limits = KeyLimits(tokens_per_minute=1000)
        w0.spend("r", "k0", 600)
        clock.now += 20
        w1.spend("r", "k0", 300)
        self.assertEqual(admit(w0, limits, "k0"), 0)  # 900 < 1000
        w1.spend("r", "k0", 200)
        clock.now += 5
        # 1100 in the minute: over; the 600 of second NOON leave at NOON + 61 -> 500.
        self.assertEqual(admit(w0, limits, "k0"), 36)
        self.assertEqual(w0.spending()[("r", "k0")].tokens_minute, 1100)
        clock.now = NOON + 61
        self.assertEqual(admit(w0, limits, "k0"), 0)
        self.assertEqual(w1.spending()[("r", "k0")].tokens_minute, 500)

    def test_utc_day_rolls_over(self) -> None:
        clock, (w0, w1), _ = self.workers(self.config("{tokens_per_day: 5000}"))
        limits = KeyLimits(tokens_per_day=5000)
        midnight = calendar.timegm((2026, 12, 2, 0, 0, 0))
        clock.now = midnight - 3600
        w0.spend("r", "k0", 3000)
        clock.now = midnight - 30
        w1.spend("r", "k0", 2000)
        self.assertEqual(admit(w1, limits, "k0"), 30)  # 5000 today: until midnight UTC
        self.assertEqual(admit(w0, limits, "k0"), 30)
        self.assertEqual(w0.spending()[("r", "k0")].tokens_day, 5000)
        clock.now = midnight
        self.assertEqual(admit(w0, limits, "k0"), 0)  # a new day
        w1.spend("r", "k0", 100)
        spent = w0.spending()[("r", "k0")]
        self.assertEqual((spent.tokens_day, spent.tokens_minute), (100, 2100))
        clock.now = midnight + 86400 - 1
        w0.spend("r", "k0", 4900)
        self.assertEqual(admit(w1, limits, "k0"), 1)
        clock.now = midnight + 86400
        self.assertEqual(admit(w1, limits, "k0"), 0)

    def test_counts_saturate(self) -> None:
        clock, (w0, w1), _ = self.workers(self.config("{tokens_per_minute: 10}"))
        w0.spend("r", "k0", 1 << 40)
        w0.spend("r", "k0", 5)
        spent = w1.spending()[("r", "k0")]
        self.assertEqual((spent.tokens_minute, spent.tokens_day), ((1 << 32) - 1, (1 << 40) - 1))
        self.assertEqual(admit(w1, KeyLimits(tokens_per_minute=10), "k0"), 61)

    def test_a_slot_that_changes_hands_lends_nothing(self) -> None:
        old, new = self.config(count=1), self.config(count=1, first=1)
        clock, (w0, w1), (b0, b1) = self.workers(old, slots=1)
        limits = KeyLimits(requests_per_minute=1)
        self.assertEqual(admit(w0, limits, "k0"), 0)
        self.assertEqual(admit(w1, limits, "k0"), 61)
        b0.configure(new)  # a reload: k1 takes k0's slot
        b1.configure(new)
        self.assertEqual(w0.spending(), {})
        self.assertEqual(admit(w1, limits, "k1"), 0)
        self.assertEqual(admit(w0, limits, "k1"), 61)
        self.assertEqual(w0.spending()[("r", "k1")].requests_minute, 1)

    def test_slots_are_the_same_in_every_process(self) -> None:
        keys = [("r", f"k{i}") for i in range(100)]
        first = limit_slot_map(keys, LIMIT_SLOTS)
        self.assertEqual(limit_slot_map(list(reversed(keys)), LIMIT_SLOTS), first)
        self.assertEqual(len(set(first.values())), 100)
        self.assertEqual(len(limit_slot_map(keys, 10)), 10)  # beyond the slots: none

    def test_keys_beyond_the_slots_count_per_worker(self) -> None:
        """A config the supervisor refuses still never crashes a worker."""
        clock, (w0, w1), _ = self.workers(self.config(count=2), slots=1)
        limits = KeyLimits(requests_per_minute=1)
        self.assertEqual(admit(w0, limits, "k0"), 0)
        self.assertEqual(admit(w0, limits, "k1"), 0)
        self.assertGreater(admit(w1, limits, "k0"), 0)  # k0 has the slot
        self.assertEqual(admit(w1, limits, "k1"), 0)  # k1 is counted per worker
        self.assertGreater(admit(w1, limits, "k1"), 0)


class BoxRoom(SynchronousTestCase):
    """The shared memory is made for the config's keys with limits: a config beyond
    it is refused at start and on SIGHUP, with one line."""

    def config(self, text: str) -> Config:
        path = self.mktemp()
        with open(path, "w") as f:
            f.write(text)
        return load_config(path)

    def test_refused_at_start_and_on_reload(self) -> None:
        limits = "{requests_per_minute: 5}"
        big = self.config(keys_yaml(MAX_LIMIT_SLOTS + 1, limits))
        with self.assertRaises(ConfigError) as caught:
            limit_slots_for(big)
        self.assertIn(f"workers: this config has {MAX_LIMIT_SLOTS + 1} keys with limits and workers count at most "
                      f"{MAX_LIMIT_SLOTS}", str(caught.exception))
        with self.assertRaises(ConfigError) as caught:  # (its keys' other counts do not fit either)
            Supervisor(big, MemoryReactorClock(), environ={}, handle_signals=False)
        self.assertNotIn("\n", str(caught.exception))
        supervisor = Supervisor(self.config(keys_yaml(3, limits)), MemoryReactorClock(), environ={},
                                handle_signals=False)
        self.assertEqual(supervisor.limit_slots, LIMIT_SLOTS)
        with open(supervisor.config.source, "w") as f:
            f.write(keys_yaml(LIMIT_SLOTS + 1, limits))
        errors: list[str] = []
        from twisted.logger import globalLogPublisher

        def observe(event: dict[str, Any]) -> None:
            if event.get("log_namespace") == "crossbar.supervisor" and "error" in event:
                errors.append(str(event["error"]))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        self.assertFalse(supervisor.reload())
        self.assertEqual(len(supervisor.config.routes["r"].keys), 3)
        self.assertEqual(len(errors), 1, errors)
        self.assertIn(f"this config has {LIMIT_SLOTS + 1} keys with limits and the workers' shared memory was "
                      f"made for {LIMIT_SLOTS} at start", errors[0])
        with open(supervisor.config.source, "w") as f:  # more keys, within the room: taken
            f.write(keys_yaml(LIMIT_SLOTS, limits))
        self.assertTrue(supervisor.reload())

    def test_made_for_twice_the_keys(self) -> None:
        supervisor = Supervisor(self.config(keys_yaml(300, "{tokens_per_day: 9}")), MemoryReactorClock(),
                                environ={}, handle_signals=False)
        self.assertEqual(supervisor.limit_slots, 600)


USAGE = {"prompt_tokens": 7, "completion_tokens": 4}


def answer_with_usage(request: Request, body: bytes) -> bytes:
    request.setHeader(b"content-type", b"application/json")
    return json.dumps({"object": "chat.completion", "choices": [], "usage": USAGE}).encode()


class PerBox(TestCase):
    """A real ``twistd`` with ``workers: 2``: a key's limits hold for the box."""

    timeout = 180

    async def test_requests_per_minute_across_two_workers(self) -> None:
        upstream = FakeLlama(["m"])
        upstream.handlers[b"/v1/chat/completions"] = answer_with_usage
        url = await listen(self, upstream)
        count = 24  # keys to try until two were served by both workers (the kernel picks)
        keys = "".join(f"      k{i}: {{secret: secret-{i:05d}-0123456789, limits: {{requests_per_minute: 3}}}}\n"
                       for i in range(count))
        proc = await start_workers(self, (
            f"health: {{interval: 60, timeout: 5}}\nhosts:\n  h: {url}\n"
            f"routes:\n  r:\n    hosts: [h]\n    keys:\n{keys}"
        ))
        http = fresh(self)  # a new connection per request: the kernel spreads them
        spread = []
        for i in range(count):
            results = []
            for _ in range(4):
                response = await http.post(proc.base + "/r/v1/chat/completions", json={"model": "m"},
                                           headers={"Authorization": f"Bearer secret-{i:05d}-0123456789"})
                await treq.content(response)
                retry = response.headers.getRawHeaders("retry-after")
                results.append((response.code, int(retry[0]) if retry else None))
            codes = [code for code, _ in results]
            self.assertEqual(codes, [200, 200, 200, 429], (i, results))
            retry_after = results[3][1]
            assert retry_after is not None
            self.assertTrue(55 <= retry_after <= 61, retry_after)  # the first leaves ~61 s after its second
            await wait_for(lambda: len([e for e in served(proc) if e.get("key") == f"k{i}"]) >= 4, 10, "4 log lines")
            workers = {e["worker"] for e in served(proc) if e.get("key") == f"k{i}"}
            if workers == {0, 1}:
                spread.append(f"k{i}")
                if len(spread) >= 2:
                    break
        self.assertTrue(spread, "no key's requests were served by both workers")
        # Status and metrics: the box's spending, whichever worker answers.
        answered: list[int] = []
        for _ in range(200):  # until each worker answered twice (on a loaded box one may win many in a row)
            worker, code, body = await deferToThread(ask_worker, proc, "/_crossbar/status")
            keys_status = json.loads(body)["routes"]["r"]["keys"]
            for name in spread:
                self.assertEqual(keys_status[name]["requests_minute"], 3, (worker, keys_status[name]))
                self.assertEqual(keys_status[name]["tokens_minute"], 3 * 11, (worker, keys_status[name]))
                self.assertEqual(keys_status[name]["tokens_day"], 3 * 11, (worker, keys_status[name]))
            worker, code, body = await deferToThread(ask_worker, proc, "/_crossbar/metrics")
            for name in spread:
                self.assertEqual(metric(body.decode(), "crossbar_key_spent", route="r", key=name,
                                        window="requests_minute"), 3, worker)
            answered.append(worker)
            if min(answered.count(0), answered.count(1)) >= 2:
                break
        self.assertGreaterEqual(min(answered.count(0), answered.count(1)), 2, answered)


class BoxBucketsAgainstAModel(SynchronousTestCase):
    """What two workers' buckets say the minute and the day hold, against a plain
    list of every admission and spending, over a long random run."""

    def test_random_run(self) -> None:
        import random

        rng = random.Random(22)
        config = parse_config(keys_yaml(1, "{tokens_per_minute: 1000000}"), "c.yaml", {})
        path = self.mktemp() + "-limits"
        BoxLimits.create(path, 3, LIMIT_SLOTS)
        boxes = [BoxLimits(path, 3, row, config) for row in (0, 1)]
        now = float(NOON - 3 * 3600)
        events: list[tuple[float, int, int]] = []  # (time, requests, tokens)
        for _ in range(1500):
            now += rng.choice((0.0, 0.1, 0.4, 1.0, 2.5, 7.0, 30.0, 65.0))
            box = rng.choice(boxes)
            if rng.random() < 0.5:
                box.admit("r", "k0", now)
                events.append((now, 1, 0))
            else:
                tokens = rng.randrange(1, 500)
                box.spend("r", "k0", tokens, now)
                events.append((now, 0, tokens))
            later = now + rng.choice((0.0, 0.5, 1.0, 30.0, 60.0, 61.0))
            live = [e for e in events if int(e[0]) > later - 61]
            today = [e for e in events if int(e[0] // 86400) == int(later // 86400)]
            expected = (sum(e[1] for e in live), sum(e[2] for e in live), sum(e[2] for e in today))
            for view in boxes:
                spent = view.spending(later)[("r", "k0")]
                self.assertEqual((spent.requests_minute, spent.tokens_minute, spent.tokens_day), expected, later)
            events = [e for e in events if e[0] > now - 86400 * 2]


class SlowSingleCheck(SynchronousTestCase):
    """A key's check that Redis does not answer within the bound: the local counts
    decide, and it is counted in the metrics and logged at most once a minute, like an
    outage (docs/design.md §Several crossbars); the admission is kept for Redis."""

    def test_counted_and_logged_once_a_minute(self) -> None:
        from twisted.internet.task import Clock as ReactorClock

        from crossbar.config import RedisURL
        from crossbar.state.cluster import BOUND, ClusterCollector, RedisCluster
        from crossbar.state.limits import RedisLimits
        from tests.logs import LogCapture
        from tests.test_cluster_commands import FakeConnection, FakeFactory

        reactor = ReactorClock()
        reactor.advance(NOON)
        cluster = RedisCluster(RedisURL(tls=False, host="127.0.0.1", port=6379), reactor, instance="me")
        conn = FakeConnection(answer=None)
        cluster.link.factory = FakeFactory(conn)
        cluster.joined = True
        limiter = KeyLimiter(reactor.seconds)
        limiter.fleet = RedisLimits(cluster)
        logs = LogCapture(self)
        limits = KeyLimits(requests_per_minute=5)

        def slow_check() -> float:
            d = limiter.check("r", "k", limits)
            reactor.advance(BOUND)
            return float(self.successResultOf(d))

        self.assertEqual([slow_check() for _ in range(3)], [0.0, 0.0, 0.0])
        said = [e for e in logs.events if e.get("log_namespace") == "crossbar.cluster"]
        self.assertEqual(len(said), 1)
        self.assertEqual(cluster.slow_checks.count, 3)
        self.assertEqual(cluster.joined, True)  # a single check does not send the instance alone
        [_, _, _, slow] = ClusterCollector(cluster).collect()
        self.assertEqual(slow.samples[0].value, 3)
        reactor.advance(60)
        slow_check()
        said = [e for e in logs.events if e.get("log_namespace") == "crossbar.cluster"]
        self.assertEqual(len(said), 2)
        # The local counts decided: 5 a minute, the 3 of the first minute have left it.
        self.assertEqual(limiter.spending()[("r", "k")].requests_minute, 1)
        # Kept for Redis under the ids their checks had (counted once if they ran late).
        members = [m for _, m in limiter.fleet._backlog[("r", "k")].admitted]  # type: ignore[union-attr]
        self.assertEqual(members, ["me:3"])
        sent = [args for args in conn.sent if args[0] == "EVALSHA"]
        self.assertEqual([args[10] for args in sent], ["me:0", "me:1", "me:2", "me:3"])
