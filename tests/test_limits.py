"""A client key's limits (docs/design.md §Access): requests and tokens per minute, tokens per
UTC day, 429 with a ``Retry-After`` that says when the window allows the next request;
per process alone, fleet-wide through a real Redis with ``cluster.redis``. The clock
of the limits is injected."""

from __future__ import annotations

import calendar
from typing import Any

from twisted.trial.unittest import SynchronousTestCase, TestCase

from crossbar.config import KeyLimits, ConfigError, parse_config
from crossbar.process.service import CrossbarService
from crossbar.state.limits import KeyLimiter, retry_after_header
from tests.harness import FakeLlama, http_client, listen, start_crossbar, wait_for
from tests.redis_server import start_redis

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

    async def call(self, base: str) -> tuple[int, str | None]:
        client = http_client(self)
        response = await client.post(base + "/r/v1/chat/completions", json={"model": "m"},
                                     headers={"Authorization": "Bearer ci-secret-1"})
        body = await response.json()
        if response.code == 429:
            self.assertEqual(body, {"error": "too many requests"})
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
        redis = start_redis(self)
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
