#!/usr/bin/env python3
"""The cluster's own CPU per request, in-process: what ``cluster.redis`` adds
to a request, without the rest of crossbar around it.

    bench/cluster_loop.py [--rate 200] [--seconds 10] [--hold 0.005] [--rounds 3]

One process, Twisted's reactor, a ``redis-server`` on a free loopback port and two
:class:`crossbar.state.cluster.RedisCluster` instances A and B (the real class, real
connections). A *request* is what the runtime does for one request at a host: A's
host count goes up (``set(name, n + 1)``) and, ``hold`` seconds later, down again.
``rate`` requests per second start on a fixed schedule for ``seconds``. The process's
CPU (``time.process_time``, both instances: A's writes and replies, B's messages) is
compared with the same schedule against a stand-in that only stores the values (no
cluster): the difference per request is the cluster's CPU on crossbar's side (the
sending instance's and every other instance's share together, here one other).

Also: how long after A's count rose B saw it (``others``), p50/p99 -- the delay before
another instance counts a request (and, for a fall, before a freed slot wakes it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import HOST, start_redis  # noqa: E402
from runner import loadavg, machine, pct  # noqa: E402

from twisted.internet import defer, task  # noqa: E402

from crossbar.config import RedisURL  # noqa: E402
from crossbar.state.cluster import RedisCluster  # noqa: E402

NAME = "h\0up"


class Stand:
    """The no-cluster baseline: stores the values, nothing else."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def set(self, name: str, value: int) -> None:
        self.values[name] = value


async def until(reactor: Any, check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: {what} not within {timeout:g} s")
        await task.deferLater(reactor, 0.01)


async def load(reactor: Any, target: Any, rate: float, seconds: float, hold: float) -> tuple[float, float, int]:
    """Run the schedule against ``target``; returns (CPU seconds, of which in the kernel, requests)."""
    n = int(rate * seconds)
    count = [0]

    def start(i: int) -> None:
        count[0] += 1
        target.set(NAME, count[0])
        reactor.callLater(hold, stop)

    def stop() -> None:
        count[0] -= 1
        target.set(NAME, count[0])

    t0 = reactor.seconds()
    c0, k0 = time.process_time(), os.times().system
    for i in range(n):
        reactor.callLater(max(0.0, t0 + i / rate - reactor.seconds()), start, i)
    await task.deferLater(reactor, seconds + hold + 0.1)
    return time.process_time() - c0, os.times().system - k0, n


async def profile(reactor: Any, args: argparse.Namespace, solo: Any, shared: Any, a: RedisCluster) -> None:
    """Calls per request of each mode under cProfile (insensitive to the machine's load)."""
    import cProfile
    import pstats

    calls: dict[str, float] = {}
    for mode, target in (("solo", solo), ("shared", shared)):
        prof = cProfile.Profile()
        seq = a._seq
        prof.enable()
        _, _, n = await load(reactor, target, args.rate, args.seconds, args.hold)
        prof.disable()
        if mode == "shared":
            print(f"A's writes per request: {(a._seq - seq) / n:.2f}")
        stats = pstats.Stats(prof)
        calls[mode] = stats.total_calls / n  # type: ignore[attr-defined]
        if mode == "shared":
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][1])  # type: ignore[attr-defined]
            for (file, line, func), (cc, nc, tt, ct, _) in rows[:args.profile]:
                print(f"{nc / n:8.2f} calls/request {1e6 * tt / n:8.1f} µs own  {Path(file).name}:{line} {func}")
    print(f"function calls per request: no cluster {calls['solo']:.1f}, cluster {calls['shared']:.1f}, "
          f"added {calls['shared'] - calls['solo']:.1f}")


async def amain(reactor: Any, args: argparse.Namespace) -> None:
    started = loadavg()
    with tempfile.TemporaryDirectory(prefix="crossbar-bench-loop-") as tmp:
        redis, port = start_redis(Path(tmp))
        try:
            url = RedisURL(tls=False, host=HOST, port=port)
            seen: list[float] = []
            rose_at: list[float] = []
            b_last = [0]

            def b_changed() -> None:
                v = b.others(NAME)
                if v > b_last[0] and rose_at:
                    seen.append(time.monotonic() - rose_at[-1])
                b_last[0] = v

            a = RedisCluster(url, reactor)
            b = RedisCluster(url, reactor, on_change=b_changed)
            a.start()
            b.start()
            await until(reactor, lambda: a.joined and b.joined and a.instances() == 2 == b.instances(), 15, "joined")

            class Timed:
                def set(self, name: str, value: int) -> None:
                    if value > a._mine.get(name, 0):
                        rose_at.append(time.monotonic())
                    a.set(name, value)

            rows: dict[str, list[float]] = {"solo": [], "shared": []}
            kernel: dict[str, list[float]] = {"solo": [], "shared": []}
            await load(reactor, Stand(), args.rate, 1, args.hold)  # warm-up
            await load(reactor, Timed(), args.rate, 1, args.hold)
            seen.clear()
            if args.profile:
                await profile(reactor, args, Stand(), Timed(), a)
                await defer.DeferredList([a.stop(), b.stop()])
                return
            for r in range(args.rounds):
                for mode in (("solo", "shared") if r % 2 == 0 else ("shared", "solo")):
                    cpu, sys_cpu, n = await load(reactor, Stand() if mode == "solo" else Timed(), args.rate, args.seconds,
                                        args.hold)
                    rows[mode].append(1e6 * cpu / n)
                    kernel[mode].append(1e6 * sys_cpu / n)
                    print(f"round {r + 1} {mode}: {1e6 * cpu / n:.1f} µs CPU per request", file=sys.stderr)
            joined = a.joined and b.joined
            await defer.DeferredList([a.stop(), b.stop()])
        finally:
            redis.terminate()
            redis.wait(10)
    added = [s - o for s, o in zip(rows["shared"], rows["solo"])]
    print(machine())
    print(f"{args.rounds} round(s) of {args.seconds:g} s at {args.rate:g} requests/s, each holding its count "
          f"{args.hold * 1000:g} ms; {started} at start, {loadavg()} at end; still joined: {joined}")
    print(f"process CPU per request, no cluster (the schedule alone): {statistics.median(rows['solo']):.1f} µs "
          f"[{min(rows['solo']):.1f}-{max(rows['solo']):.1f}]")
    print(f"process CPU per request, cluster (A writes, B listens): {statistics.median(rows['shared']):.1f} µs "
          f"[{min(rows['shared']):.1f}-{max(rows['shared']):.1f}]")
    print(f"added by the cluster: {statistics.median(added):.1f} µs per request [{min(added):.1f}-{max(added):.1f}], "
          f"of which in the kernel (system time): "
          f"{statistics.median(kernel['shared']) - statistics.median(kernel['solo']):.1f} µs")
    ms = [x * 1000 for x in seen]
    print(f"B sees A's rise after: p50 {pct(ms, 50):.2f} ms, p99 {pct(ms, 99):.2f} ms, max {max(ms):.2f} ms "
          f"({len(ms)} rises seen)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--hold", type=float, default=0.005)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", metavar="N", type=int, default=0,
                        help="instead of timing: one round under cProfile (deterministic), print the calls per "
                             "request of each mode and the N functions with the most calls in the shared mode")
    args = parser.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(amain(reactor, args)))


if __name__ == "__main__":
    main()
