#!/usr/bin/env python3
"""What taking a host's slot in Redis costs a request: the round trip of
:meth:`crossbar.state.cluster.RedisCluster.take`, in-process.

    bench/cluster_take.py [--rate 200] [--seconds 5] [--hold 0.005] [--rounds 3]

One process, Twisted's reactor, a ``redis-server`` on a free loopback port and two
:class:`~crossbar.state.cluster.RedisCluster` instances A and B (the real class, real
connections; B only listens). A *request* raises A's count of a host with a
``max_inflight`` and, ``hold`` seconds later, lowers it again, on a fixed schedule of
``rate`` requests per second. Two modes, alternated round by round:

- ``set``: the rise is noted and written in a batch (:meth:`~RedisCluster.set`, what a
  host without a limit still does, and what every request did before the take);
- ``take``: the rise is one script call (:meth:`~RedisCluster.take`) that the request
  waits for before it is sent.

Printed: the take's wait (from the call to its answer) p50/p99/max -- the latency a
request with cluster.redis now pays before it goes --, and the process's CPU per
request in each mode (``time.process_time``, both instances: A's calls and replies,
B's messages); the difference is the take's CPU on crossbar's side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import HOST, start_redis  # noqa: E402
from cluster_loop import until  # noqa: E402
from runner import loadavg, machine, pct  # noqa: E402

from twisted.internet import defer, task  # noqa: E402

from crossbar.config import RedisURL  # noqa: E402
from crossbar.state.cluster import RedisCluster  # noqa: E402

NAME = "h\0up"
LIMIT = 1_000_000
"""Every take is granted: what is measured is the call, not a refusal."""


async def load(reactor: Any, a: RedisCluster, mode: str, rate: float, seconds: float, hold: float,
               waits: list[float]) -> tuple[float, int]:
    """Run the schedule in ``mode``; returns (CPU seconds, requests)."""
    n = int(rate * seconds)
    count = [0]

    def start(i: int) -> None:
        count[0] += 1
        if mode == "set":
            a.set(NAME, count[0])
        else:
            t = time.perf_counter()
            a.take(NAME, count[0], LIMIT).addCallback(lambda _: waits.append(time.perf_counter() - t))
        reactor.callLater(hold, stop)

    def stop() -> None:
        count[0] -= 1
        a.set(NAME, count[0])

    t0 = reactor.seconds()
    c0 = time.process_time()
    for i in range(n):
        reactor.callLater(max(0.0, t0 + i / rate - reactor.seconds()), start, i)
    await task.deferLater(reactor, seconds + hold + 0.1)
    return time.process_time() - c0, n


async def amain(reactor: Any, args: argparse.Namespace) -> None:
    started = loadavg()
    with tempfile.TemporaryDirectory(prefix="crossbar-bench-take-") as tmp:
        redis, port = start_redis(Path(tmp))
        try:
            url = RedisURL(tls=False, host=HOST, port=port)
            a = RedisCluster(url, reactor)
            b = RedisCluster(url, reactor)
            a.start()
            b.start()
            await until(reactor, lambda: a.joined and b.joined and a.instances() == 2 == b.instances(), 15, "joined")
            waits: list[float] = []
            cpu: dict[str, list[float]] = {"set": [], "take": []}
            for mode in ("set", "take"):  # warm-up
                await load(reactor, a, mode, args.rate, 1, args.hold, [])
            for r in range(args.rounds):
                for mode in (("set", "take") if r % 2 == 0 else ("take", "set")):
                    used, n = await load(reactor, a, mode, args.rate, args.seconds, args.hold, waits)
                    cpu[mode].append(1e6 * used / n)
                    print(f"round {r + 1} {mode}: {1e6 * used / n:.1f} µs CPU per request", file=sys.stderr)
            slow, joined = a.slow, a.joined and b.joined
            await defer.DeferredList([a.stop(), b.stop()])
        finally:
            redis.terminate()
            redis.wait(10)
    added = [t - s for t, s in zip(cpu["take"], cpu["set"])]
    us = [w * 1e6 for w in waits]
    print(machine())
    print(f"{args.rounds} round(s) of {args.seconds:g} s per mode at {args.rate:g} requests/s, each holding its "
          f"slot {args.hold * 1000:g} ms; {started} at start, {loadavg()} at end; still joined: {joined}; "
          f"takes over the bound: {slow}")
    print(f"a take's wait (call to answer): p50 {pct(us, 50):.0f} µs, p99 {pct(us, 99):.0f} µs, "
          f"max {max(us):.0f} µs ({len(us)} takes)")
    print(f"process CPU per request, batched set: {statistics.median(cpu['set']):.1f} µs; take: "
          f"{statistics.median(cpu['take']):.1f} µs; added by the take: {statistics.median(added):.1f} µs "
          f"[{min(added):.1f}-{max(added):.1f}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--hold", type=float, default=0.005)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(amain(reactor, args)))


if __name__ == "__main__":
    main()
