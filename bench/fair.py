#!/usr/bin/env python3
"""Fair shares: queue waits and completions per key when a host of few slots
is shared by keys that send very different amounts.

    .venv/bin/python bench/fair.py [--slots 4] [--service-ms 100] [--seconds 15] [--json out.json]

One loopback host (asyncio, in this process) that holds every chat completion for
``--service-ms`` and reports 120 tokens (llama-server's ``timings``), behind one crossbar
(``twistd -n crossbar`` from this checkout, ``max_inflight: --slots`` on the host, a fresh
crossbar per phase so no phase inherits another's counts). Clients are closed loops on
kept-alive connections: a client sends, waits for the answer, sends again. The queue
wait of each request is the ``queued_ms`` of crossbar's own log line (its key is there
too); completions are 200 answers counted per key over the phase.

(a) A batch key (``priority: -1``) and an interactive key sending one request at a time
(20 ms between answer and next request):
  a-idle   the interactive key alone on an idle fleet (for reference: it never waits);
  a-room   the batch key keeps the fleet's room busy (``slots`` requests outstanding: no
           flood) -- the interactive key's "wait with no flood";
  a-flood  the batch key keeps 10x the fleet's room outstanding (the queue 9x the room deep);
  a-fifo   the same flood, the interactive requests sent under the batch key: what arrival
           order would give them.
  Target: p95 wait in a-flood <= 1.5x a-room.

(b) Two keys of one priority and share, ``heavy`` sending 10x more than ``light``
(``light`` keeps the fleet's room outstanding, twice its fair half, so it queues too):
  b-alone  ``light`` alone on the whole fleet (for reference: it never waits);
  b-share  ``light`` alone on half the slots: the room fair shares promise it;
  b-both   ``light`` and ``heavy`` (10x light's outstanding) on the whole fleet, both
           keeping the queue full;
  b-fifo   the same load, every request sent under one key: what arrival order would give.
  Targets: light's p95 wait in b-both <= 1.5x b-share; completions per key in b-both
  within 10%.

A request that finds a free slot never waits (0 ms), so a ratio to a wait on an idle fleet
says nothing: "no flood" and "alone" are measured where the fleet's room is in use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TWISTD = ("import sys, twisted.plugins as p; p.__path__.insert(0, sys.argv.pop(1)); "
           "sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()")
_ANSWER = json.dumps({"object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
    "timings": {"prompt_n": 100, "cache_n": 0, "predicted_n": 20}}).encode()
_MODELS = b'{"object":"list","data":[{"id":"m","object":"model"}]}'
KEYS = {"batch": -1, "interactive": 0, "heavy": 0, "light": 0}


class Host:
    """The loopback host: every chat completion is held ``service`` seconds."""

    def __init__(self, service: float) -> None:
        self.service = service

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *headers = head.decode("latin-1").split("\r\n")
                length = 0
                for h in headers:
                    name, _, value = h.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                path = line.split(" ")[1]
                if path.startswith("/v1/chat/completions"):
                    await asyncio.sleep(self.service)
                    body = _ANSWER
                elif path.startswith("/v1/models"):
                    body = _MODELS
                else:
                    body = b'{"status":"ok"}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Crossbar:
    """``twistd -n crossbar`` from this checkout, its JSON log in a file."""

    def __init__(self, host_port: int, slots: int, directory: str, name: str) -> None:
        self.port = free_port()
        self.log_path = os.path.join(directory, f"{name}.log")
        config = os.path.join(directory, f"{name}.yaml")
        keys = "".join(f"      {k}:\n        secret: {k}-secret\n        priority: {p}\n" for k, p in KEYS.items())
        with open(config, "w") as f:
            f.write(f'listen: "tcp:{self.port}:interface=127.0.0.1:backlog=1024"\n'
                    "health: {interval: 60, timeout: 5}\n"
                    f"hosts:\n  h:\n    url: http://127.0.0.1:{host_port}\n    max_inflight: {slots}\n"
                    "routes:\n  r:\n    hosts: [h]\n    queue: {max: 10000, timeout: 300}\n"
                    f"    keys:\n{keys}")
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _TWISTD, os.path.join(ROOT, "twisted", "plugins"), "-n", "--pidfile=",
             "--logger=crossbar.ops.jsonlog.observer", "crossbar", "--config", config],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    async def ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                status, _ = await request(self.port, "GET", "/_crossbar/readyz", None, None)
                if status == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise SystemExit(f"crossbar did not get ready: see {self.log_path}")

    def stop(self) -> list[dict[str, Any]]:
        """Stop it; every request's log record (method, key, status, queued_ms)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        records = []
        for line in open(self.log_path):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if "queued_ms" in doc and doc.get("path", "").endswith("/chat/completions"):
                records.append(doc)
        return records


async def request(port: int, method: str, path: str, key: str | None, conn: Any) -> tuple[int, Any]:
    """One HTTP/1.1 request on ``conn`` ((reader, writer), kept alive) or a new connection."""
    if conn is None:
        conn = await asyncio.open_connection("127.0.0.1", port)
    reader, writer = conn
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}' if method == "POST" else b""
    auth = f"Authorization: Bearer {key}-secret\r\n" if key else ""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    m = re.search(rb"(?i)content-length:\s*(\d+)", head)
    if m:
        await reader.readexactly(int(m.group(1)))
    return status, conn


@dataclass
class Load:
    """Closed-loop clients: ``clients[key] = (n, think seconds, sent as key)``."""

    clients: dict[str, tuple[int, float, str]]
    done: Counter[str] = field(default_factory=Counter)


async def client(port: int, label: str, send_as: str, think: float, stop_at: float, load: Load) -> None:
    conn = None
    while time.monotonic() < stop_at:
        status, conn = await request(port, "POST", "/r/v1/chat/completions", send_as, conn)
        if status == 200 and time.monotonic() <= stop_at:  # what ends after the phase is not counted
            load.done[label] += 1
        if think:
            await asyncio.sleep(think)
    if conn is not None:
        conn[1].close()


@dataclass
class Phase:
    name: str
    load: Load
    waits: dict[str, list[float]]
    seconds: float


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def p95(values: list[float]) -> float:
    return pct(values, 0.95)


async def run_phase(name: str, slots: int, clients: dict[str, tuple[int, float, str]], host_port: int,
                    args: argparse.Namespace, directory: str) -> Phase:
    xb = Crossbar(host_port, slots, directory, name)
    try:
        await xb.ready()
        load = Load(clients)
        start = time.monotonic()
        stop_at = start + args.seconds
        tasks = [asyncio.create_task(client(xb.port, label, send_as, think, stop_at, load))
                 for label, (n, think, send_as) in clients.items() for _ in range(n)]
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - start
    finally:
        records = xb.stop()
    waits: dict[str, list[float]] = defaultdict(list)
    # Labels share keys only in a-fifo, where the interactive client's requests are the
    # batch key's: they are told apart there by the count (see report()).
    for doc in records:
        if doc.get("status") == 200:
            waits[doc.get("key", "")].append(float(doc["queued_ms"]))
    return Phase(name, load, dict(waits), elapsed)


async def fifo_phase(host_port: int, args: argparse.Namespace, directory: str) -> Phase:
    """a-fifo: the interactive requests sent as the batch key; their waits measured by the client."""
    xb = Crossbar(host_port, args.slots, directory, "a-fifo")
    waits: list[float] = []
    try:
        await xb.ready()
        load = Load({})
        stop_at = time.monotonic() + args.seconds
        floods = [asyncio.create_task(client(xb.port, "batch", "batch", 0, stop_at, load))
                  for _ in range(10 * args.slots)]
        await asyncio.sleep(1)  # the queue fills
        conn = None
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            status, conn = await request(xb.port, "POST", "/r/v1/chat/completions", "batch", conn)
            if status == 200 and time.monotonic() <= stop_at:
                load.done["interactive"] += 1
                waits.append(max(0.0, (time.monotonic() - t0) * 1000 - args.service_ms))
            await asyncio.sleep(0.02)
        await asyncio.gather(*floods)
    finally:
        xb.stop()
    return Phase("a-fifo", load, {"interactive": waits}, args.seconds)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    host = Host(args.service_ms / 1000)
    server = await asyncio.start_server(host.handle, "127.0.0.1", 0, backlog=1024)
    host_port = server.sockets[0].getsockname()[1]
    directory = tempfile.mkdtemp(prefix="crossbar-fair-")
    s = args.slots
    half = max(1, s // 2)
    plan: list[tuple[str, int, dict[str, tuple[int, float, str]]]] = [
        ("a-idle", s, {"interactive": (1, 0.02, "interactive")}),
        ("a-room", s, {"interactive": (1, 0.02, "interactive"), "batch": (s, 0, "batch")}),
        ("a-flood", s, {"interactive": (1, 0.02, "interactive"), "batch": (10 * s, 0, "batch")}),
        ("b-alone", s, {"light": (s, 0, "light")}),
        ("b-share", half, {"light": (s, 0, "light")}),
        ("b-both", s, {"light": (s, 0, "light"), "heavy": (10 * s, 0, "heavy")}),
    ]
    if not args.no_fifo:  # the same load sent under one key: arrival order (completions by client)
        plan.append(("b-fifo", s, {"light": (s, 0, "heavy"), "heavy": (10 * s, 0, "heavy")}))
    phases: dict[str, Phase] = {}
    for name, slots, clients in plan:
        if args.only and name not in args.only:
            continue
        phases[name] = await run_phase(name, slots, clients, host_port, args, directory)
        report_phase(phases[name])
        if name == "a-flood" and not args.no_fifo and (not args.only or "a-fifo" in args.only):
            phases["a-fifo"] = await fifo_phase(host_port, args, directory)
            report_phase(phases["a-fifo"])
    server.close()
    return {} if args.only else report(phases, args)


def report_phase(phase: Phase) -> None:
    parts = []
    for key in sorted(phase.load.done):
        waits = phase.waits.get(key, [])
        wait = f", wait p50 {pct(waits, 0.5):.1f} / p95 {p95(waits):.1f} ms" if waits else ""
        parts.append(f"{key}: {phase.load.done[key]} done{wait}")
    print(f"{phase.name:8s} ({phase.seconds:.0f} s)  " + "; ".join(parts), flush=True)


def report(phases: dict[str, Phase], args: argparse.Namespace) -> dict[str, Any]:
    def wait(phase: str, key: str) -> float:
        return p95(phases[phase].waits.get(key, []))

    a_room, a_flood = wait("a-room", "interactive"), wait("a-flood", "interactive")
    b_alone, b_room, b_flood = wait("b-alone", "light"), wait("b-share", "light"), wait("b-both", "light")
    full = phases["b-both"].load.done
    spread = abs(full["light"] - full["heavy"]) / max(full["light"], full["heavy"], 1)
    lines = [
        f"(a) interactive p95 wait: no flood {a_room:.1f} ms, flood {a_flood:.1f} ms -> "
        f"{a_flood / max(a_room, 1e-9):.2f}x (target <= 1.5x)"
        + (f"; arrival order would give {wait('a-fifo', 'interactive'):.1f} ms" if "a-fifo" in phases else ""),
        f"(b) light p95 wait: alone on its share of the fleet {b_room:.1f} ms (on the whole fleet {b_alone:.1f} ms), "
        f"with heavy at 10x {b_flood:.1f} ms -> {b_flood / max(b_room, 1e-9):.2f}x (target <= 1.5x)",
        f"(b) both keeping the queue full: light {full['light']} / heavy {full['heavy']} completions "
        f"-> {spread * 100:.1f}% apart (target <= 10%)",
    ]
    print("\n".join(lines), flush=True)
    return {
        "slots": args.slots, "service_ms": args.service_ms, "seconds": args.seconds,
        "phases": {name: {"done": dict(p.load.done), "p95_wait_ms": {k: p95(v) for k, v in p.waits.items()},
                          "n": {k: len(v) for k, v in p.waits.items()}} for name, p in phases.items()},
        "a_ratio": a_flood / max(a_room, 1e-9), "b_ratio": b_flood / max(b_room, 1e-9), "b_spread": spread,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4, help="the host's max_inflight")
    parser.add_argument("--service-ms", type=float, default=100.0, help="how long the host holds each request")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    parser.add_argument("--no-fifo", action="store_true", help="skip the arrival-order contrasts (a-fifo, b-fifo)")
    parser.add_argument("--only", nargs="*", help="run these phases only (e.g. b-both b-fifo); no summary")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    out = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
