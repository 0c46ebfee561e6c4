#!/usr/bin/env python3
"""Where models live (issue 31): one mixed-model workload replayed through crossbar with a
route's ``placement`` on, and through the same route without it.

    .venv/bin/python bench/placement.py [--seconds 60] [--rate 6] [--hosts 4] [--models 8]
                                        [--load-time 2] [--seed 31] [--seeds 1] [--modes off,on]
                                        [--warm N] [--max-inflight 2] [--spread-after 5]
                                        [--real] [--json FILE]

The fleet: ``--hosts`` router-mode hosts (``models_max: 2``, ``max_inflight``
``--max-inflight``) listing ``--models`` models ``m0``.. of skewed popularity (the first
N of the weights 50, 15, 10, 8, 6, 5, 4, 2: a hot one, a long tail), Poisson arrivals at
``--rate`` plus bursts (every 6 s, 12 requests at once for a model of the less popular
half). Each request is a streamed chat completion of 10 events 50 ms apart (0.5 s of
generation). By default the hosts are in-process fakes (tests/fake_router.py: a load
takes ``--load-time`` seconds; ``--models-max``, eviction of the least recently used idle
model and the host's own queue as llama-server 0.7.0 does them); with ``--real`` they are
real llama-servers in router mode (tools/llama_server.py, tiny models tiny-a and tiny-b
only: loads take milliseconds, so the figures say little more than "it works").

A workload (arrival times, models, bursts) is drawn from a seed and replayed against a
fresh crossbar and fresh hosts once per mode: ``off`` (no ``placement``) then ``on``
(``placement: {spread_after: --spread-after}``); ``--modes on`` replays only one. Then,
on each, a burst of 20 requests for a model loaded nowhere. ``--seeds K`` repeats the
whole pair on the workloads of seeds ``--seed`` .. ``--seed`` + K - 1, one after the
other. Per run: requests, loads per 1,000 requests (loads the hosts started, by a request
or a command), 503s, other errors, streams cut short, p50/p95 time to first token (from
the request sent to crossbar to its first body byte, waits included), also per kind of
request (``hot``: the hot model; ``steady``: the others' Poisson arrivals; ``burst``), the
time requests spent at a host waiting for their model (a place and the load; sum and per
request), the fakes' loads and evictions per model (m0 first), and in the final burst the
number of hosts that loaded its model. At the end: a line per seed (its main figures and
on / off ratios), and a table of the medians over the seeds of each figure and of each
run's on / off ratio (``--json`` writes all of it).

crossbar, the hosts and the load generator share one process and reactor (the figures
are seconds of loading and waiting, not CPU).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from twisted.internet import defer, reactor, task  # noqa: E402
from twisted.internet.endpoints import TCP4ServerEndpoint  # noqa: E402
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody  # noqa: E402
from twisted.web.http_headers import Headers  # noqa: E402
from twisted.web.server import Site  # noqa: E402

from crossbar.config import parse_config  # noqa: E402
from crossbar.process.service import make_service  # noqa: E402
from tests.fake_router import FakeRouter  # noqa: E402

MODELS = [f"m{i}" for i in range(8)]
BURST = "burst"
"""A model every host lists that the workload never asks for: the final burst's."""
WEIGHTS = [50, 15, 10, 8, 6, 5, 4, 2]


def workload(seconds: float, rate: float, seed: int, models: list[str], burst: int = 12,
             burst_every: int = 6) -> list[tuple[float, str, str]]:
    """(send time in s from the start, model, ``steady`` or ``burst``) for every request,
    sorted."""
    rng = random.Random(seed)
    weights = WEIGHTS[:len(models)]
    out: list[tuple[float, str, str]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        out.append((t, rng.choices(models, weights)[0], "steady"))
    for start in range(3, int(seconds), burst_every):  # bursts for a tail model
        model = rng.choice(models[len(models) // 2:])
        out += [(start + i * 0.01, model, "burst") for i in range(burst)]
    return sorted(out)


class Quiet(Site):
    noisy = False

    def log(self, request: Any) -> None:
        pass


class Run:
    """One crossbar and its hosts for one replay."""

    def __init__(self, name: str, args: argparse.Namespace, models: list[str]) -> None:
        self.name, self.args, self.models = name, args, models
        self.routers: list[FakeRouter] = []
        self.ttft: list[float] = []
        self.ttft_by: dict[str, list[float]] = {}
        self.truncated = 0
        self.codes: list[int] = []
        self.servers: list[Any] = []
        self.real_urls: list[str] = []

    async def start(self, placement: bool) -> None:
        args = self.args
        urls = []
        if args.real:
            from tools.llama_server import LlamaServer
            for _ in range(args.hosts):
                server = LlamaServer("router", extra_args=["--models-max", "2"])
                server.start(timeout=90)
                self.servers.append(server)
                urls.append(server.url)
        else:
            for _ in range(args.hosts):
                router = FakeRouter(self.models + [BURST], models_max=2, load_time=args.load_time)
                self.routers.append(router)
                port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Quiet(router))
                self.servers.append(port)
                urls.append(f"http://127.0.0.1:{port.getHost().port}")
        names = [f"h{i}" for i in range(len(urls))]
        text = ('listen: "tcp:0:interface=127.0.0.1"\ndrain: {delay: 0.001, grace: 0.001}\n'
                "health: {interval: 0.5, timeout: 2}\ntimeouts: {first_byte: 60}\nhosts:\n")
        text += "".join(f"  {n}: {{url: \"{u}\", models_max: 2, max_inflight: {args.max_inflight}}}\n"
                        for n, u in zip(names, urls))
        text += f"routes:\n  r:\n    hosts: [{', '.join(names)}]\n    queue: {{max: 1000, timeout: 30}}\n"
        text += "    affinity: {key: none}\n"
        if placement:
            text += f"    placement: {{spread_after: {self.args.spread_after}}}\n"
        self.service = make_service(parse_config(text, f"bench-{self.name}.yaml"))
        self.service.startService()
        port = await self.service.web.when_listening()
        self.base = f"http://127.0.0.1:{port.getHost().port}"
        await self.service.poller.when_first_round_done()
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = 64
        self.agent = Agent(reactor, pool=self.pool)

    async def stop(self) -> None:
        await self.service.stopService()
        await self.pool.closeCachedConnections()
        for server in self.servers:
            if hasattr(server, "stopListening"):
                await server.stopListening()
            else:
                server.stop()

    async def one(self, model: str, stream: bool = True, kind: str = "") -> None:
        doc: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                               "max_tokens": 10}
        if not self.args.real:  # the fake host's pace: 10 events 50 ms apart
            doc.update(n=10, delay=0.05)
        body = json.dumps(doc).encode()
        sent = time.monotonic()
        response = await self.agent.request(b"POST", (self.base + "/r/v1/chat/completions").encode(),
                                            Headers({b"content-type": [b"application/json"]}),
                                            FileBodyProducer(io.BytesIO(body)))
        first: list[float] = []
        ended: list[bytes] = []
        if response.code == 200:
            done: defer.Deferred[None] = defer.Deferred()
            from twisted.internet.protocol import Protocol

            class Reader(Protocol):
                def dataReceived(self, data: bytes) -> None:
                    if not first:
                        first.append(time.monotonic())
                    ended[:] = [(ended[0] if ended else b"")[-16:] + data]

                def connectionLost(self, reason: Any = None) -> None:
                    done.callback(None)

            response.deliverBody(Reader())
            await done
        else:
            await readBody(response)
        self.codes.append(response.code)
        if first:
            self.ttft.append(first[0] - sent)
            self.ttft_by.setdefault(kind, []).append(first[0] - sent)
        if response.code == 200 and stream and not (ended and ended[0].rstrip().endswith(b"[DONE]")):
            self.truncated += 1  # a stream cut short (the host cut it, or crossbar did)

    async def replay(self, plan: list[tuple[float, str, str]]) -> None:
        start = time.monotonic()
        pending = []
        for at, model, kind in plan:
            delay = start + at - time.monotonic()
            if delay > 0:
                await task.deferLater(reactor, delay)
            pending.append(defer.ensureDeferred(self.one(model, kind="hot" if model == self.models[0] else kind)))
        await defer.DeferredList(pending)

    def loads(self, model: str | None = None) -> int:
        """Loads the hosts started (of ``model``, or of any): a fake host's list, a real
        one's log (a line per model process it spawns)."""
        if self.routers:
            return sum(len([m for m in r.loads if model is None or m == model]) for r in self.routers)
        return sum(self.spawned(server, model) for server in self.servers)

    @staticmethod
    def spawned(server: Any, model: str | None = None) -> int:
        marker = "spawning server instance with name=" + (model or "")
        return sum(1 for line in server.log_path.read_text(errors="replace").splitlines() if marker in line)

    def load_wait(self) -> float:
        return sum(r.load_wait for r in self.routers) if self.routers else 0.0

    async def final_burst(self) -> int:
        """20 requests at once for a model loaded nowhere: how many hosts load it."""
        if self.args.real:  # tiny-b, unloaded everywhere first
            model = "tiny-b"
            for server in self.servers:
                await self.agent.request(b"POST", (server.url + "/models/unload").encode(),
                                         Headers({b"content-type": [b"application/json"]}),
                                         FileBodyProducer(io.BytesIO(json.dumps({"model": model}).encode())))
            await task.deferLater(reactor, 2.0)  # unloaded, and polled so
            before = [self.spawned(s, model) for s in self.servers]
            await defer.DeferredList([defer.ensureDeferred(self.one(model, stream=False)) for _ in range(20)])
            return sum(1 for s, b in zip(self.servers, before) if self.spawned(s, model) > b)
        model = BURST
        before = [r.loads.count(model) for r in self.routers]
        await defer.DeferredList([defer.ensureDeferred(self.one(model, stream=False)) for _ in range(20)])
        return sum(1 for r, b in zip(self.routers, before) if r.loads.count(model) > b)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def pair(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The workload of ``seed`` replayed with each of ``args.modes`` (``off``, ``on``):
    mode -> its figures."""
    models = ["tiny-a", "tiny-b"] if args.real else MODELS[:args.models]
    plan = workload(args.seconds, args.rate, seed, models)
    results: dict[str, Any] = {}
    for name in args.modes:
        run = Run(name, args, models)
        await run.start(name == "on")
        # Warm-up (not counted): the most popular models once each, one after the other,
        # so the replay starts from a fleet where each is loaded on one host.
        for model in models[:args.warm]:
            await run.one(model, stream=False)
        await task.deferLater(reactor, 1.5)
        run.codes, run.ttft, run.ttft_by, run.truncated = [], [], {}, 0
        base_loads, base_wait = run.loads(), run.load_wait()
        t0 = time.monotonic()
        await run.replay(plan)
        took = time.monotonic() - t0
        n = len(run.codes)
        loads = run.loads() - base_loads
        results[name] = {
            "requests": n,
            "loads": loads,
            "loads_per_1000": round(1000 * loads / n, 1) if n else None,
            "503s": run.codes.count(503),
            "other_errors": sum(1 for c in run.codes if c not in (200, 503)),
            "ttft_p50_s": round(pct(run.ttft, 0.50), 3),
            "ttft_p95_s": round(pct(run.ttft, 0.95), 3),
            "ttft_p50_p95_by_kind_s": {kind: [len(v), round(pct(v, 0.5), 3), round(pct(v, 0.95), 3)]
                                       for kind, v in sorted(run.ttft_by.items())},
            "truncated": run.truncated,
            "load_wait_s": round(run.load_wait() - base_wait, 1),
            "load_wait_per_request_s": round((run.load_wait() - base_wait) / n, 3) if n else None,
            "seconds": round(took, 1),
        }
        if run.routers:  # which models were loaded (and evicted) how often, over the hosts
            results[name]["loads_by_model"] = {m: sum(r.loads.count(m) for r in run.routers) for m in models}
            results[name]["evictions_by_model"] = {m: sum(r.evictions.count(m) for r in run.routers) for m in models}
        results[name]["burst_hosts_loading"] = await run.final_burst()
        metrics = run.service.metrics.render().decode()
        results[name]["loads_by_reason"] = {
            reason: int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                            if line.startswith("crossbar_model_loads_total{") and f'reason="{reason}"' in line))
            for reason in ("request", "spread", "keep")}
        await run.stop()
        print(f"seed {seed} {name}: {results[name]}", flush=True)
    return results


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Every seed's pair, then the medians: ``{"runs": [{"seed", "off", "on"}, ...],
    "median": {mode: {figure: median}}, "ratio": {figure: median of on / off}}``."""
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        runs.append({"seed": seed, **await pair(args, seed)})
    return summarize(runs, args.modes)


FIGURES = [("requests", "requests"), ("loads per 1,000 requests", "loads_per_1000"), ("503s", "503s"),
           ("other errors", "other_errors"), ("streams cut short", "truncated"),
           ("TTFT p50 (s)", "ttft_p50_s"), ("TTFT p95 (s)", "ttft_p95_s"),
           ("waiting for a load, total (s)", "load_wait_s"), ("... per request (s)", "load_wait_per_request_s"),
           ("burst of 20, model loaded nowhere: hosts that load it", "burst_hosts_loading")]
"""(label, key) of the figures every run has, in the order the tables print them."""
RATIOS = ["loads_per_1000", "503s", "ttft_p50_s", "ttft_p95_s", "load_wait_s"]
"""The figures whose on / off ratio is printed (per run, and its median)."""


def ratio(on: float | None, off: float | None) -> float | None:
    """on / off, rounded; None when either is missing, or off is 0 (0 / 0 counts as 1.0:
    no 503s either way)."""
    if on is None or off is None:
        return None
    if off == 0:
        return 1.0 if on == 0 else None
    return round(on / off, 2)


def median(values: list[Any]) -> float | None:
    """The median of the numbers among ``values`` (None when there are none)."""
    numbers = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(numbers), 3) if numbers else None


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Each run's on / off ratios (when both ran), the medians over the runs of each
    figure and of each ratio."""
    both = "off" in modes and "on" in modes
    for run in runs:
        if both:
            run["ratio"] = {key: ratio(run["on"][key], run["off"][key]) for key in RATIOS}
    out: dict[str, Any] = {"runs": runs, "median": {
        mode: {key: median([run[mode][key] for run in runs]) for _, key in FIGURES} for mode in modes}}
    if both:
        out["ratio"] = {key: median([run["ratio"][key] for run in runs]) for key in RATIOS}
    return out


def table(results: dict[str, Any], modes: list[str]) -> str:
    """One run's figures (``results``: mode -> figures), a column per mode."""
    out = ["| | " + " | ".join(f"placement {m}" for m in modes) + " |", "|---|" + "---:|" * len(modes)]
    for label, key in FIGURES:
        out.append(f"| {label} | " + " | ".join(str(results[m][key]) for m in modes) + " |")
    for kind in sorted(results[modes[0]]["ttft_p50_p95_by_kind_s"]):
        cells = [results[m]["ttft_p50_p95_by_kind_s"].get(kind, ["-"] * 3) for m in modes]
        out.append(f"| TTFT p50 / p95 (s), {kind} ({cells[0][0]}) | "
                   + " | ".join(f"{c[1]} / {c[2]}" for c in cells) + " |")
    for key in ("loads_by_model", "evictions_by_model"):
        if key in results[modes[0]]:
            out.append(f"| {key.replace('_', ' ')} | "
                       + " | ".join(" ".join(str(v) for v in results[m][key].values()) for m in modes) + " |")
    return "\n".join(out)


def summary(out: dict[str, Any], modes: list[str]) -> str:
    """A line per run (its main figures and ratios), then the medians over the runs."""
    lines = []
    for run in out["runs"]:
        figures = "; ".join(f"{m} {run[m]['loads_per_1000']} loads/1000, p95 {run[m]['ttft_p95_s']} s, "
                            f"{run[m]['503s']} 503s, burst on {run[m]['burst_hosts_loading']}" for m in modes)
        ratios = (", on/off: loads " + str(run["ratio"]["loads_per_1000"]) + ", p95 "
                  + str(run["ratio"]["ttft_p95_s"])) if "ratio" in run else ""
        lines.append(f"seed {run['seed']}: {figures}{ratios}")
    lines += ["", f"medians over {len(out['runs'])} run(s):", "",
              "| | " + " | ".join(f"placement {m}" for m in modes) + (" | on / off |" if "ratio" in out else " |"),
              "|---|" + "---:|" * (len(modes) + ("ratio" in out))]
    for label, key in FIGURES:
        cells = [str(out["median"][m][key]) for m in modes]
        if "ratio" in out:
            cells.append(str(out["ratio"][key]) if key in RATIOS else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rate", type=float, default=6, help="requests/s (Poisson), bursts come on top")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--load-time", type=float, default=2.0, help="s a fake host takes to load a model")
    parser.add_argument("--seed", type=int, default=31, help="the first workload's seed")
    parser.add_argument("--seeds", type=int, default=1, help="workloads (seeds --seed, --seed + 1, ...)")
    parser.add_argument("--models", type=int, default=8, choices=range(2, 9), metavar="2..8",
                        help="models m0.. of the skew (the first N weights)")
    parser.add_argument("--modes", default="off,on", help="which replays, in order: off,on / on / off")
    parser.add_argument("--warm", type=int, default=0, help="models requested once each before the replay")
    parser.add_argument("--max-inflight", type=int, default=2, help="each host's max_inflight (its slots)")
    parser.add_argument("--spread-after", type=float, default=5, help="placement.spread_after of the on run")
    parser.add_argument("--real", action="store_true", help="real llama-servers in router mode (tiny models)")
    parser.add_argument("--json", help="write the figures here too")
    ns = parser.parse_args()
    ns.modes = [m for m in ns.modes.split(",") if m]
    if not ns.modes or set(ns.modes) - {"off", "on"}:
        parser.error("--modes: off, on or off,on")
    out: dict[str, Any] = {}

    def run() -> defer.Deferred[None]:
        async def go() -> None:
            try:
                out.update(await main(ns))
            finally:
                reactor.stop()
        return defer.ensureDeferred(go())

    reactor.callWhenRunning(run)
    reactor.run()
    if out:
        for one in out["runs"]:
            print(f"\nseed {one['seed']}:\n" + table(one, ns.modes))
        print()
        print(summary(out, ns.modes))
        if ns.json:
            Path(ns.json).write_text(json.dumps(out, indent=2))
