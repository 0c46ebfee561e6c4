"""bench/run's body: start the upstream and crossbar, run the scenarios, print the table.

See bench/README.md for what each figure means. Run through ``bench/run`` (which makes
the venv); ``python bench/runner.py --help`` lists the options.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.client
import json
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import StreamsResult, run_streams, slow_read  # noqa: E402

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
ROUTE = "/bench"
ROUTE2 = "/bench2"
"""Scenario (f): one route over two upstreams (``up`` and ``up2``)."""
_CLK = os.sysconf("SC_CLK_TCK")
_PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024

# -- processes -----------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` in MiB."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_KIB / 1024


def pss_mib(pid: int) -> float:
    """Proportional set size of ``pid`` in MiB (``/proc/<pid>/smaps_rollup``): its
    private pages plus its share of each page it shares (a supervisor's and its workers'
    interpreter and libraries count once over the tree, not once per process)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _tree_sum(pid: int, each: Callable[[int], float]) -> float:
    """``each(p)`` summed over ``pid`` and its live descendants (one that ends meanwhile counts 0)."""
    total = 0.0
    for p in tree(pid):
        try:
            total += each(p)
        except OSError:
            pass
    return total


def tree_pss_mib(pid: int) -> float:
    """PSS summed over ``pid`` and its live descendants, in MiB."""
    return _tree_sum(pid, pss_mib)


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants alive now (a supervisor and its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants (workers die only on purpose)."""
    return _tree_sum(pid, cpu_seconds)


def tree_rss_mib(pid: int) -> tuple[float, float]:
    """(RSS of ``pid`` itself, largest RSS among its descendants) in MiB; the second is 0
    when it has none (one process, no workers)."""
    kids = [rss_mib(p) for p in tree(pid)[1:]]
    return rss_mib(pid), max(kids, default=0.0)


def _die_with_parent() -> None:
    """In a child before exec: get SIGTERM when the runner dies, however it dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_http(url: str, timeout: float, proc: subprocess.Popen[Any]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench: {proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"bench: {url} did not answer 200 within {timeout:g}s")


PROXIES = ("crossbar", "workers2")
"""The crossbar targets: crossbar as one process (no ``workers`` key), and crossbar with
``workers: N`` (``--workers``, default 2; the column is named ``workers2`` whatever N)."""
TARGETS = ("direct",) + PROXIES
PEERS = ("haproxy", "vllm-router", "smg")
"""The other proxies in front of the same upstream (``--peers``): HAProxy
(Debian's), and the LLM gateways vllm-router and smg (Rust, PyPI wheels, each in its
own venv made here). They get the bare ``/v1/...`` paths and run (a)-(d) only."""
PEER_SCENARIOS = frozenset("abcd")
PEER_PACKAGES = {"vllm-router": "vllm-router==0.1.17", "smg": "smg==1.13.0"}
"""Pinned so that a table can be taken again; ``BENCH_PEER_LATEST=1`` takes PyPI's newest."""


@dataclass
class Procs:
    upstream: subprocess.Popen[Any]
    crossbar: subprocess.Popen[Any]
    up_port: int
    cb_port: int
    workdir: Path
    upstream2: subprocess.Popen[Any] | None = None
    up2_port: int = 0
    workers2: subprocess.Popen[Any] | None = None
    w2_port: int = 0
    peers: dict[str, tuple[subprocess.Popen[Any], int]] = field(default_factory=dict)

    def proxy(self, target: str) -> tuple[subprocess.Popen[Any], int]:
        """The process and port of a proxy target (:data:`PROXIES` or a started peer)."""
        if target == "workers2" and self.workers2 is not None:
            return self.workers2, self.w2_port
        if target == "crossbar":
            return self.crossbar, self.cb_port
        if target in self.peers:
            return self.peers[target]
        raise KeyError(target)

    def targets(self) -> tuple[str, ...]:
        """direct, the crossbar columns, then the peers that started (PEERS' order)."""
        own = TARGETS if self.workers2 is not None else ("direct", "crossbar")
        return own + tuple(p for p in PEERS if p in self.peers)


def start_upstream(workdir: Path, name: str) -> tuple[subprocess.Popen[Any], int]:
    """Start one ``bench/upstream.py``; returns the process and its port."""
    up = subprocess.Popen(
        [sys.executable, str(HERE / "upstream.py"), "--port", "0"],
        stdout=subprocess.PIPE, stderr=open(workdir / f"{name}.stderr", "w"), text=True,
        preexec_fn=_die_with_parent,
    )
    line = up.stdout.readline() if up.stdout else ""
    if not line.startswith("ready "):
        up.kill()
        raise SystemExit(f"bench: {name} did not start: {line!r}")
    return up, int(line.split()[1])


def start(workdir: Path, workers: int, peers: bool = False, notes: list[str] | None = None) -> Procs:
    """Start the two upstreams, then crossbar (a real ``twistd -n crossbar``, one
    process): route ``bench`` over ``up`` alone, route ``bench2`` over ``up`` and ``up2``
    (scenario (f)); with ``workers`` > 1 also a second crossbar, the same config with
    ``workers: N`` (column ``workers2``); with ``peers`` each of :data:`PEERS` in front
    of ``up`` (one that cannot be installed or started is skipped with one line, printed
    and added to ``notes``)."""
    up, up_port = start_upstream(workdir, "upstream")
    up2, up2_port = start_upstream(workdir, "upstream2")
    procs = Procs(up, up, up_port, 0, workdir, up2, up2_port)  # crossbar set below
    try:
        procs.crossbar, procs.cb_port = start_crossbar(workdir, "crossbar", up_port, up2_port, 1)
        if workers > 1:
            procs.workers2, procs.w2_port = start_crossbar(workdir, "workers2", up_port, up2_port, workers)
        if peers:
            for name in PEERS:
                try:
                    procs.peers[name] = start_peer(workdir, name, up_port)
                except PeerSkipped as e:
                    line = f"{name} column skipped: {e}"
                    print(f"bench: {line}", file=sys.stderr)
                    if notes is not None:
                        notes.append(line)
    except BaseException:
        stop(procs)
        raise
    return procs


class PeerSkipped(Exception):
    """A peer proxy could not be installed or started (the one-line reason)."""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def peer_venv(name: str) -> Path:
    """``bench/.venv-<name>`` with :data:`PEER_PACKAGES` ``[name]`` installed (made
    when its executable is missing; ``BENCH_PEER_VENVS`` puts them elsewhere); returns
    the executable."""
    root = Path(os.environ.get("BENCH_PEER_VENVS", HERE))
    venv = root / f".venv-{name}"
    exe = venv / "bin" / name
    if exe.exists():
        return exe
    spec = name if os.environ.get("BENCH_PEER_LATEST") else PEER_PACKAGES[name]
    print(f"bench: installing {spec} into {venv}", file=sys.stderr)
    base = getattr(sys, "_base_executable", None) or sys.executable
    for cmd in ([base, "-m", "venv", "--clear", str(venv)],
                [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", spec]):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PeerSkipped(f"cannot install {spec}: {e}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            raise PeerSkipped(f"cannot install {spec} ({' '.join(cmd[2:4])}: {last})")
    if not exe.exists():
        raise PeerSkipped(f"{spec} installed but {exe} is missing")
    return exe


def haproxy_exe() -> str:
    """Debian's haproxy, installed with apt-get when missing (as bench/run does wrk)."""
    exe = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if exe:
        return exe
    print("bench: installing haproxy (apt-get)", file=sys.stderr)
    sudo = [] if os.getuid() == 0 else ["sudo"]
    for cmd in (sudo + ["apt-get", "install", "-y", "-qq", "haproxy"],
                sudo + ["apt-get", "update", "-qq"], sudo + ["apt-get", "install", "-y", "-qq", "haproxy"]):
        try:
            ok = subprocess.run(cmd, capture_output=True, timeout=600).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok and cmd[-1] == "haproxy":
            break
    exe = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if not exe:
        raise PeerSkipped("haproxy not found and apt-get install haproxy failed")
    return exe


HAPROXY_CFG = """# bench: HAProxy in front of the fake upstream: http mode, one server,
# keep-alive on both sides (http-keep-alive on the client side, idle server connections
# reused), no logging; threads: HAProxy's default (one per core). http-no-delay: without
# it HAProxy sends a chunked answer's pieces with MSG_MORE while it expects more, and
# the kernel holds each SSE event up to 200 ms (measured: 98 ms lag p50 at one stream)
global
    maxconn 4096
defaults
    mode http
    option http-keep-alive
    option http-no-delay
    http-reuse safe
    timeout connect 5s
    timeout client 120s
    timeout server 120s
    timeout http-keep-alive 60s
frontend bench
    bind {host}:{port}
    default_backend up
backend up
    server up {host}:{up_port}
"""


def peer_command(workdir: Path, name: str, port: int, up_port: int) -> list[str]:
    """The command line of peer ``name`` listening on ``port`` in front of ``up_port``."""
    up = f"http://{HOST}:{up_port}"
    if name == "haproxy":
        cfg = workdir / "haproxy.cfg"
        cfg.write_text(HAPROXY_CFG.format(host=HOST, port=port, up_port=up_port))
        return [haproxy_exe(), "-db", "-f", str(cfg)]
    exe = str(peer_venv(name))
    # both: one worker URL, round robin, their metrics listener on a free loopback port,
    # their default log level (a line per request, as crossbar writes one)
    common = ["--host", HOST, "--port", str(port), "--worker-urls", up, "--policy", "round_robin",
              "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
    return [exe, "launch", *common] if name == "smg" else [exe, *common]


def start_peer(workdir: Path, name: str, up_port: int) -> tuple[subprocess.Popen[Any], int]:
    """Start peer ``name`` and wait until it forwards a chat completion (smg registers
    the upstream in the background after it listens); raises :class:`PeerSkipped`."""
    port = free_port()
    cmd = peer_command(workdir, name, port, up_port)
    log = workdir / f"{name}.log"
    try:
        proc = subprocess.Popen(cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    except OSError as e:
        raise PeerSkipped(f"cannot start {cmd[0]}: {e}") from None
    body = b'{"model":"bench","messages":[{"role":"user","content":"hi"}],"max_tokens":16}'
    deadline = time.monotonic() + 60
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace")).strip().splitlines()[-1:]
            raise PeerSkipped(f"exited with {proc.returncode} before answering ({' '.join(tail)[:200]})")
        try:
            req = urllib.request.Request(f"http://{HOST}:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200 and b"chat.completion" in r.read():
                    return proc, port
        except OSError as e:
            last = str(e)
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise PeerSkipped(f"did not forward a chat completion within 60 s (last: {last[:120]})")


def start_crossbar(workdir: Path, name: str, up_port: int, up2_port: int, workers: int
                   ) -> tuple[subprocess.Popen[Any], int]:
    """One crossbar (``twistd -n``) over ``up`` and ``up2``; ``workers`` > 1 adds the
    ``workers`` key. Returns the process and its port once ready."""
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        cb_port = s.getsockname()[1]
    config = workdir / f"{name}.yaml"
    config.write_text(
        (f"workers: {workers}\n" if workers > 1 else "")
        + f'listen: "tcp:{cb_port}:interface={HOST}:backlog=1024"\n'
        "health: {interval: 5, timeout: 5}\n"
        f"hosts:\n  up: http://{HOST}:{up_port}\n  up2: http://{HOST}:{up2_port}\n"
        "routes:\n  bench:\n    hosts: [up]\n    default_model: bench\n"
        # affinity off: wrk sends one prompt over and over, which would all share one key
        "  bench2:\n    hosts: [up, up2]\n    default_model: bench\n    affinity: {key: none}\n"
        # (g): the same two hosts, affinity on and off
        "  aff:\n    hosts: [up, up2]\n"
        "  noaff:\n    hosts: [up, up2]\n    affinity: {key: none}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    twistd = Path(sys.executable).parent / "twistd"
    # Both columns log as twistd does by default, to a text --logfile: with workers, each
    # worker formats its own lines and the supervisor appends them unread (until issue
    # 33 the supervisor relayed every line, and this column logged JSON to hide it).
    log_args, out = [f"--logfile={workdir / (name + '.log')}"], subprocess.DEVNULL
    cb = subprocess.Popen(
        [str(twistd), "-n", "--pidfile=", *log_args, "crossbar", "--config", str(config)],
        cwd=workdir, env=env, stdout=out, stderr=open(workdir / f"{name}.stderr", "w"),
        preexec_fn=_die_with_parent,
    )
    try:
        wait_http(f"http://{HOST}:{cb_port}/_crossbar/readyz", 30, cb)
    except BaseException:
        cb.kill()
        cb.wait()
        sys.stderr.write((workdir / f"{name}.stderr").read_text()[-3000:])
        raise
    return cb, cb_port


def stop(procs: Procs) -> None:
    proxies = [p for p in (procs.crossbar, procs.workers2) if p is not None and p is not procs.upstream]
    peers = [p for p, _ in procs.peers.values()]
    everything = proxies + peers + [p for p in (procs.upstream, procs.upstream2) if p is not None]
    for p in everything:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM if p in proxies or p in peers else signal.SIGINT)
    for p in everything:
        try:
            p.wait(5 if p in peers else 40)  # smg waits out a drain window: no need here
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# -- measuring -----------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


class CpuMeter:
    """CPU use of each proxy (its whole process tree: a supervisor and its workers) and
    the upstream over a span (1.0 = one core busy)."""

    def __init__(self, procs: Procs) -> None:
        self.pids = {"crossbar": procs.crossbar.pid, "upstream": procs.upstream.pid}
        if procs.workers2 is not None:
            self.pids["workers2"] = procs.workers2.pid
        if procs.upstream2 is not None:
            self.pids["upstream2"] = procs.upstream2.pid
        for name, (proc, _) in procs.peers.items():
            self.pids[name] = proc.pid
        self.t0 = time.monotonic()
        self.c0 = {k: tree_cpu_seconds(p) for k, p in self.pids.items()}

    def read(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        return {k: (tree_cpu_seconds(p) - self.c0[k]) / wall for k, p in self.pids.items()}


def proxy_cpu(cpu: dict[str, float], target: str) -> float:
    """The CPU share of the proxy measured by ``target`` (for "direct": crossbar's, ~0)."""
    return cpu.get(target, 0.0) if target != "direct" else cpu["crossbar"]


class SplitSampler:
    """Counts which worker holds each client connection while running, in a process of
    its own (``bench/worker_split.py``: in this event loop its /proc reads stalled the
    stream client), and keeps the sample with the most connections (the burst when it
    is all connected) in :attr:`best`."""

    def __init__(self, supervisor: int, port: int) -> None:
        self.supervisor, self.port = supervisor, port
        self.best: list[int] = []
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> SplitSampler:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "worker_split.py"), str(self.supervisor), str(self.port),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        await self.proc.stdout.readline()  # its interpreter's start-up is over before the load begins
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.close()  # its signal to print the split (communicate() leaves it open without input)
        out, _ = await self.proc.communicate()
        self.best = json.loads(out or b"[]")

    def busiest_share(self) -> float:
        """The busiest worker's share of the connections, % (100 / workers is even)."""
        return 100 * self.best[0] / sum(self.best) if sum(self.best) else float("nan")


class RssPeak:
    """Samples a process's RSS every 20 ms while running; :attr:`peak` in MiB. With
    ``whole_tree``, the sum over the process and its descendants. With ``pss``, also
    the whole tree's PSS every 100 ms (:attr:`pss_peak`; smaps_rollup costs more)."""

    def __init__(self, pid: int, whole_tree: bool = False, pss: bool = False) -> None:
        self.pid = pid
        self.rss: Callable[[int], float] = (lambda p: sum(rss_mib(q) for q in tree(p))) if whole_tree else rss_mib
        self.peak = self.rss(pid)
        self.pss = pss
        self.pss_peak = tree_pss_mib(pid) if pss else float("nan")
        self.task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        n = 0
        while True:
            self.peak = max(self.peak, self.rss(self.pid))
            n += 1
            if self.pss and n % 5 == 0:
                self.pss_peak = max(self.pss_peak, tree_pss_mib(self.pid))
            await asyncio.sleep(0.02)

    def __enter__(self) -> RssPeak:
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.task is not None
        self.task.cancel()
        self.peak = max(self.peak, self.rss(self.pid))
        if self.pss:
            self.pss_peak = max(self.pss_peak, tree_pss_mib(self.pid))


_WRK_LUA = """wrk.method = "POST"
wrk.body = '{"model":"bench","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'
wrk.headers["Content-Type"] = "application/json"
"""
# (f) the same bytes without an affinity key: the message moves to a field the peek skips
# (empty messages, no prompt, prompt_cache_key or user), so only the key's work differs
_WRK_LUA_KEYLESS = _WRK_LUA.replace(
    '"messages":[{"role":"user","content":"Say hello."}]', '"messages":[],"x":[{"role":"user","content":"Say hello."}]'
)

# (f): (label, route, keyed body?) -- docs/design.md §"Cache affinity" must cost <= 5% of (a)
G_VARIANTS = [
    ("keyed, affinity on", "/aff", True),
    ("keyed, affinity: {key: none}", "/noaff", True),
    ("keyless, affinity on", "/aff", False),
]


# (h): 100 streams of (b)'s shape while a chat request carrying a 15 MiB base64 image
# arrives once a second (the peek must not stall the other streams)
H_STREAMS = 100
H_DELAY_MS = 5.0
H_IMAGE_MIB = 15
H_IMAGE_EVERY_S = 1.0


def image_body(mib: float) -> bytes:
    """A chat completion request (``model: bench``) with a text part and an
    ``image_url`` part whose data URL carries ``mib`` MiB of base64 (of random bytes,
    so nothing downstream can compress it): what a vision client sends."""
    b64 = base64.b64encode(os.urandom(int(mib * 2**20) * 3 // 4)).decode("ascii")
    return json.dumps({
        "model": "bench", "max_tokens": 16,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
        ]}],
    }, separators=(",", ":")).encode()


class ImagePoster:
    """POSTs ``body`` to ``http://host:port{path}`` every ``every`` seconds (absolute
    schedule, the first at once) from its own thread with blocking sockets, so that
    the load client's event loop, which stamps the streams' events, is not the one
    writing 15 MiB (socket calls release the GIL). One request at a time, each on a new
    connection; a request that takes longer than ``every`` delays the next (counted in
    ``late``). ``answers``: (HTTP status or 0 on error, seconds to the full answer)."""

    def __init__(self, host: str, port: int, path: str, body: bytes, every: float) -> None:
        self.host, self.port, self.path, self.body, self.every = host, port, path, body, every
        self.answers: list[tuple[int, float]] = []
        self.late = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="image-poster", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop after the request under way (if any) is answered, and wait for it."""
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        t0 = time.monotonic()
        n = 0
        while not self._stop.is_set():
            started = time.monotonic()
            status = 0
            conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
            try:
                conn.request("POST", self.path, body=self.body, headers={"Content-Type": "application/json"})
                answer = conn.getresponse()
                answer.read()
                status = answer.status
            except (OSError, http.client.HTTPException) as e:
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                conn.close()
            self.answers.append((status, time.monotonic() - started))
            n += 1
            wait = t0 + n * self.every - time.monotonic()
            if wait < 0:
                self.late += 1
            elif self._stop.wait(wait):
                break


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[m.group(2)]


async def wrk(url: str, connections: int, seconds: float, lua: Path) -> dict[str, float]:
    """Run wrk (one thread, keep-alive) and return requests/s, p50/p99 latency (ms),
    non-2xx count, and wrk's own CPU use."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = await asyncio.create_subprocess_exec(
        "wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-s", str(lua), url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out = (await proc.communicate())[0].decode()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)\s*$", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)\s*$", out, re.M)  # "1.04s " ends in a space
    if not (rps and p50 and p99):
        raise SystemExit(f"bench: cannot read wrk output:\n{out}")
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / seconds
    return {"rps": float(rps.group(1)), "p50": _ms(p50.group(1)), "p99": _ms(p99.group(1)),
            "bad": float(bad.group(1)) if bad else 0.0, "client_cpu": cpu}


# -- scenarios -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    rounds: int
    wrk_seconds: float
    e_events: int
    d_seconds: float


QUICK = Settings(rounds=1, wrk_seconds=2, e_events=40, d_seconds=5)
FULL = Settings(rounds=3, wrk_seconds=5, e_events=100, d_seconds=20)

Results = dict[tuple[str, str, str], list[float]]  # (row group, metric, target) -> per round


class Bench:
    def __init__(self, procs: Procs, settings: Settings, lua: Path, keyless_lua: Path | None = None) -> None:
        self.procs = procs
        self.s = settings
        self.lua = lua
        self.keyless_lua = keyless_lua
        self.r: Results = defaultdict(list)
        self.notes: list[str] = []
        self.splits: dict[str, list[list[int]]] = defaultdict(list)

    def target(self, name: str) -> tuple[int, str]:
        """(port, path prefix): crossbar's routes are a prefix, the rest get bare paths."""
        if name == "direct":
            return self.procs.up_port, ""
        return self.procs.proxy(name)[1], (ROUTE if name in PROXIES else "")

    def put(self, group: str, metric: str, target: str, value: float) -> None:
        self.r[(group, metric, target)].append(value)

    def splitter(self, target: str) -> SplitSampler | contextlib.nullcontext[None]:
        """Counts each worker's client connections during a step through ``workers2``."""
        if target == "workers2" and self.procs.workers2 is not None:
            return SplitSampler(self.procs.workers2.pid, self.procs.w2_port)
        return contextlib.nullcontext()

    def put_split(self, g: str, split: SplitSampler | None) -> None:
        if split is not None:
            self.put(g, "busiest_worker", "workers2", split.busiest_share())
            self.splits[g].append(split.best)

    async def scenario_a(self, target: str, c: int) -> None:
        port, prefix = self.target(target)
        meter = CpuMeter(self.procs)
        async with self.splitter(target) as split:
            out = await wrk(f"http://{HOST}:{port}{prefix}/v1/chat/completions", c, self.s.wrk_seconds, self.lua)
        cpu = meter.read()
        g = f"a c={c}"
        self.put_split(g, split)
        for k in ("rps", "p50", "p99", "client_cpu"):
            self.put(g, k, target, out[k])
        self.put(g, "crossbar_cpu", target, proxy_cpu(cpu, target))
        self.put(g, "upstream_cpu", target, cpu["upstream"])
        if target != "direct":
            self.put(g, "cpu_us", target, 1e6 * proxy_cpu(cpu, target) / out["rps"])
        if out["bad"]:
            self.notes.append(f"(a) c={c} {target}: {out['bad']:g} non-2xx answers")

    def requests_by_host(self, route: str, target: str = "crossbar") -> dict[str, float]:
        """host -> requests crossbar (``target``) answered on ``route`` so far (its own
        metrics: with workers, every worker's summed)."""
        url = f"http://{HOST}:{self.target(target)[0]}/_crossbar/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        counts: dict[str, float] = defaultdict(float)
        pattern = r'^crossbar_requests_total\{(?=[^}]*route="%s")(?=[^}]*host="([^"]+)")[^}]*\} (\S+)$' % route
        for host, value in re.findall(pattern, text, re.M):
            counts[host] += float(value)
        return counts

    async def scenario_f(self, c: int = 16, t: str = "crossbar") -> None:
        """(f): wrk at ``c`` on route ``bench2`` of crossbar ``t`` (one worker or
        ``workers2``), over two upstreams: the split between them (from crossbar's
        request counter) and crossbar's CPU per request, beside (a)'s one-host figure
        of the same round."""
        before = self.requests_by_host(ROUTE2.strip("/"), t)
        meter = CpuMeter(self.procs)
        out = await wrk(f"http://{HOST}:{self.target(t)[0]}{ROUTE2}/v1/chat/completions", c,
                        self.s.wrk_seconds, self.lua)
        cpu = meter.read()
        after = self.requests_by_host(ROUTE2.strip("/"), t)
        done = {h: after.get(h, 0.0) - before.get(h, 0.0) for h in ("up", "up2")}
        total = sum(done.values())
        g = f"f c={c}"
        self.put(g, "rps", t, out["rps"])
        self.put(g, "p99", t, out["p99"])
        self.put(g, "cpu_us", t, 1e6 * cpu[t] / out["rps"])
        self.put(g, "share_up", t, 100 * done["up"] / total if total else float("nan"))
        self.put(g, "crossbar_cpu", t, cpu[t])
        self.put(g, "upstream_cpu", t, cpu["upstream"] + cpu.get("upstream2", 0.0))
        self.put(g, "client_cpu", t, out["client_cpu"])
        one = self.r.get((f"a c={c}", "cpu_us", t))
        if one:  # this round's one-host figure (the step just before)
            self.put(g, "cpu_vs_one", t, self.r[(g, "cpu_us", t)][-1] / one[-1])
        if out["bad"]:
            self.notes.append(f"(f) {t} c={c}: {out['bad']:g} non-2xx answers")

    async def scenario_g(self, label: str, route: str, keyed: bool, t: str = "crossbar") -> None:
        """(a) at c=16 through a two-host route of crossbar ``t``, with or without
        affinity, keyed or keyless bodies: crossbar's CPU us/request."""
        lua = self.lua if keyed or self.keyless_lua is None else self.keyless_lua
        meter = CpuMeter(self.procs)
        out = await wrk(f"http://{HOST}:{self.target(t)[0]}{route}/v1/chat/completions", 16, self.s.wrk_seconds, lua)
        cpu = meter.read()
        g = f"g {label}"
        self.put(g, "rps", t, out["rps"])
        self.put(g, "cpu_us", t, 1e6 * cpu[t] / out["rps"])
        if out["bad"]:
            self.notes.append(f"(g) {label}: {out['bad']:g} non-2xx answers")

    async def streams(self, target: str, n: int, events: int, delay_ms: float, timeout: float) -> StreamsResult:
        port, prefix = self.target(target)
        return await run_streams(HOST, port, prefix, n, events, delay_ms, timeout)

    def put_streams(self, g: str, target: str, res: StreamsResult, cpu: dict[str, float]) -> None:
        lags = res.lags_ms
        self.put(g, "completed", target, res.completed)
        self.put(g, "ttfe", target, statistics.median(res.ttfe_ms) if res.ttfe_ms else float("nan"))
        self.put(g, "lag_p50", target, pct(lags, 50))
        self.put(g, "lag_p99", target, pct(lags, 99))
        self.put(g, "coalesced", target, 100 * res.coalesced_share)
        self.put(g, "client_cpu", target, res.client_cpu)
        self.put(g, "crossbar_cpu", target, proxy_cpu(cpu, target))
        self.put(g, "upstream_cpu", target, cpu["upstream"])
        events = sum(s.events for s in res.streams)
        if target != "direct" and events:
            self.put(g, "cpu_us", target, 1e6 * proxy_cpu(cpu, target) * res.wall_s / events)
        errors = [s.error for s in res.streams if not s.done]
        if errors:
            self.notes.append(f"{g} {target}: {len(errors)} streams failed, e.g. {errors[0]}")

    async def scenario_b(self, target: str, n: int) -> None:
        meter = CpuMeter(self.procs)
        async with self.splitter(target) as split:
            res = await self.streams(target, n, 200, 5, 30)
        self.put_streams(f"b {n} streams", target, res, meter.read())
        self.put_split(f"b {n} streams", split)

    async def scenario_c(self, target: str = "crossbar") -> None:
        """(c) 200 streams through ``target``: the peak RSS of its whole process tree
        (crossbar alone: its one process)."""
        proc, _ = self.procs.proxy(target)
        with RssPeak(proc.pid, whole_tree=True, pss=True) as peak:
            res = await self.streams(target, 200, 200, 5, 30)
        self.put("c", "rss_200", target, peak.peak)
        self.put("c", "pss_200", target, peak.pss_peak)
        if res.completed != 200:
            self.notes.append(f"(c) {target}: only {res.completed}/200 streams completed")

    async def scenario_d(self, target: str = "crossbar") -> None:
        """(d) through one proxy target: a 50 MiB SSE answer (16 KiB events, the
        upstream as fast as the connection takes them) read slowly; the RSS is the
        whole tree's (with workers the one connection lands on one worker, so that is
        that worker's growth)."""
        proc, port = self.procs.proxy(target)
        _, prefix = self.target(target)
        body = (b'{"model":"bench","stream":true,"bench_bytes":%d,'
                b'"messages":[{"role":"user","content":"hi"}]}' % (50 * 1024 * 1024))
        await asyncio.sleep(0.5)
        with RssPeak(proc.pid, whole_tree=True) as peak:
            base = peak.peak
            got = await slow_read(HOST, port, f"{prefix}/v1/chat/completions",
                                  16 * 1024, 0.05, self.s.d_seconds, body)
        self.put("d", "rss_growth", target, peak.peak - base)
        self.put("d", "read_mib", target, got / 2**20)

    async def scenario_e(self, target: str) -> None:
        meter = CpuMeter(self.procs)
        res = await self.streams(target, 1000, self.s.e_events, 50, 60 + self.s.e_events * 0.05)
        self.put_streams("e 1000 streams", target, res, meter.read())

    async def scenario_h(self, target: str, images: bool) -> None:
        """(h): :data:`H_STREAMS` streams of (b)'s shape for ``2 * wrk_seconds`` (at least
        5 s), with (``images``) or without a chat request carrying an
        :data:`H_IMAGE_MIB` MiB base64 image POSTed to the same ``target`` every
        :data:`H_IMAGE_EVERY_S` s meanwhile (the upstream reads and drops the body and
        answers a small completion). Lag as in (b); with images also how many were
        answered 200 and their median time to the full answer."""
        body: bytes | None = getattr(self, "_h_body", None)
        if body is None:
            body = self._h_body = image_body(H_IMAGE_MIB)
        seconds = max(5.0, 2 * self.s.wrk_seconds)
        events = int(seconds * 1000 / H_DELAY_MS)
        port, prefix = self.target(target)
        poster = ImagePoster(HOST, port, f"{prefix}/v1/chat/completions", body, H_IMAGE_EVERY_S) if images else None
        meter = CpuMeter(self.procs)
        streams = asyncio.ensure_future(self.streams(target, H_STREAMS, events, H_DELAY_MS, 30 + seconds))
        if poster is not None:
            await asyncio.sleep(0.2)  # every stream is running before the first image
            poster.start()
        try:
            res = await streams
        finally:
            if poster is not None:
                await asyncio.get_running_loop().run_in_executor(None, poster.stop)
        g = f"h {'images' if images else 'plain'}"
        self.put_streams(g, target, res, meter.read())
        if poster is not None:
            ok = [s for code, s in poster.answers if code == 200]
            self.put(g, "images_ok", target, len(ok))
            self.put(g, "image_s", target, statistics.median(ok) if ok else float("nan"))
            bad = len(poster.answers) - len(ok)
            if bad or poster.late:
                self.notes.append(f"(h) {target}: {bad} image requests failed, {poster.late} late"
                                  + (f", e.g. {poster.errors[0]}" if poster.errors else ""))

    async def ceilings(self) -> None:
        """The load generators' and upstream's own ceilings, direct to the upstream."""
        out = await wrk(f"http://{HOST}:{self.procs.up_port}/v1/chat/completions", 64, 2, self.lua)
        self.put("ceiling", "wrk_rps", "direct", out["rps"])
        self.put("ceiling", "wrk_cpu", "direct", out["client_cpu"])
        meter = CpuMeter(self.procs)
        res = await self.streams("direct", 100, 1000, 0, 30)
        wall = res.wall_s
        self.put("ceiling", "events_per_s", "direct", sum(s.events for s in res.streams) / wall)
        self.put("ceiling", "stream_client_cpu", "direct", res.client_cpu)
        self.put("ceiling", "stream_upstream_cpu", "direct", meter.read()["upstream"])

    async def run(self, only: set[str]) -> None:
        pid = self.procs.crossbar.pid
        proxies = self.procs.targets()[1:]
        await asyncio.sleep(1)
        self.put("c", "rss_idle", "crossbar", rss_mib(pid))
        if self.procs.workers2 is not None:
            sup, worker = tree_rss_mib(self.procs.workers2.pid)
            self.put("c", "rss_idle", "workers2", worker)
            self.put("c", "rss_supervisor", "workers2", sup)
        for t in proxies:
            self.put("c", "rss_idle_tree", t, sum(rss_mib(q) for q in tree(self.procs.proxy(t)[0].pid)))
            self.put("c", "pss_idle_tree", t, tree_pss_mib(self.procs.proxy(t)[0].pid))
        if "c" in only:
            # Before any other load through crossbar: Python keeps the heap it grew, so
            # after (e)'s 1000 streams this would measure (e), not 200 streams.
            for t in proxies:
                print(f"c {t}", file=sys.stderr)
                await self.scenario_c(t)
        await self.ceilings()
        for rnd in range(self.s.rounds):
            order = self.procs.targets() if rnd % 2 == 0 else self.procs.targets()[::-1]
            print(f"round {rnd + 1}/{self.s.rounds} ({' then '.join(order)} in each step)", file=sys.stderr)
            steps: list[tuple[str, Callable[[str], Awaitable[None]]]] = []
            if "a" in only:
                for c in (1, 16, 64):
                    steps.append((f"a c={c}", lambda t, c=c: self.scenario_a(t, c)))
            if "f" in only:
                if "a" not in only:  # the one-host figure to compare with
                    steps.append(("a c=16", lambda t: self.scenario_a(t, 16)))
                steps.append(("f c=16", lambda t: self.scenario_f(16, t)))
            if "b" in only:
                for n in (1, 100):
                    steps.append((f"b {n}", lambda t, n=n: self.scenario_b(t, n)))
            if "e" in only:
                steps.append(("e", self.scenario_e))
            for name, step in steps:
                for t in order:
                    if name.startswith("f ") and t not in PROXIES:
                        continue  # two hosts behind one address: only through crossbar
                    if t in PEERS and name[0] not in PEER_SCENARIOS:
                        continue
                    print(f"  {name} {t}", file=sys.stderr)
                    await step(t)
                    await asyncio.sleep(0.3)
            if "g" in only:
                variants = G_VARIANTS if rnd % 2 == 0 else G_VARIANTS[::-1]
                for t in (t for t in order if t in PROXIES):
                    for label, route, keyed in variants:
                        print(f"  g {label} {t}", file=sys.stderr)
                        await self.scenario_g(label, route, keyed, t)
                        await asyncio.sleep(0.3)
            if "h" in only:
                for t in (t for t in order if t not in PEERS):
                    for images in ((False, True) if rnd % 2 == 0 else (True, False)):
                        print(f"  h {'images' if images else 'plain'} {t}", file=sys.stderr)
                        await self.scenario_h(t, images)
                        await asyncio.sleep(0.3)
                    with_, without = (self.r[(f"h {v}", "lag_p99", t)][-1] for v in ("images", "plain"))
                    self.put("h", "lag_p99_added", t, with_ - without)
        for t in (t for t in proxies if t in PROXIES):
            self.put("c", "rss_end", t, sum(rss_mib(q) for q in tree(self.procs.proxy(t)[0].pid)))
            self.put("c", "pss_end", t, tree_pss_mib(self.procs.proxy(t)[0].pid))
        if "d" in only:
            for t in self.procs.targets()[1:]:
                print(f"d {t}", file=sys.stderr)
                await self.scenario_d(t)


# -- the table -------------------------------------------------------------------------------


def fmt(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


ROWS: list[tuple[str, str, str, int, str, Callable[[float, float], bool] | None]] = [
    # group, metric, label, digits, target text, check(direct median, crossbar median)
    ("a c=1", "rps", "(a) c=1 requests/s", 0, "", None),
    ("a c=1", "p50", "(a) c=1 latency p50 ms", 2, "", None),
    ("a c=1", "p99", "(a) c=1 latency p99 ms", 2, "", None),
    ("a c=16", "rps", "(a) c=16 requests/s", 0, ">= 3000", lambda d, c: c >= 3000),
    ("a c=16", "p50", "(a) c=16 latency p50 ms", 2, "", None),
    ("a c=16", "cpu_us", "(a) c=16 proxy CPU us/request", 0, "", None),
    ("a c=16", "p99", "(a) c=16 latency p99 ms", 2, "", None),
    ("f c=16", "rps", "(f) 2 hosts c=16 requests/s", 0, "", None),
    ("f c=16", "p99", "(f) 2 hosts c=16 latency p99 ms", 2, "", None),
    ("f c=16", "cpu_us", "(f) 2 hosts c=16 crossbar CPU us/req", 0, "", None),
    ("f c=16", "cpu_vs_one", "(f) CPU/req 2 hosts / 1 host (a)", 3, "<= 1.05", lambda d, c: c <= 1.05),
    ("f c=16", "share_up", "(f) 2 hosts share of host up %", 1, "50 +- 5", lambda d, c: abs(c - 50) <= 5),
    ("a c=64", "rps", "(a) c=64 requests/s", 0, "", None),
    ("a c=64", "p50", "(a) c=64 latency p50 ms", 2, "", None),
    ("a c=64", "p99", "(a) c=64 latency p99 ms", 2, "", None),
    ("b 1 streams", "ttfe", "(b) 1 stream first event ms", 2, "", None),
    ("b 1 streams", "lag_p50", "(b) 1 stream lag p50 ms", 2, "", None),
    ("b 1 streams", "lag_p99", "(b) 1 stream lag p99 ms", 2, "", None),
    ("b 1 streams", "coalesced", "(b) 1 stream coalesced %", 1, "", None),
    ("b 100 streams", "ttfe", "(b) 100 streams first event ms", 2, "added <= 5", lambda d, c: c - d <= 5),
    ("b 100 streams", "lag_p50", "(b) 100 streams lag p50 ms", 2, "", None),
    ("b 100 streams", "lag_p99", "(b) 100 streams lag p99 ms", 2, "<= 5", lambda d, c: c <= 5),
    ("b 100 streams", "coalesced", "(b) 100 streams coalesced %", 1, "<= direct", lambda d, c: c <= d + 0.5),
    ("b 100 streams", "cpu_us", "(b) 100 streams proxy CPU us/event", 1, "", None),
    ("b 100 streams", "completed", "(b) 100 streams completed", 0, "", None),
    ("a c=16", "busiest_worker", "(a) c=16 busiest worker's conns %", 1, "", None),
    ("b 100 streams", "busiest_worker", "(b) 100 streams busiest worker's %", 1, "", None),
    ("h plain", "lag_p99", "(h) 100 streams lag p99 ms, no images", 2, "", None),
    ("h images", "lag_p99", "(h) 100 streams lag p99 ms, images", 2, "", None),
    ("h", "lag_p99_added", "(h) lag p99 added by images ms", 2, "<= 5", lambda d, c: c <= 5),
    ("h plain", "lag_p50", "(h) 100 streams lag p50 ms, no images", 2, "", None),
    ("h images", "lag_p50", "(h) 100 streams lag p50 ms, images", 2, "", None),
    ("h images", "images_ok", "(h) 15 MiB image requests answered 200", 0, "", None),
    ("h images", "image_s", "(h) image request to full answer s", 3, "", None),
    ("h plain", "crossbar_cpu", "(h) crossbar CPU share, no images", 2, "", None),
    ("h images", "crossbar_cpu", "(h) crossbar CPU share, images", 2, "", None),
    ("c", "rss_idle", "(c) RSS idle MiB (one worker)", 1, "<= 45", lambda d, c: c <= 45),
    ("c", "rss_supervisor", "(c) RSS idle MiB, supervisor", 1, "", None),
    ("c", "rss_idle_tree", "(c) RSS idle MiB, whole tree", 1, "", None),
    ("c", "pss_idle_tree", "(c) PSS idle MiB, whole tree", 1, "", None),
    ("c", "rss_200", "(c) RSS 200 streams MiB, whole tree", 1, "<= 60", lambda d, c: c <= 60),
    ("c", "pss_200", "(c) PSS 200 streams MiB, whole tree", 1, "", None),
    ("c", "rss_end", "(c) RSS after all MiB, whole tree", 1, "", None),
    ("c", "pss_end", "(c) PSS after all MiB, whole tree", 1, "", None),
    ("d", "rss_growth", "(d) slow client RSS growth MiB, tree", 1, "<= 5", lambda d, c: c <= 5),
    ("d", "read_mib", "(d) slow client read MiB", 1, "", None),
    ("e 1000 streams", "completed", "(e) 1000 streams completed", 0, "= 1000", lambda d, c: c >= 1000),
    ("e 1000 streams", "ttfe", "(e) 1000 streams first event ms", 1, "", None),
    ("e 1000 streams", "lag_p50", "(e) 1000 streams lag p50 ms", 2, "", None),
    ("e 1000 streams", "lag_p99", "(e) 1000 streams lag p99 ms", 2, "<= 50", lambda d, c: c <= 50),
    ("e 1000 streams", "coalesced", "(e) 1000 streams coalesced %", 1, "", None),
]

CPU_GROUPS = ["a c=1", "a c=16", "f c=16", "a c=64", "b 1 streams", "b 100 streams", "e 1000 streams"]


def table(r: Results, targets: tuple[str, ...]) -> str:
    """The figures side by side: one column per target; ``x/direct`` per proxy column;
    ``ok`` per proxy column (targets are for one worker or for ``workers: 2`` as the
    issue says: read the row's own column)."""
    proxies = [t for t in targets if t != "direct"]
    names = dict(NAMES)
    short = {"crossbar": "1w", "workers2": "2w", "haproxy": "hap", "vllm-router": "vllm", "smg": "smg"}
    width = 24 if len(targets) <= 3 else 21
    head = (f"{'figure':36} " + " ".join(f"{names[t]:>{width}}" for t in targets)
            + " " + " ".join(f"{'x/d ' + short[t]:>8}" for t in proxies) + f"  {'target':10} ok")
    lines = [head, "-" * len(head)]
    for group, metric, label, digits, target, check in ROWS:
        vals = {t: r.get((group, metric, t), []) for t in targets}
        if not any(vals.values()):
            continue
        med = {t: statistics.median(v) if v else float("nan") for t, v in vals.items()}
        d = vals["direct"]
        ratios = [f"{med[t] / med['direct']:.2f}" if d and vals[t] and med["direct"] else "" for t in proxies]
        verdicts = []
        if check is not None:  # crossbar's targets: its own columns only
            verdicts = [("yes" if check(med["direct"], med[t]) else "NO") if vals[t] else "-"
                        for t in proxies if t in PROXIES]
        lines.append(f"{label:36} " + " ".join(f"{fmt(vals[t], digits):>{width}}" for t in targets) + " "
                     + " ".join(f"{x:>8}" for x in ratios) + f"  {target:10} {'/'.join(verdicts)}")
    lines.append("")
    lines.append("CPU use, median share of one core (proxy / upstream / load client); a proxy with")
    lines.append("workers counts its whole process tree (supervisor + workers), so it can exceed 1.0:")
    for g in CPU_GROUPS:
        parts = []
        for t in targets:
            vs = [r.get((g, k, t), []) for k in ("crossbar_cpu", "upstream_cpu", "client_cpu")]
            if all(vs):
                parts.append(f"{names[t]}: " + " / ".join(f"{statistics.median(v):.2f}" for v in vs))
        if parts:
            lines.append(f"  {g:16} " + "   ".join(parts))
    lines += affinity_table(r)
    lines += workers_table(r, targets)
    lines += peers_table(r, targets)
    return "\n".join(lines)


def workers_table(r: Results, targets: tuple[str, ...]) -> list[str]:
    """Issue 33's ratios: ``workers: N`` over one worker, medians of this run (targets:
    requests/s >= 1.5x, CPU per request <= 1.15x, idle PSS <= 1.6x)."""
    if "workers2" not in targets:
        return []
    rows = [("(a) c=16 requests/s", "a c=16", "rps", ">= 1.5", lambda x: x >= 1.5),
            ("(a) c=16 CPU us/request", "a c=16", "cpu_us", "<= 1.15", lambda x: x <= 1.15),
            ("(a) c=64 requests/s", "a c=64", "rps", "", None),
            ("(b) 100 streams CPU us/event", "b 100 streams", "cpu_us", "", None),
            ("(f) 2 hosts c=16 CPU us/request", "f c=16", "cpu_us", "", None),
            ("(c) PSS idle, whole tree", "c", "pss_idle_tree", "<= 1.6", lambda x: x <= 1.6),
            ("(c) RSS idle, whole tree", "c", "rss_idle_tree", "", None),
            ("(c) PSS 200 streams, whole tree", "c", "pss_200", "", None)]
    lines = ["", "workers: 2 / one worker (medians of this run)"]
    for label, group, metric, target, check in rows:
        one, two = r.get((group, metric, "crossbar")), r.get((group, metric, "workers2"))
        if not one or not two or not statistics.median(one):
            continue
        ratio = statistics.median(two) / statistics.median(one)
        verdict = "" if check is None else ("yes" if check(ratio) else "NO")
        lines.append(f"  {label:36} {ratio:6.2f}x  {target:8} {verdict}")
    return lines


NAMES = {"direct": "direct", "crossbar": "1 worker", "workers2": "workers: 2", "haproxy": "HAProxy",
         "vllm-router": "vllm-router", "smg": "smg"}


def peers_table(r: Results, targets: tuple[str, ...]) -> list[str]:
    """The proxies side by side as a Markdown table: medians only, the peers first, then
    crossbar (one worker, ``workers: N``); empty without peers."""
    cols = [t for t in PEERS + PROXIES if t in targets]
    if not any(t in PEERS for t in cols):
        return []

    def med(group: str, metric: str, t: str) -> float | None:
        v = r.get((group, metric, t))
        return statistics.median(v) if v else None

    def num(x: float | None, digits: int) -> str:
        return "-" if x is None else f"{x:,.{digits}f}"

    def added(t: str) -> str:
        c, d = med("b 100 streams", "ttfe", t), med("b 100 streams", "ttfe", "direct")
        return "-" if c is None or d is None else f"{c - d:.1f}"

    rows: list[tuple[str, Callable[[str], str]]] = [
        ("CPU µs per small request, c=16", lambda t: num(med("a c=16", "cpu_us", t), 1)),
        ("requests/s, c=16", lambda t: num(med("a c=16", "rps", t), 0)),
        ("CPU µs per event, 100 streams", lambda t: num(med("b 100 streams", "cpu_us", t), 1)),
        ("100 streams at once: added time to first event, ms", added),
        ("100 streams: lag p99, ms", lambda t: num(med("b 100 streams", "lag_p99", t), 1)),
        ("RSS idle / 200 streams, MiB (whole tree)",
         lambda t: f"{num(med('c', 'rss_idle_tree', t), 0)} / {num(med('c', 'rss_200', t), 0)}"),
        ("PSS idle / 200 streams, MiB (whole tree)",
         lambda t: f"{num(med('c', 'pss_idle_tree', t), 0)} / {num(med('c', 'pss_200', t), 0)}"),
        ("slow client, RSS growth MiB", lambda t: num(med("d", "rss_growth", t), 1)),
    ]
    lines = ["", "issue 23: the proxies side by side (medians; direct: "
             f"{num(med('a c=16', 'rps', 'direct'), 0)} req/s at c=16, first event at 100 streams "
             f"{num(med('b 100 streams', 'ttfe', 'direct'), 1)} ms)",
             "| figure | " + " | ".join(NAMES[t] for t in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for label, cell in rows:
        lines.append(f"| {label} | " + " | ".join(cell(t) for t in cols) + " |")
    return lines


def affinity_table(r: Results) -> list[str]:
    """(g): crossbar CPU us/request at c=16 per variant and what affinity adds (target:
    at most +5% over keyless bodies)."""
    lines: list[str] = []
    for t in PROXIES:
        cpu = {label: r.get((f"g {label}", "cpu_us", t), []) for label, _, _ in G_VARIANTS}
        if not all(cpu.values()):
            continue
        lines += ["", f"(g) cache affinity, c=16 over two hosts ({NAMES[t]}): crossbar CPU us/request, requests/s"]
        for label, _, _ in G_VARIANTS:
            lines.append(f"  {label:30} {fmt(cpu[label], 0):>20} us   {fmt(r[(f'g {label}', 'rps', t)], 0):>20} req/s")
        keyed, off, keyless = (statistics.median(cpu[label]) for label, _, _ in G_VARIANTS)
        added = 100 * (keyed / keyless - 1)
        lines.append(f"  affinity adds {added:+.1f}% CPU/request over keyless bodies (target <= +5%: "
                     f"{'yes' if added <= 5 else 'NO'}); rank+pick alone {100 * (keyed / off - 1):+.1f}% over key: none")
    return lines


def machine() -> str:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - informative only
            return "?"

    import twisted

    wrk_version = sh("wrk -v 2>&1 | head -1 | cut -d' ' -f2")
    model = sh("lscpu | sed -n 's/^Model name:[ \\t]*//p' | head -1")
    mem = sh("free -h | awk '/^Mem:/{print $2}'")
    return (f"machine: nproc={os.cpu_count()} cpu={model!r} mem={mem} python={platform.python_version()} "
            f"twisted={twisted.__version__} wrk={wrk_version}")


def loadavg() -> str:
    return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3])


async def amain(args: argparse.Namespace) -> int:
    settings = QUICK if args.quick else FULL
    if args.rounds:
        settings = Settings(args.rounds, settings.wrk_seconds, settings.e_events, settings.d_seconds)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    if shutil.which("wrk") is None:
        print("bench: wrk not found (apt-get install wrk)", file=sys.stderr)
        return 2
    only = set(args.only) if args.only else {"a", "b", "c", "d", "e", "f", "g", "h"}
    t0 = time.monotonic()
    started_load = loadavg()
    with tempfile.TemporaryDirectory(prefix="crossbar-bench-") as tmp:
        workdir = Path(tmp)
        lua = workdir / "post.lua"
        lua.write_text(_WRK_LUA)
        keyless_lua = workdir / "post-keyless.lua"
        keyless_lua.write_text(_WRK_LUA_KEYLESS)
        peers = (not args.quick) if args.peers is None else args.peers
        notes: list[str] = []
        procs = start(workdir, 0 if args.profile else args.workers, peers and not args.profile, notes)
        try:
            bench = Bench(procs, settings, lua, keyless_lua)
            bench.notes += notes
            if args.profile:
                await profile(bench, Path(args.profile))
                return 0
            await bench.run(only)
        finally:
            stop(procs)
            if args.keep_log:
                shutil.copy(workdir / "crossbar.log", args.keep_log)
                if procs.workers2 is not None:
                    shutil.copy(workdir / "workers2.log", args.keep_log + ".workers2")
    r = bench.r
    print()
    print(machine())
    print(f"mode: {'quick' if args.quick else 'full'}, {settings.rounds} round(s); {started_load} at start, "
          f"{loadavg()} at end; {time.monotonic() - t0:.0f}s")
    c = r[("ceiling", "wrk_rps", "direct")]
    print(f"ceilings (direct to the upstream): wrk+upstream {statistics.median(c):.0f} req/s at c=64 "
          f"(wrk CPU {statistics.median(r[('ceiling', 'wrk_cpu', 'direct')]):.2f}); stream client+upstream "
          f"{statistics.median(r[('ceiling', 'events_per_s', 'direct')]):.0f} events/s at 100 streams, no delay "
          f"(client CPU {statistics.median(r[('ceiling', 'stream_client_cpu', 'direct')]):.2f}, upstream CPU "
          f"{statistics.median(r[('ceiling', 'stream_upstream_cpu', 'direct')]):.2f})")
    print("values: median [min-max] over rounds; x/d = that column's median / direct median")
    print()
    print(table(r, procs.targets()))
    for g, samples in bench.splits.items():
        if g in ("a c=16", "b 100 streams"):
            print(f"split over the workers of workers: {args.workers}, {g}: client connections per worker "
                  f"(busiest first; the sample with most connections, per round): "
                  + ", ".join("/".join(map(str, s)) for s in samples))
    for note in bench.notes:
        print("note:", note)
    if args.json:
        Path(args.json).write_text(json.dumps({"|".join(k): v for k, v in r.items()}, indent=1))
    return 0


# -- profiling ---------------------------------------------------------------------------------


async def profile(bench: Bench, outdir: Path) -> None:
    """py-spy on crossbar under (a) c=16 and under (b) 100 streams; summaries to ``outdir``."""
    outdir.mkdir(parents=True, exist_ok=True)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    pid = bench.procs.crossbar.pid
    seconds = 10

    async def under(name: str, load: Callable[[], Awaitable[None]]) -> None:
        raw = outdir / f"{name}.raw.txt"
        spy = await asyncio.create_subprocess_exec(
            pyspy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--nolineno",
            "--nonblocking", "--duration", str(seconds), "-o", str(raw),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await load()
        err = (await spy.communicate())[1].decode()
        if spy.returncode != 0:
            raise SystemExit(f"bench: py-spy failed: {err}")
        summary = summarize(raw.read_text())
        (outdir / f"{name}.txt").write_text(summary)
        print(f"== {name}\n{summary}")

    await under("profile-a-c16", lambda: bench.scenario_a("crossbar", 16))
    await under("profile-b-100", lambda: bench.scenario_b("crossbar", 100))


SUSPECTS = [
    ("form-body parsing of every POST (twisted.web.http)", "_parseContentType"),
    ("request body producer (FileBodyProducer + Cooperator)", "_writeToBodyProducerContentLength"),
    ("Agent per request (UpstreamPools.agent)", "UpstreamPools.agent"),
    ("HostnameEndpoint built per request", "HostnameEndpoint.__init__"),
    ("Agent.request (URI parsing, pool, request write)", "Agent.request"),
    ("one log line per request (Logger.emit and observers)", "Logger.emit"),
    ("idle timer reset per body chunk", "DelayedCall.reset"),
    ("prometheus metrics", "prometheus_client/"),
    ("upstream header copy (upstream_headers)", "upstream_headers"),
    ("chunked decoding of the upstream body", "_ChunkedTransferDecoder.dataReceived"),
    ("socket send() (Connection.writeSomeData)", "Connection.writeSomeData"),
    ("socket reads and all they trigger (Connection.doRead)", "Connection.doRead"),
    ("all crossbar code, inclusive", "crossbar/"),
]


def summarize(raw: str, top: int = 30) -> str:
    """Self and inclusive shares per function from py-spy's collapsed stacks."""
    self_n: dict[str, int] = defaultdict(int)
    incl_n: dict[str, int] = defaultdict(int)
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        self_n[frames[-1]] += n
        for f in set(frames):
            incl_n[f] += n
    out = [f"samples: {total}", "", "named suspects, inclusive (% of samples):"]
    for name, frame in SUSPECTS:
        n = sum(int(c) for st, _, c in (l.rpartition(" ") for l in raw.splitlines()) if st and frame in st)
        out.append(f"{100 * n / total:6.1f}  {name} [{frame}]")
    out += ["", f"top {top} by self time (% of samples):"]
    out += [f"{100 * n / total:6.1f}  {f}" for f, n in sorted(self_n.items(), key=lambda x: -x[1])[:top]]
    out += ["", f"top {top} by inclusive time (% of samples):"]
    out += [f"{100 * n / total:6.1f}  {f}" for f, n in sorted(incl_n.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description="crossbar against a direct upstream, side by side")
    p.add_argument("--quick", action="store_true", help="one short round (development)")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default: 3 full, 1 quick)")
    p.add_argument("--only", nargs="*", choices=["a", "b", "c", "d", "e", "f", "g", "h"], help="run only these scenarios")
    p.add_argument("--workers", type=int, default=2,
                   help="workers of the second crossbar column (default 2; 0 or 1: no such column)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=None,
                   help="also HAProxy, vllm-router and smg in front of the same upstream, (a)-(d) "
                        "(default: on in full runs, off with --quick)")
    p.add_argument("--profile", metavar="DIR", help="profile crossbar with py-spy under (a) and (b) instead")
    p.add_argument("--json", metavar="PATH", help="also write every per-round value as JSON")
    p.add_argument("--keep-log", metavar="PATH", help="copy crossbar's log here")
    args = p.parse_args()
    try:
        import uvloop

        return uvloop.run(amain(args))
    except ImportError:
        return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
