#!/usr/bin/env python3
"""What sharing counts through Redis costs: two crossbar instances with
``cluster.redis`` against two without, the same load through each.

    bench/cluster.py [--rounds 3] [--seconds 5] [--connections 16] [--rate R] [--json FILE]

Starts one ``bench/upstream.py`` (the host, ``max_inflight: 1000``: never the limit, but
every request counts and publishes its host's count), a ``redis-server`` on a free
loopback port (no persistence), and four real ``twistd -n crossbar`` processes: ``solo1``
and ``solo2`` without ``cluster``, ``shared1`` and ``shared2`` with
``cluster.redis`` pointing at that Redis. Each round drives both instances of one pair
at once with one wrk each (``-t1 -cN``, keep-alive, the small JSON chat POST of
``bench/runner.py``'s (a)), then the other pair; the pairs alternate which goes first.

Per pair: requests/s (both wrks), p50/p99 latency (the worse of the two wrks), CPU of
both crossbar processes per request (µs, from /proc), Redis's CPU per request. The
added cost of the cluster is ``shared - solo``. With ``--rate R`` each instance gets R
requests/s on a fixed schedule instead of wrk's as-fast-as-possible (on a shared
machine a saturating load measures the neighbours as much as crossbar; at a fixed rate
both pairs do the same work and latency is not queueing). Latency is then timed from each
request's scheduled send to its answer's last byte.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import (  # noqa: E402
    HOST, _WRK_LUA, _die_with_parent, cpu_seconds, loadavg, machine, start_upstream, wait_http, wrk,
)

PAIRS = ("solo", "shared")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen[Any], int]:
    executable = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    proc = subprocess.Popen(
        [executable, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=open(workdir / "redis.stderr", "w"), preexec_fn=_die_with_parent,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("bench: redis-server did not start")


def redis_calls(port: int) -> dict[str, int]:
    """Redis's ``INFO commandstats``: calls per command so far (``eval``, ``publish``...)."""
    with socket.create_connection((HOST, port), timeout=2) as s:
        s.sendall(b"INFO commandstats\r\n")
        data = b""
        while b"\r\n" not in data:
            data += s.recv(65536)
        head, _, data = data.partition(b"\r\n")  # $LENGTH
        while len(data) < int(head[1:]) + 2:
            data += s.recv(65536)
    out = {}
    for line in data.decode().splitlines():
        if line.startswith("cmdstat_"):
            name, _, rest = line[len("cmdstat_"):].partition(":")
            out[name] = int(dict(kv.split("=") for kv in rest.split(","))["calls"])
    return out


def start_crossbar(workdir: Path, name: str, up_port: int, redis_port: int | None,
                   calls: bool = False) -> tuple[subprocess.Popen[Any], int]:
    port = free_port()
    config = workdir / f"{name}.yaml"
    config.write_text(
        f'listen: "tcp:{port}:interface={HOST}:backlog=1024"\n'
        + (f"cluster:\n  redis: redis://{HOST}:{redis_port}/0\n" if redis_port else "")
        + "health: {interval: 5, timeout: 5}\n"
        f"hosts:\n  up:\n    url: http://{HOST}:{up_port}\n    max_inflight: 1000\n"
        "routes:\n  bench:\n    hosts: [up]\n    default_model: bench\n"
    )
    twistd = [str(Path(sys.executable).parent / "twistd")]
    if calls:  # under cProfile, toggled by SIGUSR2
        twistd = [sys.executable, "-c", _PROFILED, str(workdir / f"{name}.prof")]
    proc = subprocess.Popen(
        twistd + ["-n", "--pidfile=", f"--logfile={workdir / (name + '.log')}", "crossbar", "--config", str(config)],
        cwd=workdir, stdout=subprocess.DEVNULL, stderr=open(workdir / f"{name}.stderr", "w"),
        preexec_fn=_die_with_parent,
    )
    wait_http(f"http://{HOST}:{port}/_crossbar/readyz", 30, proc)
    return proc, port


_PROFILED = """import cProfile, signal, sys, time
out = sys.argv[1]; sys.argv = ["twistd"] + sys.argv[2:]
p = cProfile.Profile(time.process_time); on = [False]
def toggle(*a):
    on[0] = not on[0]
    if on[0]:
        p.enable()
    else:
        p.disable(); p.dump_stats(out)
signal.signal(signal.SIGUSR2, toggle)
from twisted.scripts.twistd import run
run()
"""
"""twistd under cProfile: SIGUSR2 starts it, the next stops it and writes every call so far."""

_BODY = b'{"model":"bench","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'


async def paced(port: int, rate: float, c: int, seconds: float) -> dict[str, Any]:
    """``rate`` requests/s for ``seconds`` over ``c`` kept-alive connections, each on an
    absolute schedule of its own (``rate / c`` per second, staggered): a request's
    latency runs from its scheduled time to its answer's last byte, so a late send
    counts (no coordinated omission). Returns the latencies (s), requests, non-2xx."""
    import httptools

    request = (f"POST /bench/v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(_BODY)}\r\n\r\n").encode() + _BODY
    latencies: list[float] = []
    bad = 0
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    every = c / rate

    async def one(k: int) -> None:
        nonlocal bad
        reader, writer = await asyncio.open_connection(HOST, port)
        done = asyncio.Event()

        class Sink:
            def on_message_complete(self) -> None:
                done.set()

        parser = httptools.HttpResponseParser(Sink())
        n = 0
        while True:
            due = start + k * every / c + n * every
            if due > start + seconds:
                break
            await asyncio.sleep(max(0.0, due - loop.time()))
            done.clear()
            writer.write(request)
            while not done.is_set():
                data = await reader.read(65536)
                if not data:
                    raise SystemExit("bench: crossbar closed a connection")
                parser.feed_data(data)
            latencies.append(loop.time() - due)
            if parser.get_status_code() != 200:
                bad += 1
            n += 1
        writer.close()

    await asyncio.gather(*(one(k) for k in range(c)))
    return {"latencies": latencies, "requests": len(latencies), "bad": bad}


async def run_paced(procs: dict[str, tuple[subprocess.Popen[Any], int]], pair: str, redis_pid: int,
                    c: int, seconds: float, rate: float) -> dict[str, float]:
    """Both instances of ``pair`` at ``rate`` requests/s each, at once."""
    from runner import pct

    names = [f"{pair}1", f"{pair}2"]
    pids = [procs[n][0].pid for n in names]
    t0 = time.monotonic()
    c0 = [cpu_seconds(p) for p in pids]
    r0 = cpu_seconds(redis_pid)
    outs = await asyncio.gather(*(paced(procs[n][1], rate, c, seconds) for n in names))
    wall = time.monotonic() - t0
    cpu = sum(cpu_seconds(p) - c for p, c in zip(pids, c0))
    redis_cpu = cpu_seconds(redis_pid) - r0
    requests = sum(o["requests"] for o in outs)
    lat = [x * 1000 for o in outs for x in o["latencies"]]
    return {
        "rps": requests / seconds,
        "p50": pct(lat, 50),
        "p99": pct(lat, 99),
        "bad": float(sum(o["bad"] for o in outs)),
        "crossbar_cpu": cpu / wall,
        "cpu_us": 1e6 * cpu / requests,
        "redis_cpu_us": 1e6 * redis_cpu / requests,
    }


async def run_pair(procs: dict[str, tuple[subprocess.Popen[Any], int]], pair: str, redis_pid: int,
                   c: int, seconds: float, lua: Path) -> dict[str, float]:
    names = [f"{pair}1", f"{pair}2"]
    pids = [procs[n][0].pid for n in names]
    t0 = time.monotonic()
    c0 = [cpu_seconds(p) for p in pids]
    r0 = cpu_seconds(redis_pid)
    outs = await asyncio.gather(*(
        wrk(f"http://{HOST}:{procs[n][1]}/bench/v1/chat/completions", c, seconds, lua) for n in names))
    wall = time.monotonic() - t0
    cpu = sum(cpu_seconds(p) - c for p, c in zip(pids, c0))
    redis_cpu = cpu_seconds(redis_pid) - r0
    requests = sum(o["rps"] for o in outs) * seconds
    return {
        "rps": sum(o["rps"] for o in outs),
        "p50": max(o["p50"] for o in outs),
        "p99": max(o["p99"] for o in outs),
        "bad": sum(o["bad"] for o in outs),
        "crossbar_cpu": cpu / wall,
        "cpu_us": 1e6 * cpu / requests,
        "redis_cpu_us": 1e6 * redis_cpu / requests,
    }


async def profiling(procs: dict[str, tuple[subprocess.Popen[Any], int]], pair: str, workdir: Path) -> None:
    """Toggle cProfile in both instances of ``pair`` (on before a round, off and dumped
    after: the profiles add up over the rounds)."""
    files = [workdir / f"{pair}{i}.prof" for i in (1, 2)]
    before = [f.stat().st_mtime_ns if f.exists() else 0 for f in files]
    for i in (1, 2):
        procs[f"{pair}{i}"][0].send_signal(signal.SIGUSR2)
    await asyncio.sleep(0.2)
    if any(f.exists() and f.stat().st_mtime_ns != b for f, b in zip(files, before)):
        deadline = time.monotonic() + 30  # a dump under way: wait for both
        while not all(f.exists() and f.stat().st_mtime_ns != b for f, b in zip(files, before)):
            if time.monotonic() > deadline:
                raise SystemExit("bench: a profile was not written within 30 s")
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)


def calls_report(profiles: dict[str, Any], requests: dict[str, float], top: int) -> None:
    """Function calls per request of each pair (cProfile: deterministic, whatever the
    machine's load), and the functions the cluster adds the most calls to."""
    per: dict[str, dict[str, float]] = {}
    total: dict[str, float] = {}
    for pair, stats in profiles.items():
        total[pair] = stats.total_calls / requests[pair]  # type: ignore[attr-defined]
        per[pair] = {}
        for (file, line, func), (_, nc, *_rest) in stats.stats.items():  # type: ignore[attr-defined]
            key = f"{Path(file).name}:{line} {func}"
            per[pair][key] = per[pair].get(key, 0.0) + nc / requests[pair]
    print()
    print(f"function calls per request (cProfile, both instances): solo {total['solo']:.0f}, "
          f"shared {total['shared']:.0f}, added {total['shared'] - total['solo']:+.0f}")
    added = sorted(((per["shared"].get(k, 0.0) - per["solo"].get(k, 0.0), k) for k in per["shared"]), reverse=True)
    for n, key in added[:top]:
        print(f"  {n:+7.2f}  {key}")


def joined(port: int) -> bool:
    """Whether the instance at ``port`` shares counts now (its metrics' cluster gauge)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{HOST}:{port}/_crossbar/metrics", timeout=2) as r:
        text = r.read().decode()
    return "crossbar_cluster_up 1.0" in text and "crossbar_cluster_instances 2.0" in text


async def amain(args: argparse.Namespace) -> int:
    if shutil.which("wrk") is None:
        print("bench: wrk not found (apt-get install wrk)", file=sys.stderr)
        return 2
    started = loadavg()
    t0 = time.monotonic()
    results: dict[str, dict[str, list[float]]] = {p: {} for p in PAIRS}
    everything: list[subprocess.Popen[Any]] = []
    with tempfile.TemporaryDirectory(prefix="crossbar-bench-cluster-") as tmp:
        workdir = Path(tmp)
        lua = workdir / "post.lua"
        lua.write_text(_WRK_LUA)
        try:
            up, up_port = start_upstream(workdir, "upstream")
            everything.append(up)
            redis, redis_port = start_redis(workdir)
            everything.append(redis)
            procs: dict[str, tuple[subprocess.Popen[Any], int]] = {}
            for pair in PAIRS:
                for i in (1, 2):
                    name = f"{pair}{i}"
                    procs[name] = start_crossbar(workdir, name, up_port, redis_port if pair == "shared" else None,
                                                 args.calls)
                    everything.append(procs[name][0])
            deadline = time.monotonic() + 15
            while not all(joined(procs[f"shared{i}"][1]) for i in (1, 2)):
                if time.monotonic() > deadline:
                    raise SystemExit("bench: the shared instances did not join each other within 15 s")
                await asyncio.sleep(0.2)
            # warm-up: every process's code paths and connections
            for pair in PAIRS:
                await run_pair(procs, pair, redis.pid, args.connections, 1, lua)
            for r in range(args.rounds):
                order: list[tuple[str, ...]] = [(p,) for p in (PAIRS if r % 2 == 0 else PAIRS[::-1])]
                if args.together:  # both pairs at once: the machine's other work hits both alike
                    order = [PAIRS]
                for pairs in order:
                    calls0 = redis_calls(redis_port)
                    if args.calls:
                        for p in pairs:
                            await profiling(procs, p, workdir)
                    if args.rate:
                        outs = await asyncio.gather(*(
                            run_paced(procs, p, redis.pid, args.connections, args.seconds, args.rate) for p in pairs))
                    else:
                        outs = await asyncio.gather(*(
                            run_pair(procs, p, redis.pid, args.connections, args.seconds, lua) for p in pairs))
                    if args.calls:
                        for p in pairs:
                            await profiling(procs, p, workdir)
                    calls = redis_calls(redis_port)
                    for p, out in zip(pairs, outs):
                        requests = out["rps"] * args.seconds
                        for command, names in (("eval", ("eval", "evalsha")), ("publish", ("publish",))):
                            n = sum(calls.get(c, 0) - calls0.get(c, 0) for c in names)
                            out[f"redis_{command}"] = n / requests if p == "shared" or len(pairs) == 1 else 0.0
                        if len(pairs) > 1 and p == "solo":
                            out["redis_cpu_us"] = 0.0  # (Redis works for the shared pair alone)
                        for k, v in out.items():
                            results[p].setdefault(k, []).append(v)
                        print(f"round {r + 1} {p}: " + ", ".join(f"{k} {v:.3g}" for k, v in out.items()),
                              file=sys.stderr)
            still = all(joined(procs[f"shared{i}"][1]) for i in (1, 2))
            if args.calls:  # read before the temporary directory goes
                import pstats

                profiles = {pair: pstats.Stats(*(str(workdir / f"{pair}{i}.prof") for i in (1, 2))) for pair in PAIRS}
        finally:
            for p in everything:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM if p is not everything[0] else signal.SIGINT)
            for p in everything:
                try:
                    p.wait(40)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def med(pair: str, k: str) -> float:
        return statistics.median(results[pair][k])

    def span(pair: str, k: str, digits: int) -> str:
        v = results[pair][k]
        return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}-{max(v):.{digits}f}]"

    print(machine())
    how = (f"{args.rate:g} requests/s per instance on a fixed schedule over {args.connections} connections"
           if args.rate else f"wrk -t1 -c{args.connections}")
    if args.together:
        how += " (both pairs at once)"
    print(f"{args.rounds} round(s) of {args.seconds:g} s, {how} through each of two instances at once; {started} at start, {loadavg()} at end; {time.monotonic() - t0:.0f}s; "
          f"shared instances still joined at the end: {still}")
    print("values: median [min-max] over rounds")
    print()
    rows = [("requests/s (both)", "rps", 0), ("p50 ms (worse instance)", "p50", 2), ("p99 ms (worse instance)", "p99", 2),
            ("crossbar CPU (cores, both)", "crossbar_cpu", 2), ("crossbar CPU µs/request", "cpu_us", 0),
            ("redis CPU µs/request", "redis_cpu_us", 1), ("Redis scripts (EVAL/EVALSHA) per request", "redis_eval", 2),
            ("PUBLISH (in scripts) per request", "redis_publish", 2), ("non-2xx", "bad", 0)]
    print("| | solo (no cluster) | shared (cluster.redis) | added |")
    print("|---|---|---|---|")
    for label, k, d in rows:
        added = med("shared", k) - med("solo", k)
        print(f"| {label} | {span('solo', k, d)} | {span('shared', k, d)} | {added:+.{d}f} |")
    if args.calls:
        calls_report(profiles, {p: sum(r * args.seconds for r in results[p]["rps"]) for p in PAIRS}, args.calls)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--rate", type=float, default=0,
                        help="requests/s per instance on a fixed schedule (this script's client) "
                             "instead of wrk's as-fast-as-possible")
    parser.add_argument("--together", action="store_true",
                        help="load both pairs at once in every round (on a busy machine the neighbours then weigh "
                             "on both alike) rather than one pair after the other")
    parser.add_argument("--calls", metavar="N", type=int, default=0,
                        help="run the instances under cProfile (slower): function calls per request of each pair "
                             "and the N functions with the most added calls")
    parser.add_argument("--json")
    return asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
