#!/usr/bin/env python3
"""Which worker holds each client connection, sampled from /proc in a process of its own.

    python bench/worker_split.py SUPERVISOR_PID PORT

Samples every :data:`PERIOD` seconds how many of the ESTABLISHED connections on
``PORT`` each worker under ``SUPERVISOR_PID`` holds, until its standard input closes
(it prints ``ready`` first, once it is running);
then prints the sample with the most connections (busiest worker first) as one JSON
list and exits.

It runs apart from ``bench/run``'s load client on purpose: one sample reads all of
/proc/net/tcp (4 ms with ~650 sockets, more after wrk has left TIME_WAITs behind), and
in the client's own event loop that stall was counted as the proxy's lag and as
coalesced events of the ``workers: 2`` column (bench/HISTORY.md, "Fourth pass").
"""

from __future__ import annotations

import json
import os
import re
import select
import sys
from pathlib import Path

PERIOD = 0.1
"""Seconds between samples: (b)'s streams are all open for over a second, wrk's
connections for the whole run, so a few samples find the whole split."""


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` alive now (a supervisor's workers)."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            out += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return out


def established_inodes(port: int) -> set[bytes]:
    """Socket inodes of the ESTABLISHED TCP connections whose local port is ``port``
    (the proxy's side of its client connections), from /proc/net/tcp and tcp6.

    One pattern over the file instead of splitting each line: the fields before the
    inode are fixed-width hex, state ``01`` is ESTABLISHED."""
    line = re.compile(
        rb"^ *\d+: [0-9A-F]+:%04X [0-9A-F]+:[0-9A-F]{4} 01 \S+ \S+ \S+ +\d+ +\d+ +(\d+)" % port, re.M)
    out: set[bytes] = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            text = Path(name).read_bytes()
        except OSError:
            continue
        out.update(line.findall(text))
    return out


def connections_per_worker(supervisor: int, port: int) -> list[int]:
    """How many of the client connections on ``port`` each worker under ``supervisor``
    holds now (from each worker's open sockets), busiest first."""
    inodes = {b"socket:[%s]" % inode for inode in established_inodes(port)}
    counts = []
    for pid in children(supervisor):
        n = 0
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").encode() in inodes:
                        n += 1
                except OSError:
                    continue
        except OSError:
            continue
        counts.append(n)
    return sorted(counts, reverse=True)


def main() -> None:
    supervisor, port = int(sys.argv[1]), int(sys.argv[2])
    best: list[int] = []
    print("ready", flush=True)  # started: the load may begin without our start-up beside it
    while True:
        counts = connections_per_worker(supervisor, port)
        if sum(counts) > sum(best):
            best = counts
        if select.select([sys.stdin], [], [], PERIOD)[0]:
            break
    print(json.dumps(best), flush=True)


if __name__ == "__main__":
    main()
