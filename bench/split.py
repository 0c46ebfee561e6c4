#!/usr/bin/env python3
"""How ``workers: 2`` splits connections: a burst of 100 connections and
16 kept-alive connections, counted by which worker accepted each (read from /proc).

    bench/split.py [--root CHECKOUT] [--workers 2] [--rounds 5]

Starts ``twistd -n crossbar`` from CHECKOUT (default: this one) with ``workers: N`` on
a free loopback port (its one host unreachable: only ``/_crossbar/livez`` is asked),
waits for every worker, then opens the connections at once, sends
``GET /_crossbar/livez`` on each (kept alive) and prints the split, ``rounds`` times.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter

_TWISTD = ("import sys, twisted.plugins as p; p.__path__.insert(0, sys.argv.pop(1)); "
           "sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()")


def socket_inode(port: int, local: int) -> str | None:
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and int(fields[2].split(":")[1], 16) == local:
            return fields[9]
    return None


def split(port: int, pids: dict[int, int], connections: int, rounds: int) -> Counter[int]:
    clients = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(connections)]
    for client in clients:
        client.connect()
    for _ in range(rounds):
        for client in clients:
            client.request("GET", "/_crossbar/livez")
            response = client.getresponse()
            response.read()
    inodes = {socket_inode(port, client.sock.getsockname()[1]) for client in clients}
    held: Counter[int] = Counter()
    for index, pid in pids.items():
        links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        held[index] = sum(1 for inode in inodes if f"socket:[{inode}]" in links)
    for client in clients:
        client.close()
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="crossbar-split-")
    config = os.path.join(directory, "crossbar.yaml")
    with open(config, "w") as f:
        f.write(f'listen: "tcp:0:interface=127.0.0.1"\nworkers: {args.workers}\nhealth: {{interval: 60, timeout: 2}}\n'
                "hosts: {a: 'http://127.0.0.1:9'}\nroutes: {r: {hosts: [a]}}\n")
    env = dict(os.environ, PYTHONPATH=args.root, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _TWISTD, os.path.join(args.root, "twisted", "plugins"), "-n", "--pidfile=",
         "--logger=crossbar.ops.jsonlog.observer", "crossbar", "--config", config],
        stdout=subprocess.PIPE, env=env, cwd=args.root, text=True,
    )
    port, pids, ready = 0, {}, set()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            message = str(doc.get("message", ""))
            m = re.search(r"(?:127\.0\.0\.1):(\d+)", str(doc.get("address", "")))
            if m and not port:
                port = int(m.group(1))
            m = re.match(r"worker (\d+) started \(pid (\d+)\)", message)
            if m:
                pids[int(m.group(1))] = int(m.group(2))
            m = re.match(r"worker (\d+) is ready", message)
            if m:
                ready.add(int(m.group(1)))
                if len(ready) == args.workers:
                    break
        time.sleep(1)
        for burst, rounds in ((100, 1), (16, 5)):
            for _ in range(args.rounds):
                held = split(port, pids, burst, rounds)
                print(f"{burst:3d} connections: " + " / ".join(str(held[i]) for i in sorted(pids)), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
