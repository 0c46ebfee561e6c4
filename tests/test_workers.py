"""``workers: N`` (docs/design.md §Workers), with a real ``twistd`` supervisor and its real
worker processes in front of loopback fake hosts.

Requests are sent on fresh connections (no keep-alive) so the kernel spreads them over
the workers; which worker served what is read from the supervisor's JSON log, where
every relayed line carries ``worker``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import struct
import tempfile
from collections import Counter
from dataclasses import replace
from typing import Any

import treq
from openai import OpenAI
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.internet.interfaces import IReadDescriptor
from twisted.internet.error import ProcessTerminated
from twisted.internet.task import deferLater
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.server import NOT_DONE_YET, Request
from treq.client import HTTPClient
from zope.interface import implementer

from crossbar.config import MAX_WORKERS, ConfigError, load_config, parse_config, usable_cpus
from crossbar.process.supervisor import STALL, STARTUP, Supervisor, WorkerTimings
from crossbar.process.workerlog import relay_log_line
from crossbar.process.heartbeat import HEARTBEAT
from tests.harness import FakeLlama, listen, port_of, wait_for
from tests.process import START, ClientStream, Twistd, start_twistd

JSONLOG = "crossbar.ops.jsonlog.observer"
TEST_STALL = 8.0
"""Seconds of a worker's silence before it is killed, in the test of a wedged worker
(production's :data:`~crossbar.process.supervisor.STALL` is 30): long enough that a
worker starting on a loaded machine is not taken for a wedged one."""


def fresh(case: TestCase) -> HTTPClient:
    """A client that opens a new connection for every request."""
    pool = HTTPConnectionPool(reactor, persistent=False)
    case.addCleanup(pool.closeCachedConnections)
    return HTTPClient(Agent(reactor, pool=pool))


def events(proc: Twistd) -> list[dict[str, Any]]:
    """The supervisor's JSON log so far."""
    out = []
    for line in proc.out:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def served(proc: Twistd) -> list[dict[str, Any]]:
    """The per-request log events of proxied requests, in order."""
    return [e for e in events(proc) if e.get("namespace") == "crossbar.proxy" and "status" in e]


def worker_pids(proc: Twistd) -> dict[int, int]:
    """worker index -> pid of its latest start."""
    pids: dict[int, int] = {}
    for e in events(proc):
        m = re.match(r"worker (\d+) started \(pid (\d+)\)", e.get("message", ""))
        if m and e.get("namespace") == "crossbar.supervisor":
            pids[int(m.group(1))] = int(m.group(2))
    return pids


def _socket_inode(local_port: int, remote_port: int) -> str | None:
    """The inode of the loopback TCP socket with these ports (``/proc/net/tcp``)."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == local_port and int(remote.split(":")[1], 16) == remote_port:
            return fields[9]
    return None


def ask_worker(proc: Twistd, path: str) -> tuple[int, int, bytes]:
    """``GET path`` on a fresh connection to crossbar (blocking: the workers are other
    processes), and which worker answered: the one whose open files hold the
    connection's server end. Returns ``(worker, status code, body)``."""
    assert proc.port is not None
    with socket.create_connection(("127.0.0.1", proc.port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        code = int(head.split()[1])
        inode = _socket_inode(proc.port, sock.getsockname()[1])  # the server end: kept alive
        assert inode is not None
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if length is not None:
            while len(body) < int(length.group(1)):
                body += sock.recv(65536)
        else:  # chunked
            while not body.endswith(b"0\r\n\r\n"):
                body += sock.recv(65536)
            chunks, rest = [], body
            while True:
                size_line, rest = rest.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                if not size:
                    break
                chunks.append(rest[:size])
                rest = rest[size + 2:]
            body = b"".join(chunks)
        for index, pid in worker_pids(proc).items():
            try:
                links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            except OSError:
                continue
            if f"socket:[{inode}]" in links:
                return index, code, body
    raise AssertionError(f"no worker holds the connection to {path}")


def kill_workers(proc: Twistd) -> None:
    """SIGKILL every worker process ``proc`` started that is still running."""
    pids = set()
    for e in events(proc):
        m = re.match(r"worker (\d+) started \(pid (\d+)\)", e.get("message", ""))
        if m and e.get("namespace") == "crossbar.supervisor":
            pids.add(int(m.group(2)))
    for line in proc.out + proc.err:  # a text log
        m = re.search(r"\[crossbar\.supervisor#info\] worker \d+ started \(pid (\d+)\)", line)
        if m:
            pids.add(int(m.group(1)))
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"crossbar.process.worker" not in f.read():
                    continue  # gone, and the pid taken by someone else
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # it has exited


async def start_workers(case: TestCase, yaml: str, workers: str = "2", **kw: Any) -> Twistd:
    """twistd with ``workers`` and the JSON log; returns once every worker is ready.
    At the end the process is killed and its connections to the fake hosts given a
    moment to close. Workers outlive a killed supervisor (they drain when its pipe
    closes): the clean-up kills them too."""
    case.addCleanup(deferLater, reactor, 0.3, lambda: None)
    box: list[Twistd] = []
    case.addCleanup(lambda: box and kill_workers(box[0]))
    proc = await start_twistd(case, f"workers: {workers}\n" + yaml, logger=JSONLOG, **kw)
    box.append(proc)
    count = usable_cpus() if workers == "auto" else int(workers)
    for i in range(count):
        await proc.line(lambda line, i=i: f'"message": "worker {i} is ready"' in line, timeout=START,
                             what=f"worker {i} ready")
    return proc


def host_yaml(url: str, extra: str = "", drain: str = "{delay: 0.3, grace: 5}") -> str:
    return f"""
health: {{interval: 60, timeout: 5}}
drain: {drain}
hosts:
  a:
    url: {url}
{extra}
routes:
  r:
    hosts: [a]
    affinity: {{key: none}}
"""


class Held:
    """``/v1/chat/completions`` on a fake host that holds each request: for the
    ``hold`` seconds its JSON body names, or until :meth:`release`. Records arrivals,
    departures and the most requests it had at once.

    :ivar log: ``(reactor time, "+" | "-")`` per arrival and departure.
    """

    def __init__(self) -> None:
        self.current = 0
        self.most = 0
        self.log: list[tuple[float, str]] = []
        self.waiting: list[Request] = []
        self.arrived: list[Deferred[None]] = []

    def __call__(self, request: Request, body: bytes) -> Any:
        doc = json.loads(body or b"{}")
        self.current += 1
        self.most = max(self.most, self.current)
        self.log.append((reactor.seconds(), "+"))
        request.setHeader(b"content-type", b"application/json")
        request.notifyFinish().addBoth(self._left)
        hold = doc.get("hold")
        if hold is None:
            self.waiting.append(request)
        else:
            reactor.callLater(hold, self._answer, request)  # type: ignore[attr-defined]
        arrived, self.arrived = self.arrived, []
        for d in arrived:
            d.callback(None)
        return NOT_DONE_YET

    def _left(self, _: object) -> None:
        self.current -= 1
        self.log.append((reactor.seconds(), "-"))

    def _answer(self, request: Request) -> None:
        if not request.finished and not request._disconnected:  # type: ignore[attr-defined]
            request.write(b'{"object": "chat.completion", "choices": []}')
            request.finish()

    def release(self) -> float:
        """Answer the oldest held request; returns the reactor time it was answered."""
        request = self.waiting.pop(0)
        now = reactor.seconds()
        self._answer(request)
        return now

    def next_arrival(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self.arrived.append(d)
        return d

    def arrivals(self) -> int:
        return sum(1 for _, kind in self.log if kind == "+")


async def held_host(case: TestCase) -> tuple[FakeLlama, Held, str]:
    upstream = FakeLlama()
    held = Held()
    upstream.handlers[b"/v1/chat/completions"] = held
    return upstream, held, await listen(case, upstream)


def _chat(base: str, stream: bool) -> str:
    client = OpenAI(base_url=base + "/r/v1", api_key="unused", max_retries=0, timeout=30.0)
    try:
        if stream:
            return "".join(
                chunk.choices[0].delta.content or ""
                for chunk in client.chat.completions.create(model="tiny-a", messages=[], stream=True)
                if chunk.choices
            )
        return client.chat.completions.create(model="tiny-a", messages=[]).model
    finally:
        client.close()


class ServingTests(TestCase):
    timeout = 120

    async def test_both_workers_serve_plain_and_streams(self) -> None:
        upstream = FakeLlama()
        upstream.events = 4
        proc = await start_workers(self, host_yaml(await listen(self, upstream)))
        http = fresh(self)
        i = 0
        # The kernel hands each connection to whichever worker accepts first: an idle
        # set may favour one. Go on (up to 80 requests) until both have served some.
        while i < 12 or (i < 80 and {e["worker"] for e in served(proc)} != {0, 1}):
            i += 1
            if i % 2:
                stream = ClientStream(http, proc.base + "/r/v1/chat/completions", 4, 0.01)
                outcome, body = await stream.done
                self.assertEqual(outcome, "complete")
                self.assertEqual(ClientStream.events(body), [0, 1, 2, 3])
                self.assertTrue(body.endswith(b"data: [DONE]\n\n"))
            else:
                response = await http.post(proc.base + "/r/v1/chat/completions",
                                           json={"model": "tiny-a", "messages": []})
                self.assertEqual(response.code, 200)
                self.assertEqual((await treq.json_content(response))["model"], "tiny-a")
        # The real openai client, plain and streaming, a few times over.
        for _ in range(2):
            self.assertEqual(await deferToThread(_chat, proc.base, False), "tiny-a")
            self.assertEqual(await deferToThread(_chat, proc.base, True), " tok0 tok1 tok2 tok3")
        await wait_for(lambda: len(served(proc)) >= i + 4, 10, f"{i + 4} request log lines")
        lines = served(proc)
        self.assertEqual({e["status"] for e in lines}, {200})
        self.assertEqual({e["worker"] for e in lines}, {0, 1}, "both workers served")
        # Every relayed line carries its worker; the supervisor's own lines do not need one.
        relayed = [e for e in events(proc) if e.get("namespace", "") in ("crossbar.proxy", "crossbar.channel")]
        self.assertTrue(all(isinstance(e.get("worker"), int) for e in relayed), [e for e in relayed if not isinstance(e.get("worker"), int)])
        self.assertFalse(any("worker_message" in e for e in events(proc)))

    async def test_text_log_relays_worker_lines(self) -> None:
        """Without the JSON logger, the supervisor relays each worker's lines into its
        own (text) log, marked ``worker=N``; with it, workers write straight through
        (the other tests here)."""
        upstream = FakeLlama()
        self.addCleanup(deferLater, reactor, 0.3, lambda: None)  # the hosts' connections close
        proc = await start_twistd(self, "workers: 2\n" + host_yaml(await listen(self, upstream)))
        self.addCleanup(lambda: kill_workers(proc))
        for i in range(2):
            await proc.line(lambda line, i=i: f"worker {i} is ready" in line, timeout=START)
        response = await fresh(self).post(proc.base + "/r/v1/chat/completions", json={"model": "tiny-a", "messages": []})
        self.assertEqual(response.code, 200)
        await treq.content(response)
        line = await proc.line(lambda line: "POST /r/v1/chat/completions -> a 200" in line, timeout=10)
        self.assertRegex(line, r"\[crossbar\.proxy#info worker=[01]\] POST /r/v1/chat/completions -> a 200 ")
        self.assertFalse(line.lstrip().startswith("{"))
        # Each worker wrote it to the supervisor's standard output itself (issue 33).
        pids = [int(m.group(1)) for m in map(re.compile(r"worker \d started \(pid (\d+)\)").search, proc.out) if m]
        self.assertEqual(len(pids), 2, proc.text())
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                self.assertIn(b"\0--log\0text\0", f.read())

    async def test_text_log_file_gets_workers_lines_and_rotates(self) -> None:
        """With ``--logfile``, workers format their text lines and the supervisor
        appends them to twistd's log file unread, in batches (issue 33); the file
        still rotates on SIGUSR1, and later lines go to the new file."""
        from tests.process import ROOT, twistd_argv, twistd_env

        self.addCleanup(deferLater, reactor, 0.3, lambda: None)
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        path, log = os.path.join(directory, "crossbar.yaml"), os.path.join(directory, "crossbar.log")
        with open(path, "w") as f:
            f.write('listen: "tcp:0:interface=127.0.0.1"\nworkers: 2\n' + host_yaml(await listen(self, FakeLlama())))
        proc = Twistd()
        args = twistd_argv(path, options=("-n", "--pidfile=", f"--logfile={log}"))
        reactor.spawnProcess(proc, args[0], args, env=twistd_env(), path=ROOT)  # type: ignore[attr-defined]

        def text(name: str = log) -> str:
            try:
                with open(name, encoding="utf-8") as f:
                    return f.read()
            except FileNotFoundError:
                return ""

        def pids() -> list[int]:
            return [int(p) for p in re.findall(r"\[crossbar\.supervisor#info\] worker \d started \(pid (\d+)\)",
                                                text(log) + text(log + ".1"))]

        async def cleanup() -> None:
            for pid in pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if proc.exit is None:
                proc.signal("KILL")
                await proc.ended

        self.addCleanup(cleanup)
        await wait_for(lambda: "worker 0 is ready" in text() and "worker 1 is ready" in text(), START, "both ready")
        port = int(re.findall(r"listening on 127\.0\.0\.1:(\d+)", text())[0])
        for pid in pids():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                self.assertIn(b"\0--log\0batched-text\0", f.read())

        async def served(name: str) -> str:
            response = await fresh(self).post(f"http://127.0.0.1:{port}/r/v1/chat/completions",
                                              json={"model": "tiny-a", "messages": []})
            self.assertEqual(response.code, 200)
            await treq.content(response)
            found = await wait_for(lambda: re.search(r".*POST /r/v1/chat/completions -> a 200 .*\n", text(name)),
                                   10, f"the request's line in {name}")
            return str(found.group(0))

        line = await served(log)
        self.assertRegex(line, r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} \[crossbar\.proxy#info worker=[01]\] POST ")
        proc.signal(signal.SIGUSR1)
        await wait_for(lambda: os.path.exists(log + ".1"), 10, "the rotated log")
        self.assertIn("POST /r/v1/chat/completions -> a 200", text(log + ".1"))
        await served(log)
        self.assertEqual(text(log + ".1").count("POST /r/v1/chat/completions -> a 200"), 1)

    async def test_a_killed_supervisors_directory_is_removed_by_the_next(self) -> None:
        """twistd with workers killed with SIGKILL leaves its workers' directory; the
        next one started removes it and says so (issue 29, item 15)."""
        runtime = os.path.abspath(self.mktemp())
        os.makedirs(runtime)
        url = await listen(self, FakeLlama())
        first = await start_workers(self, host_yaml(url), env={"RUNTIME_DIRECTORY": runtime})
        [left] = os.listdir(runtime)
        first.signal("KILL")
        await first.ended
        kill_workers(first)
        self.assertEqual(os.listdir(runtime), [left])  # nothing could remove it
        second = await start_workers(self, host_yaml(url), env={"RUNTIME_DIRECTORY": runtime})
        [own] = os.listdir(runtime)
        self.assertNotEqual(own, left)
        removed = [e for e in events(second) if e.get("namespace") == "crossbar.supervisor"
                   and e.get("directory") == os.path.join(runtime, left)]
        self.assertEqual(len(removed), 1, second.text())

    async def test_workers_auto(self) -> None:
        upstream = FakeLlama()
        proc = await start_workers(self, host_yaml(await listen(self, upstream)), workers="auto")
        self.assertEqual(sorted(worker_pids(proc)), list(range(usable_cpus())))
        response = await fresh(self).post(proc.base + "/r/v1/chat/completions", json={"model": "tiny-a", "messages": []})
        self.assertEqual(response.code, 200)
        await treq.content(response)

    async def test_ssl_listener_refused(self) -> None:
        """``ssl:`` with workers: 2 fails at start-up with the one-line config error."""
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        path = os.path.join(directory, "crossbar.yaml")
        with open(path, "w") as f:
            f.write('listen: "ssl:0:privateKey=key.pem:interface=127.0.0.1"\nworkers: 2\n'
                    "hosts:\n  a: http://127.0.0.1:1\nroutes:\n  r:\n    hosts: [a]\n")
        from tests.process import twistd_argv, twistd_env, ROOT

        proc = Twistd()
        args = twistd_argv(path)
        reactor.spawnProcess(proc, args[0], args, env=twistd_env(), path=ROOT)  # type: ignore[attr-defined]
        code, _ = await proc.ended
        self.assertNotEqual(code, 0)
        errors = [line for line in proc.err if line.strip()]
        self.assertEqual(len(errors), 1, proc.text())
        self.assertIn(path, errors[0])
        self.assertIn("workers", errors[0])
        self.assertIn("ssl: listener needs workers: 1", errors[0])
        self.assertNotIn("Traceback", proc.text())

    async def test_failed_start_leaves_no_directory(self) -> None:
        """A port in use stops start-up with one line, and the supervisor's directory
        (shared counts, metrics) is never made."""
        import socket

        from tests.process import ROOT, twistd_argv, twistd_env

        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        self.addCleanup(busy.close)
        directory = os.path.abspath(self.mktemp())
        tmp = os.path.join(directory, "tmp")
        os.makedirs(tmp)
        path = os.path.join(directory, "crossbar.yaml")
        with open(path, "w") as f:
            f.write(f'listen: "tcp:{busy.getsockname()[1]}:interface=127.0.0.1"\nworkers: 2\n'
                    "hosts:\n  a: http://127.0.0.1:1\nroutes:\n  r:\n    hosts: [a]\n")
        proc = Twistd()
        args = twistd_argv(path)
        reactor.spawnProcess(proc, args[0], args, env=twistd_env({"TMPDIR": tmp}), path=ROOT)  # type: ignore[attr-defined]
        code, _ = await proc.ended
        self.assertNotEqual(code, 0)
        self.assertIn("Address already in use", proc.text())
        self.assertEqual(os.listdir(tmp), [])


class FleetTests(TestCase):
    timeout = 120

    async def test_max_inflight_fleet_wide(self) -> None:
        """max_inflight 2, 6 concurrent slow requests over 2 workers: the host never has
        more than 2 + (N - 1) = 3; the rest wait and all complete."""
        _, held, url = await held_host(self)
        proc = await start_workers(self, host_yaml(url, "    max_inflight: 2"))
        http = fresh(self)

        async def one() -> int:
            response = await http.post(proc.base + "/r/v1/chat/completions",
                                       json={"model": "tiny-a", "messages": [], "hold": 0.4})
            await treq.content(response)
            return int(response.code)

        spanned = 0
        for batch in range(10):  # until a batch lands in both workers (the kernel decides)
            before = len(served(proc))
            held.most = 0
            codes = await DeferredList([ensureDeferred(one()) for _ in range(6)], consumeErrors=True)
            self.assertEqual([ok and code for ok, code in codes], [200] * 6)
            self.assertEqual(held.arrivals(), 6 * (batch + 1))
            self.assertLessEqual(held.most, 3)
            self.assertGreaterEqual(held.most, 2)
            await wait_for(lambda: len(served(proc)) >= before + 6, 10, "6 log lines")
            lines = served(proc)[before:]
            self.assertTrue(any(e["queued_ms"] > 0 for e in lines), "some requests waited")
            if {e["worker"] for e in lines} == {0, 1}:
                spanned += 1
                if spanned >= 2:
                    break
        self.assertGreaterEqual(spanned, 1, "no batch was served by both workers")

    async def test_client_key_max_inflight_fleet_wide(self) -> None:
        """A client key's ``max_inflight: 2`` counts its requests in every worker: of 6
        concurrent requests, at most 2 + (N - 1) = 3 are let in, the rest get 429."""
        _, held, url = await held_host(self)
        yaml = host_yaml(url).replace("    affinity: {key: none}\n",
                                      "    affinity: {key: none}\n    keys:\n"
                                      "      ci: {secret: ci-s3cret-0123456789, max_inflight: 2}\n")
        proc = await start_workers(self, yaml)
        http = fresh(self)

        async def one() -> int:
            response = await http.post(proc.base + "/r/v1/chat/completions",
                                       json={"model": "tiny-a", "messages": [], "hold": 0.4},
                                       headers={"Authorization": "Bearer ci-s3cret-0123456789"})
            await treq.content(response)
            return int(response.code)

        spanned = 0
        for _ in range(25):  # until a batch lands in both workers (the kernel decides)
            before = len(served(proc))
            held.most = 0
            results = await DeferredList([ensureDeferred(one()) for _ in range(6)], consumeErrors=True)
            codes = sorted(code for ok, code in results if ok)
            self.assertEqual(len(codes), 6)
            self.assertEqual(set(codes) - {200, 429}, set(), codes)
            self.assertGreaterEqual(codes.count(200), 2, codes)
            self.assertLessEqual(codes.count(200), 3, codes)
            self.assertLessEqual(held.most, 3)
            await wait_for(lambda: len(served(proc)) >= before + 6, 10, "6 log lines")
            lines = served(proc)[before:]
            if len({e["worker"] for e in lines}) == 2 and min(
                    sum(1 for e in lines if e["worker"] == w) for w in (0, 1)) >= 2:
                spanned += 1
                if spanned >= 2:
                    break
        self.assertGreaterEqual(spanned, 1, "no batch put two requests in each worker")

    async def test_waiting_request_goes_soon_after_a_slot_frees_in_another_worker(self) -> None:
        """Two requests hold the host's two slots; one more waits. Releasing the oldest
        slot dispatches the waiting one within 100 ms (design target: 20 ms), also when
        the slot freed in the other worker. Requests are released oldest first, one at
        a time, so the n-th request log line is the n-th request: round k frees
        request k and dispatches request k + 2, across workers when their log lines'
        ``worker`` differ."""
        _, held, url = await held_host(self)
        proc = await start_workers(self, host_yaml(url, "    max_inflight: 2"))
        http = fresh(self)
        pending: list[Deferred[Any]] = []

        def send() -> None:
            pending.append(ensureDeferred(http.post(proc.base + "/r/v1/chat/completions",
                                                    json={"model": "tiny-a", "messages": []})))

        async def queued() -> int:
            response = await http.get(proc.base + "/_crossbar/status")
            return int((await treq.json_content(response))["routes"]["r"]["queued"])

        for _ in range(2):
            arrived = held.next_arrival()
            send()
            await arrived
        gaps: list[float] = []

        async def release_oldest() -> float | None:
            """Release the oldest held request; the gap until the next arrival, if one
            was waiting."""
            waiting = await queued()
            arrived = held.next_arrival()
            before = len(served(proc))
            freed = held.release()
            gap = None
            if waiting:
                await arrived.addTimeout(10, reactor)
                gap = reactor.seconds() - freed
            await wait_for(lambda: len(served(proc)) > before, 10, "the released request's log line")
            return gap

        def cross_rounds() -> list[int]:
            workers = [e["worker"] for e in served(proc)]
            return [k for k in range(len(workers) - 2) if k < len(gaps) and workers[k] != workers[k + 2]]

        while len(gaps) < 20 and (len(gaps) < 4 or not cross_rounds()):
            send()
            await wait_for(lambda: ensureDeferred(queued()), 10, "one request waiting")
            self.assertEqual(held.current, 2, "the waiting request must not reach the host")
            gap = await release_oldest()
            assert gap is not None
            gaps.append(gap)
        while held.waiting:
            await release_oldest()
        for d in pending:
            response = await d
            self.assertEqual(response.code, 200)
            await treq.content(response)
        self.assertLessEqual(held.most, 2)
        self.assertTrue(cross_rounds(), f"no slot freed in one worker went to the other: {served(proc)}")
        if os.environ.get("CROSSBAR_SHOW_GAPS"):
            print("gaps ms", [round(g * 1000, 1) for g in gaps], "cross rounds", cross_rounds())
        self.assertLess(max(gaps[k] for k in cross_rounds()), 0.1, gaps)
        self.assertLess(max(gaps), 0.1, gaps)


async def until_both_workers_served(case: TestCase, proc: Twistd, http: HTTPClient, route: str) -> list[dict[str, Any]]:
    """Chat requests on ``route``, each answered 200, at least 8 and until both workers
    served some (the kernel decides; at most 80). Returns their log lines."""
    before = len(served(proc))
    sent = 0
    while sent < 8 or (sent < 80 and {e["worker"] for e in served(proc)[before:]} != {0, 1}):
        response = await http.post(proc.base + f"/{route}/v1/chat/completions", json={"model": "tiny-a", "messages": []})
        case.assertEqual(response.code, 200)
        await treq.content(response)
        sent += 1
        await wait_for(lambda: len(served(proc)) >= before + sent, 10, "its log line")
    return served(proc)[before:]


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


class FleetViewTests(TestCase):
    timeout = 120

    async def test_status_and_metrics_are_fleet_totals_whichever_worker_answers(self) -> None:
        _, held, url = await held_host(self)
        proc = await start_workers(self, host_yaml(url, "    max_inflight: 2"))
        http = fresh(self)
        done = []
        for _ in range(6):
            done.append(ensureDeferred(http.post(proc.base + "/r/v1/chat/completions",
                                                 json={"model": "tiny-a", "messages": [], "hold": 0})))
        for d in done:
            response = await d
            self.assertEqual(response.code, 200)
            await treq.content(response)
        await wait_for(lambda: len(served(proc)) >= 6, 10, "6 log lines")

        async def queued_now() -> bool:
            response = await http.get(proc.base + "/_crossbar/status")
            return bool((await treq.json_content(response))["routes"]["r"]["queued"] == 1)

        # Two held, then one waiting: sent one at a time, so none is over the limit.
        pending = []
        for n in (1, 2):
            arrived = held.next_arrival()
            pending.append(ensureDeferred(http.post(proc.base + "/r/v1/chat/completions",
                                                    json={"model": "tiny-a", "messages": []})))
            await arrived
        pending.append(ensureDeferred(http.post(proc.base + "/r/v1/chat/completions",
                                                json={"model": "tiny-a", "messages": []})))
        await wait_for(lambda: ensureDeferred(queued_now()), 10, "the third request waiting")
        answered: list[int] = []
        for _ in range(200):  # fresh connections, until each worker answered three times (one may win many in a row)
            worker, code, body = await deferToThread(ask_worker, proc, "/_crossbar/status")
            doc = json.loads(body)
            self.assertEqual(doc["hosts"]["a"]["inflight"], 2, (worker, doc))
            self.assertEqual(doc["routes"]["r"]["queued"], 1, (worker, doc))
            self.assertIsNotNone(doc["routes"]["r"]["oldest_wait_s"])
            self.assertEqual(doc["routes"]["r"]["affinity"]["none"], 8, (worker, doc))
            worker, code, body = await deferToThread(ask_worker, proc, "/_crossbar/metrics")
            text = body.decode()
            self.assertEqual(metric(text, "crossbar_requests_total", route="r", host="a", code="200"), 6, text)
            self.assertEqual(metric(text, "crossbar_queued_requests", route="r"), 1, text)
            self.assertEqual(metric(text, "crossbar_inflight_requests", route="r", host="a"), 2, text)
            self.assertEqual(metric(text, "crossbar_worker_restarts_total"), 0, text)
            answered.append(worker)
            if min(answered.count(0), answered.count(1)) >= 3:
                break
        self.assertGreaterEqual(min(answered.count(0), answered.count(1)), 3, answered)
        self.assertEqual(held.current, 2)
        while held.waiting or held.current:
            if held.waiting:
                held.release()
            await deferLater(reactor, 0.02)
        for d in pending:
            response = await d
            self.assertEqual(response.code, 200)
            await treq.content(response)
        response = await http.get(proc.base + "/_crossbar/status")
        doc = await treq.json_content(response)
        self.assertEqual((doc["hosts"]["a"]["inflight"], doc["routes"]["r"]["queued"]), (0, 0))


class SignalTests(TestCase):
    timeout = 120

    async def test_sigterm_drains_every_worker(self) -> None:
        upstream = FakeLlama()
        proc = await start_workers(self, host_yaml(await listen(self, upstream), drain="{delay: 1, grace: 10}"))
        http = fresh(self)
        streams = [ClientStream(http, proc.base + "/r/v1/chat/completions", 30, 0.07) for _ in range(4)]
        for s in streams:
            await s.first
        proc.signal("TERM")
        await proc.line(lambda line: "draining: readiness is 503" in line and '"worker": 1' in line)
        await proc.line(lambda line: "draining: readiness is 503" in line and '"worker": 0' in line)
        for _ in range(6):  # both workers still accept during drain.delay, and say 503
            response = await http.get(proc.base + "/_crossbar/readyz")
            await treq.content(response)
            self.assertEqual(response.code, 503)
        for s in streams:
            outcome, body = await s.done
            self.assertEqual(outcome, "complete")
            self.assertEqual(ClientStream.events(body), list(range(30)))
        code, sig = await proc.ended
        self.assertTrue(code == 0 or sig == signal.SIGTERM, proc.text())
        self.assertEqual({e["worker"] for e in events(proc) if e.get("message") == "drained"}, {0, 1})
        self.assertFalse(any("Traceback" in line for line in proc.out + proc.err), proc.text())

    async def test_second_sigterm_ends_at_once(self) -> None:
        upstream = FakeLlama()
        proc = await start_workers(self, host_yaml(await listen(self, upstream), drain="{delay: 20, grace: 20}"))
        http = fresh(self)
        streams = [ClientStream(http, proc.base + "/r/v1/chat/completions", 1000, 0.05) for _ in range(2)]
        for s in streams:
            await s.first
        proc.signal("TERM")
        await proc.line(lambda line: "draining: readiness is 503" in line and '"worker": 1' in line)
        await proc.line(lambda line: "draining: readiness is 503" in line and '"worker": 0' in line)
        sent = reactor.seconds()
        proc.signal("TERM")
        code, sig = await proc.ended
        self.assertLess(reactor.seconds() - sent, 5, proc.text())
        self.assertTrue(code == 0 or sig == signal.SIGTERM, proc.text())
        for s in streams:
            outcome, _ = await s.done
            self.assertEqual(outcome, "cut")
        self.assertFalse(any("Traceback" in line for line in proc.out + proc.err), proc.text())

    async def test_sighup_reloads_every_worker(self) -> None:
        upstream = FakeLlama()
        url = await listen(self, upstream)
        proc = await start_workers(self, host_yaml(url))
        with open(proc.config_path, "a") as f:
            f.write("  s:\n    hosts: [a]\n")
        proc.signal("HUP")
        await proc.line(lambda line: "reloaded" in line and '"worker": 0' in line)
        await proc.line(lambda line: "reloaded" in line and '"worker": 1' in line)
        http = fresh(self)
        lines = await until_both_workers_served(self, proc, http, "s")
        self.assertEqual({e["worker"] for e in lines if e["route"] == "s"}, {0, 1})
        # An invalid file: refused once (by the supervisor, which tells no worker).
        with open(proc.config_path, "a") as f:
            f.write("  bad:\n    hosts: [nowhere]\n")
        proc.signal("HUP")
        await proc.line(lambda line: "reload refused" in line)
        await deferLater(reactor, 0.5)
        refused = [line for line in proc.out if "reload refused" in line]
        self.assertEqual(len(refused), 1, refused)
        self.assertIn("nowhere", refused[0])
        for _ in range(4):
            response = await http.post(proc.base + "/s/v1/chat/completions", json={"model": "tiny-a", "messages": []})
            self.assertEqual(response.code, 200)
            await treq.content(response)

    async def test_a_reloads_warnings_are_said_once(self) -> None:
        """What needs a restart (a changed listen) is said by the supervisor once, not
        again by every worker that reloads the snapshot it validated."""
        upstream = FakeLlama()
        url = await listen(self, upstream)
        proc = await start_workers(self, host_yaml(url))
        with open(proc.config_path) as f:
            text = f.read()
        with open(proc.config_path, "w") as f:
            f.write(text.replace("tcp:0:", "tcp:1:", 1) + "  s:\n    hosts: [a]\n")
        proc.signal("HUP")
        await proc.line(lambda line: "reloaded" in line and '"worker": 0' in line)
        await proc.line(lambda line: "reloaded" in line and '"worker": 1' in line)
        said = [line for line in proc.out if "listen changed" in line]
        self.assertEqual(len(said), 1, said)

    async def test_a_restarted_worker_runs_what_the_supervisor_validated(self) -> None:
        """The file edited without a SIGHUP (here: broken) is not what a restarted
        worker runs: it loads the supervisor's snapshot, as its sibling does."""
        upstream = FakeLlama()
        url = await listen(self, upstream)
        proc = await start_workers(self, host_yaml(url))
        with open(proc.config_path, "a") as f:
            f.write("bogus: 1\n")
        pid = worker_pids(proc)[0]
        os.kill(pid, signal.SIGKILL)
        await proc.line(lambda line: "worker 0 died" in line)
        await wait_for(lambda: len([line for line in proc.out if '"message": "worker 0 is ready"' in line]) >= 2,
                       START, "worker 0 ready again")
        self.assertFalse(any("cannot start" in line for line in proc.out), proc.text())
        http = fresh(self)
        lines = await until_both_workers_served(self, proc, http, "r")
        self.assertEqual({e["worker"] for e in lines}, {0, 1})

    async def test_affinity_counts_never_go_down_when_a_worker_dies(self) -> None:
        upstream = FakeLlama()
        url = await listen(self, upstream)
        proc = await start_workers(self, host_yaml(url))
        http = fresh(self)
        for _ in range(12):
            response = await http.post(proc.base + "/r/v1/chat/completions", json={"model": "tiny-a", "messages": []})
            await treq.content(response)
        await wait_for(lambda: len(served(proc)) >= 12, 10, "12 log lines")

        async def counted() -> float:
            response = await http.get(proc.base + "/_crossbar/metrics")
            return metric((await treq.content(response)).decode(), "crossbar_affinity_total", route="r", outcome="none")

        self.assertEqual(await counted(), 12)
        for index in (0, 1):
            os.kill(worker_pids(proc)[index], signal.SIGKILL)
            await proc.line(lambda line, index=index: f"worker {index} died" in line)
            self.assertEqual(await counted(), 12)  # the other worker answers: still 12
            await wait_for(lambda index=index: len([line for line in proc.out
                                                    if f'"message": "worker {index} is ready"' in line]) >= 2,
                           START, f"worker {index} ready again")
        self.assertEqual(await counted(), 12)

    async def test_a_stopped_worker_is_replaced(self) -> None:
        """SIGSTOP one worker (as a wedged reactor would look): after ``--worker-stall``
        seconds of silence the supervisor kills it and a new one serves; the other
        worker, which kept sending ``alive``, is left alone."""
        upstream = FakeLlama()
        url = await listen(self, upstream)
        proc = await start_workers(self, host_yaml(url), plugin_options=["--worker-stall", str(TEST_STALL)])
        pids = worker_pids(proc)
        os.kill(pids[0], signal.SIGSTOP)
        self.addCleanup(lambda: os.kill(pids[0], signal.SIGCONT) if os.path.exists(f"/proc/{pids[0]}") else None)
        await proc.line(lambda line: "worker 0 sent nothing" in line, timeout=TEST_STALL + 15)
        await wait_for(lambda: len([line for line in proc.out if '"message": "worker 0 is ready"' in line]) >= 2,
                       START, "worker 0 ready again")
        self.assertNotEqual(worker_pids(proc)[0], pids[0])
        self.assertEqual(worker_pids(proc)[1], pids[1])
        self.assertFalse(any("worker 1 sent nothing" in line for line in proc.out))

    async def test_killed_worker_is_restarted_counted_and_its_inflight_cleared(self) -> None:
        """SIGKILL the worker that holds a request: it is restarted and counted, and its
        in-flight count is gone from the shared counts as soon as it died.

        The worker holding the request is found from ``/proc`` (its end of the
        connection to the host), so one worker is killed and restarted: the test once
        killed workers in turn until the right one died, two restarts of a Python
        process on a loaded machine, and overran trial's timeout (which pytest reports
        as "'NoneType' object is not iterable" and a dirty reactor). Every wait below
        is bounded and says what it waited for."""
        _, held, url = await held_host(self)
        proc = await start_workers(self, host_yaml(url))
        http = fresh(self)
        arrived = held.next_arrival()
        request = ensureDeferred(http.post(proc.base + "/r/v1/chat/completions",
                                           json={"model": "tiny-a", "messages": []}))
        request.addErrback(lambda f: None)  # its worker is killed: the client is cut off

        async def status() -> dict[str, Any]:
            response = await http.get(proc.base + "/_crossbar/status")
            return await treq.json_content(response)  # type: ignore[no-any-return]

        await arrived
        self.assertEqual((await status())["hosts"]["a"]["inflight"], 1)
        index = worker_holding(proc, held.waiting[0].getClientAddress().port, port_of(url))  # type: ignore[attr-defined]
        pid = worker_pids(proc)[index]
        os.kill(pid, signal.SIGKILL)
        killed = 1
        await proc.line(lambda line: f"worker {index} died" in line and f"restarts: {killed}" in line,
                        what=f"worker {index} died (restarts: 1)")
        # Before its replacement starts (a young worker's restart waits 0.5 s), the
        # other worker already sees the dead one's requests gone.
        at_death = (await status())["hosts"]["a"]["inflight"]
        await proc.line(lambda line: f"worker {index} started" in line and f"pid {pid})" not in line
                        and '"namespace": "crossbar.supervisor"' in line, timeout=START, what=f"worker {index} restarted")
        await wait_for(lambda: len([line for line in proc.out if f'"message": "worker {index} is ready"' in line]) >= 2,
                       60, f"worker {index} ready again after its restart")
        after_restart = (await status())["hosts"]["a"]["inflight"]
        self.assertEqual(at_death, after_restart, "the dead worker's in-flight count is cleared when it dies")
        doc = await status()
        self.assertEqual(doc["hosts"]["a"]["inflight"], 0)
        self.assertTrue(any("died" in line and "restarts: 1" in line for line in proc.out), proc.text())
        response = await http.get(proc.base + "/_crossbar/metrics")
        text = (await treq.content(response)).decode()
        self.assertEqual(metric(text, "crossbar_worker_restarts_total"), killed, text)
        response = await http.post(proc.base + "/r/v1/chat/completions",
                                   json={"model": "tiny-a", "messages": [], "hold": 0})
        self.assertEqual(response.code, 200)
        await treq.content(response)

    test_killed_worker_is_restarted_counted_and_its_inflight_cleared.timeout = 240  # type: ignore[attr-defined]


def worker_holding(proc: Twistd, local_port: int, remote_port: int) -> int:
    """The index of the worker that holds the loopback connection from ``local_port``
    to ``remote_port`` (e.g. its connection to a host).

    :raises AssertionError: no worker holds it."""
    inode = _socket_inode(local_port, remote_port)
    assert inode is not None, f"no TCP connection 127.0.0.1:{local_port} -> :{remote_port} in /proc/net/tcp"
    for index, pid in worker_pids(proc).items():
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if f"socket:[{inode}]" in links:
            return index
    raise AssertionError(f"no worker holds the connection from port {local_port} to port {remote_port}")


@implementer(IReadDescriptor)
class NotifySocket:
    """A stand-in for systemd's ``$NOTIFY_SOCKET`` that knows who sent each datagram
    (``SO_PASSCRED``), as systemd does.

    :ivar messages: ``(sender pid, {KEY: value})`` per datagram, in order.
    """

    def __init__(self, case: TestCase) -> None:
        directory = tempfile.mkdtemp(prefix="crossbar-sd-")  # short: AF_UNIX paths are limited
        case.addCleanup(shutil.rmtree, directory, True)
        self.path = os.path.join(directory, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        self.messages: list[tuple[int, dict[str, str]]] = []
        reactor.addReader(self)  # type: ignore[attr-defined]
        case.addCleanup(self.close)

    def fileno(self) -> int:
        return self.sock.fileno()

    def logPrefix(self) -> str:
        return "notify-socket"

    def doRead(self) -> None:
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except BlockingIOError:
                return
            pid = 0
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("iII", payload[:12])[0]
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            self.messages.append((pid, fields))

    def connectionLost(self, reason: object) -> None:
        pass

    def close(self) -> None:
        reactor.removeReader(self)  # type: ignore[attr-defined]
        self.sock.close()

    def with_key(self, key: str) -> list[tuple[int, dict[str, str]]]:
        return [m for m in self.messages if key in m[1]]


class SystemdTests(TestCase):
    timeout = 120

    async def test_the_supervisor_speaks_for_the_set(self) -> None:
        """READY=1 once both workers are ready, WATCHDOG=1 and STOPPING=1 from the
        supervisor, and never a datagram from a worker."""
        upstream = FakeLlama()
        gate: Deferred[None] = Deferred()
        polls = {"n": 0}

        def health(request: Request, body: bytes) -> Any:
            polls["n"] += 1
            if polls["n"] == 2:  # the second worker's first poll is held
                def finish(_: object) -> None:
                    request.write(b'{"status":"ok"}')
                    request.finish()
                gate.addCallback(finish)
                return NOT_DONE_YET
            return b'{"status":"ok"}'

        upstream.handlers[b"/health"] = health
        notify = NotifySocket(self)
        proc = await start_twistd(self, "workers: 2\n" + host_yaml(await listen(self, upstream)), logger=JSONLOG,
                                  env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"}, ready=False)
        box = [proc]
        self.addCleanup(lambda: kill_workers(box[0]))
        await proc.line(lambda line: "is ready" in line and "crossbar.supervisor" in line)
        await wait_for(lambda: len(notify.with_key("WATCHDOG")) >= 2, 10, "watchdog pings")
        self.assertEqual(notify.with_key("READY"), [], "one worker is not ready yet")
        gate.callback(None)
        await wait_for(lambda: notify.with_key("READY"), 10, "READY=1")
        self.assertEqual(len([line for line in proc.out if "is ready" in line and "crossbar.supervisor" in line]), 2)
        supervisor = proc.transport.pid  # type: ignore[union-attr]
        (pid, ready), = notify.with_key("READY")
        self.assertEqual((pid, ready["READY"]), (supervisor, "1"))
        proc.signal("TERM")
        await wait_for(lambda: notify.with_key("STOPPING"), 10, "STOPPING=1")
        await proc.ended
        self.assertEqual(len(notify.with_key("STOPPING")), 1)
        self.assertEqual({pid for pid, _ in notify.messages}, {supervisor}, notify.messages)
        self.assertGreater(len(notify.with_key("WATCHDOG")), 2)


class ConfigTests(SynchronousTestCase):
    def test_auto_is_usable_cpus(self) -> None:
        config = parse_config("listen: tcp:0\nworkers: auto\nhosts: {a: 'http://h:1'}\nroutes: {r: {hosts: [a]}}\n")
        self.assertEqual(config.workers, min(usable_cpus(), MAX_WORKERS))

    def test_at_most_max_workers(self) -> None:
        for value in (str(MAX_WORKERS + 1), "99999999999999999999"):
            with self.assertRaises(ConfigError) as caught:
                parse_config(f"listen: tcp:0\nworkers: {value}\nhosts: {{a: 'http://h:1'}}\nroutes: {{r: {{hosts: [a]}}}}\n")
            self.assertIn(f"workers: must be at most {MAX_WORKERS}", str(caught.exception))


class SupervisorRuleTests(SynchronousTestCase):
    """The supervisor's refusals and its restarts, over a memory reactor."""

    def config(self, text: str = "") -> Any:
        path = self.mktemp()
        body = text or "listen: tcp:0\nworkers: 2\nhosts: {a: 'http://h:1'}\nroutes: {r: {hosts: [a]}}\n"
        with open(path, "w") as f:
            f.write(body)
        return load_config(path)

    def test_unix_listener_refused(self) -> None:
        for listen_at in ("unix:/tmp/crossbar-x.sock", "systemd:domain=UNIX:index=0"):
            config = replace(self.config(), listen=listen_at)
            with self.assertRaises(ConfigError) as caught:
                Supervisor(config, MemoryReactorClock(), environ={}, handle_signals=False)
            self.assertIn("unix socket listener needs workers: 1", str(caught.exception))

    def test_too_many_counters_refused_at_start_and_on_reload(self) -> None:
        hosts = "".join(f"  h{i}: http://h{i}:1\n" for i in range(101))
        members = ", ".join(f"h{i}" for i in range(101))
        routes = "".join(f"  r{i}: {{hosts: [{members}]}}\n" for i in range(40))
        big = f"listen: tcp:0\nworkers: 2\nhosts:\n{hosts}routes:\n{routes}"
        with self.assertRaises(ConfigError) as caught:
            Supervisor(self.config(big), MemoryReactorClock(), environ={}, handle_signals=False)
        self.assertIn("shared counters", str(caught.exception))
        supervisor = Supervisor(self.config(), MemoryReactorClock(), environ={}, handle_signals=False)
        with open(supervisor.config.source, "w") as f:
            f.write(big)
        self.assertFalse(supervisor.reload())
        self.assertEqual(list(supervisor.config.routes), ["r"])

    def test_reload_keeps_what_a_restart_would_apply(self) -> None:
        supervisor = Supervisor(self.config(), MemoryReactorClock(), environ={}, handle_signals=False)
        with open(supervisor.config.source, "w") as f:
            f.write("listen: tcp:0:interface=127.0.0.2\nworkers: 3\nhosts: {a: 'http://h:1'}\n"
                    "routes: {r: {hosts: [a]}, s: {hosts: [a]}}\n")
        self.assertTrue(supervisor.reload())
        self.assertEqual((supervisor.config.listen, supervisor.config.workers), ("tcp:0", 2))
        self.assertEqual(list(supervisor.config.routes), ["r", "s"])

    def test_a_worker_that_cannot_be_spawned_is_tried_again(self) -> None:
        reactor = _SpawnReactor(failures=2)
        runtime = os.path.abspath(self.mktemp())
        os.makedirs(runtime)
        supervisor = Supervisor(self.config(), reactor, environ={"RUNTIME_DIRECTORY": runtime}, handle_signals=False)
        supervisor.startService()
        self.addCleanup(shutil.rmtree, supervisor.files.directory, True)
        self.assertEqual(os.path.dirname(supervisor.files.directory), runtime)  # systemd's RuntimeDirectory=
        self.assertEqual([w is not None for w in supervisor.workers], [False, False])
        reactor.advance(0.5)  # the first retry of each fails too
        self.assertEqual([w is not None for w in supervisor.workers], [False, False])
        reactor.advance(1.0)
        self.assertEqual([w is not None for w in supervisor.workers], [True, True])
        self.assertEqual(len(reactor.spawned), 2)
        argv = reactor.spawned[0]
        snapshot = argv[argv.index("--snapshot") + 1]
        with open(snapshot) as f:
            self.assertEqual(f.read(), supervisor.config.text)
        worker = supervisor.workers[0]
        assert worker is not None
        worker.ready = True
        worker.processEnded(Failure(ProcessTerminated(signal=9)))
        self.assertFalse(worker.ready)  # a dead worker is not counted as ready


    def test_a_starting_supervisor_removes_dead_supervisors_directories(self) -> None:
        """A supervisor killed with SIGKILL left its ``crossbar-workers-*`` directory: the
        next one removes it when it starts (and says so), never a live one's; its own is
        claimed while it lives and gone when it stops (issue 29, item 15)."""
        from twisted.logger import formatEvent

        from crossbar.process.leftovers import PREFIX, claim, owner_gone
        from tests.logs import LogCapture
        from tests.test_leftovers import claimed_by_a_killed_process

        runtime = os.path.abspath(self.mktemp())
        os.makedirs(runtime)
        dead, dead_pid = claimed_by_a_killed_process(runtime)
        live = tempfile.mkdtemp(prefix=PREFIX, dir=runtime)
        self.addCleanup(os.close, claim(live))
        log = LogCapture(self)
        supervisor = Supervisor(self.config(), _SpawnReactor(failures=0), environ={"RUNTIME_DIRECTORY": runtime},
                                handle_signals=False)
        supervisor.startService()
        self.addCleanup(shutil.rmtree, supervisor.files.directory, True)
        self.assertEqual(sorted(os.listdir(runtime)), sorted([os.path.basename(live),
                                                              os.path.basename(supervisor.files.directory)]))
        self.assertIsNone(owner_gone(supervisor.files.directory))  # held: not a leftover while it lives
        [said] = [formatEvent(e) for e in log.events if e.get("directory") == dead]
        self.assertEqual(said, f"removed {dead}, left by a supervisor that is gone (pid {dead_pid})")
        supervisor._clean_up(None)  # as its stop ends
        self.assertEqual(os.listdir(runtime), [os.path.basename(live)])

    def two_workers(self, timings: WorkerTimings = WorkerTimings()) -> tuple[_SpawnReactor, Supervisor]:
        """A started supervisor of this config's workers on a fake reactor whose spawns
        succeed, with ``timings``; its directory removed at the end."""
        reactor = _SpawnReactor(failures=0)
        supervisor = Supervisor(self.config(), reactor, environ={}, handle_signals=False, timings=timings)
        supervisor.startService()
        self.addCleanup(shutil.rmtree, supervisor.files.directory, True)
        return reactor, supervisor

    def test_a_silent_worker_is_killed(self) -> None:
        """A worker whose reactor is wedged (or a SIGSTOPped process) sends no ``alive``
        line: after STALL seconds it is killed, and so restarted; one that speaks is
        left alone."""
        reactor, supervisor = self.two_workers()
        talking, silent = supervisor.workers
        assert talking is not None and silent is not None
        for worker in (talking, silent):
            worker.childDataReceived(4, b"ready\n")
        for _ in range(int(STALL / HEARTBEAT) + 2):
            reactor.advance(HEARTBEAT)
            talking.childDataReceived(4, b"alive\n")
        self.assertEqual(talking.transport.signals, [])  # type: ignore[union-attr]
        self.assertEqual(silent.transport.signals, ["KILL"])  # type: ignore[union-attr]
        reactor.advance(HEARTBEAT * 2)
        self.assertEqual(silent.transport.signals, ["KILL"])  # once  # type: ignore[union-attr]
        silent.processEnded(Failure(ProcessTerminated(signal=9)))
        reactor.advance(30)
        self.assertIsNot(supervisor.workers[1], silent)  # restarted

    def test_a_start_is_judged_by_its_own_bound(self) -> None:
        """A worker says nothing before its reactor runs (its imports and config first:
        over 30 s on a loaded machine): not ready, it is killed only STARTUP seconds
        after its start, whatever ``--worker-stall`` says; ready, the stall applies."""
        reactor, supervisor = self.two_workers(WorkerTimings.with_stall(6.0))
        starting, ready = supervisor.workers
        assert starting is not None and ready is not None
        ready.childDataReceived(4, b"ready\n")
        for _ in range(int(STARTUP - 2)):  # the checks run on time: every second
            reactor.advance(1)
        self.assertEqual(ready.transport.signals, ["KILL"])  # silent 6 s once ready  # type: ignore[union-attr]
        self.assertEqual(starting.transport.signals, [])  # still starting  # type: ignore[union-attr]
        for _ in range(3):
            reactor.advance(1)
        self.assertEqual(starting.transport.signals, ["KILL"])  # type: ignore[union-attr]

    def test_a_late_supervisor_judges_no_worker_until_it_has_read_them(self) -> None:
        """When the supervisor's own reactor ran late (a loaded machine, a paused VM),
        its workers' lines wait unread: nobody is killed at that check, only at the
        next one if they are still silent."""
        reactor, supervisor = self.two_workers(WorkerTimings.with_stall(6.0))
        talking, silent = supervisor.workers
        assert talking is not None and silent is not None
        for worker in (talking, silent):
            worker.childDataReceived(4, b"ready\n")
        reactor.advance(30)  # one late check, five periods after the last
        self.assertEqual((talking.transport.signals, silent.transport.signals), ([], []))  # type: ignore[union-attr]
        talking.childDataReceived(4, b"alive\n")  # read now
        reactor.advance(1)  # the next check, on time
        self.assertEqual(talking.transport.signals, [])  # type: ignore[union-attr]
        self.assertEqual(silent.transport.signals, ["KILL"])  # type: ignore[union-attr]


class _SpawnReactor(MemoryReactorClock):
    """A memory reactor whose listening ports have a file descriptor and whose first
    ``failures`` spawns per worker fail (an interpreter gone after an upgrade)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.attempts: dict[str, int] = {}
        self.spawned: list[list[str]] = []

    def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> Any:
        listening = super().listenTCP(port, factory, backlog, interface)
        listening.fileno = lambda: 3
        return listening

    def spawnProcess(self, protocol: Any, executable: Any, args: Any = (), env: Any = None, path: Any = None,
                     uid: Any = None, gid: Any = None, usePTY: Any = False, childFDs: Any = None) -> Any:
        row = args[args.index("--row") + 1]
        self.attempts[row] = self.attempts.get(row, 0) + 1
        if self.attempts[row] <= self.failures:
            raise FileNotFoundError(2, "No such file or directory", executable)
        self.spawned.append(list(args))
        transport = MemoryProcessTransport(len(self.spawned) + 1000)
        protocol.makeConnection(transport)
        return transport


class MemoryProcessTransport:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.signals: list[str] = []

    def writeToChild(self, fd: int, data: bytes) -> None:
        pass

    def signalProcess(self, name: str) -> None:
        self.signals.append(name)


class RelayTests(SynchronousTestCase):
    def test_relayed_line_keeps_message_level_fields_and_names_the_worker(self) -> None:
        from twisted.logger import LogLevel, globalLogPublisher

        seen: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(seen.append)
        self.addCleanup(globalLogPublisher.removeObserver, seen.append)
        relay_log_line(b'{"time": "x", "level": "warn", "namespace": "crossbar.proxy", '
                       b'"message": "odd {braces}", "status": 502, "log_x": 1}', 3)
        relay_log_line(b"not json {", 1)
        relay_log_line(b"", 1)
        from twisted.logger import formatEvent

        self.assertEqual(len(seen), 2)
        first, second = seen
        self.assertEqual((first["log_level"], first["log_namespace"]), (LogLevel.warn, "crossbar.proxy"))
        self.assertEqual((formatEvent(first), first["status"], first["worker"]), ("odd {braces}", 502, 3))
        self.assertNotIn("log_x", first)
        self.assertEqual((formatEvent(second), second["worker"]), ("not json {", 1))

    def test_a_worker_traceback_is_in_the_text_log(self) -> None:
        from twisted.logger import formatEvent, globalLogPublisher

        seen: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(seen.append)
        self.addCleanup(globalLogPublisher.removeObserver, seen.append)
        relay_log_line(json.dumps({"level": "critical", "namespace": "twisted", "message": "it broke",
                                   "failure": "Traceback (most recent call last):\nValueError: x\n"}).encode(), 0)
        self.assertEqual(formatEvent(seen[0]), "it broke\nTraceback (most recent call last):\nValueError: x")


    def test_a_legacy_line_keeps_its_system(self) -> None:
        """A worker's line from Twisted's legacy ``log.msg`` (namespace ``log_legacy``)
        is shown as twistd shows it, with its system, not ``[log_legacy#info]`` (issue
        29, item 13): the worker's JSON line made by the worker's own observer."""
        from twisted.logger import LogLevel, formatEventAsClassicLogText, globalLogPublisher
        from twisted.python import log as legacy

        from crossbar.ops.jsonlog import event_as_line

        made: list[str] = []

        def worker_side(event: dict[str, Any]) -> None:
            if event.get("log_namespace") == "log_legacy":
                made.append(event_as_line(event))

        globalLogPublisher.addObserver(worker_side)
        legacy.callWithContext({"system": "HTTPChannel,0,127.0.0.1"}, legacy.msg, "a legacy line")
        legacy.msg("no system")
        legacy.err(ValueError("boom"), "it failed")
        globalLogPublisher.removeObserver(worker_side)
        self.flushLoggedErrors(ValueError)
        self.assertEqual(len(made), 3)
        seen: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(seen.append)
        self.addCleanup(globalLogPublisher.removeObserver, seen.append)
        for line in made:
            relay_log_line(line.encode(), 2)
        self.assertEqual([e["log_namespace"] for e in seen], ["crossbar.worker"] * 3)
        texts = [formatEventAsClassicLogText(e, lambda _: "T") for e in seen]
        self.assertEqual(texts[0], "T [HTTPChannel,0,127.0.0.1 worker=2] a legacy line\n")
        self.assertEqual(texts[1], "T [- worker=2] no system\n")
        self.assertTrue(texts[2].startswith("T [- worker=2] it failed\n\tTraceback"), texts[2])
        self.assertIn("ValueError: boom", texts[2])
        self.assertEqual(seen[2]["log_level"], LogLevel.critical)


class WorkerTextLogTests(SynchronousTestCase):
    def test_same_lines_as_the_supervisors_relay(self) -> None:
        """A worker's own text line (issue 33) is the line the supervisor wrote when it
        relayed the worker's JSON: ``[namespace#level worker=N]``, a legacy event's
        ``[system worker=N]``, a traceback indented below."""
        import io

        from twisted.logger import Logger, LogLevel, formatEventAsClassicLogText, globalLogPublisher
        from twisted.python import log as legacy

        from crossbar.ops.jsonlog import event_as_line
        from crossbar.process.worker import text_observer
        from twisted.logger import _file

        self.patch(_file, "formatTime", _file.formatTime)  # text_observer caches its time stamps

        out = io.StringIO()
        own = text_observer(2, out)
        made: list[str] = []

        def worker_side(event: dict[str, Any]) -> None:
            made.append(event_as_line(event))
            own(dict(event))

        globalLogPublisher.addObserver(worker_side)
        Logger(namespace="crossbar.proxy").info("POST /r -> a {status}", status=200)
        legacy.callWithContext({"system": "HTTPChannel,0,127.0.0.1"}, legacy.msg, "a legacy line")
        legacy.err(ValueError("boom"), "it failed")
        globalLogPublisher.removeObserver(worker_side)
        self.flushLoggedErrors(ValueError)
        relayed: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(relayed.append)
        self.addCleanup(globalLogPublisher.removeObserver, relayed.append)
        for line in made:
            relay_log_line(line.encode(), 2)
        own_lines = [line for line in re.split(r"(?m)^\d{4}-\d\d-\d\dT\S+ ", out.getvalue()) if line]
        relay_lines = [formatEventAsClassicLogText(e, lambda _: "T").split(" ", 1)[1] for e in relayed]
        self.assertEqual(len(own_lines), 3, out.getvalue())
        self.assertEqual(own_lines[:2], relay_lines[:2])
        self.assertEqual(own_lines[0], "[crossbar.proxy#info worker=2] POST /r -> a 200\n")
        self.assertTrue(own_lines[2].startswith("[- worker=2] it failed\n\tTraceback"), own_lines[2])
        self.assertIn("ValueError: boom", own_lines[2])
        self.assertEqual(relayed[2]["log_level"], LogLevel.critical)


class BatchedLinesTests(SynchronousTestCase):
    def test_lines_go_out_together_a_warning_at_once(self) -> None:
        import io

        from twisted.internet.task import Clock
        from twisted.logger import Logger

        from crossbar.process.worker import BatchedLines, text_observer
        from twisted.logger import _file

        self.patch(_file, "formatTime", _file.formatTime)  # text_observer caches its time stamps

        class Out(io.StringIO):
            writes = 0

            def write(self, text: str) -> int:
                self.writes += 1
                return super().write(text)

        out, clock = Out(), Clock()
        batch = BatchedLines(out, clock, delay=0.05, most=200)
        log = Logger(namespace="t", observer=text_observer(1, batch=batch))
        log.info("one")
        log.info("two")
        self.assertEqual(out.getvalue(), "")
        clock.advance(0.05)
        self.assertEqual(out.writes, 1)
        self.assertRegex(out.getvalue(), r"\[t#info worker=1\] one\n.*\[t#info worker=1\] two\n$")
        log.info("three")
        log.warn("four")  # at once, with what waited
        self.assertEqual(out.writes, 2)
        self.assertTrue(out.getvalue().endswith("three\n" + out.getvalue().split("three\n")[1]), out.getvalue())
        self.assertEqual(clock.getDelayedCalls(), [])
        log.info("x" * 300)  # more than ``most``: at once
        self.assertEqual(out.writes, 3)
        log.info("five")
        batch.write_now()
        self.assertEqual((out.writes, clock.getDelayedCalls()), (4, []))
        batch.write_now()
        self.assertEqual(out.writes, 4)


def held_by_worker(proc: Twistd, socks: list[socket.socket]) -> Counter[int]:
    """worker index -> how many of the client connections ``socks`` it holds the
    server end of (read from ``/proc``: which worker accepted each)."""
    assert proc.port is not None
    inodes = {_socket_inode(proc.port, sock.getsockname()[1]) for sock in socks}
    held: Counter[int] = Counter()
    for index, pid in worker_pids(proc).items():
        links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        held[index] = sum(1 for inode in inodes if f"socket:[{inode}]" in links)
    return held


def burst_split(proc: Twistd, connections: int, rounds: int = 1) -> Counter[int]:
    """Open ``connections`` connections to crossbar at once (a burst), send
    ``GET /_crossbar/livez`` ``rounds`` times on each (kept alive, each answered 200),
    and count which worker accepted each."""
    assert proc.port is not None
    clients = [http.client.HTTPConnection("127.0.0.1", proc.port, timeout=30) for _ in range(connections)]
    try:
        for client in clients:
            client.connect()
        for _ in range(rounds):
            for client in clients:
                client.request("GET", "/_crossbar/livez")
                response = client.getresponse()
                response.read()
                assert response.status == 200, response.status
        return held_by_worker(proc, [client.sock for client in clients])
    finally:
        for client in clients:
            client.close()


class BurstTests(TestCase):
    """Workers share a burst (docs/design.md §Workers, issue 23): each has its own
    ``SO_REUSEPORT`` socket, so the kernel spreads connections evenly, however fast
    they come (one shared socket gave most of a burst to whichever worker woke first)."""

    timeout = 120

    async def test_a_burst_of_connections_is_shared_evenly(self) -> None:
        proc = await start_workers(self, host_yaml("http://127.0.0.1:9"), ready=False)
        burst = await deferToThread(burst_split, proc, 100)
        self.assertEqual(sum(burst.values()), 100, burst)
        self.assertGreaterEqual(min(burst[0], burst[1]), 25,
                                f"a burst of 100 connections split {burst[0]}/{burst[1]} over 2 workers")
        kept = await deferToThread(burst_split, proc, 16, 5)
        self.assertEqual(sum(kept.values()), 16, kept)
        self.assertGreaterEqual(min(kept[0], kept[1]), 1,
                                f"16 kept-alive connections split {kept[0]}/{kept[1]} over 2 workers")

    async def test_each_worker_accepts_on_its_own_socket(self) -> None:
        """The supervisor bound one listening socket per worker (the same address, tcp6
        too) and hands each worker its own: no socket is open in two workers."""
        if not socket.has_ipv6:
            self.skipTest("no IPv6 on this machine")
        proc = await start_workers(self, r"listen: 'tcp6:0:interface=\:\:1'" + "\n" + host_yaml("http://127.0.0.1:9"),
                                   ready=False)
        sockets = _listening_inodes(proc)
        listening = {}
        for index, pid in worker_pids(proc).items():
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            listening[index] = links & sockets
        self.assertEqual(len(sockets), 2, "one listening socket per worker")
        self.assertTrue(listening[0] and listening[1], listening)
        self.assertFalse(listening[0] & listening[1], f"workers share a listening socket: {listening}")


class SocketActivationTests(TestCase):
    """``systemd:`` socket activation with workers: the one inherited socket cannot be
    split, so every worker accepts on it (docs/operations.md, "Workers")."""

    timeout = 120

    async def test_workers_share_the_inherited_socket(self) -> None:
        upstream = FakeLlama()
        url = await listen(self, upstream)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        self.addCleanup(sock.close)
        port = sock.getsockname()[1]
        proc = await start_workers(
            self, 'listen: "systemd:domain=INET:index=0"\n' + host_yaml(url),
            env={"LISTEN_FDS": "1", "LISTEN_FDNAMES": "crossbar.socket"},
            child_fds={0: "w", 1: "r", 2: "r", 3: sock.fileno()},
            argv_prefix=["/bin/sh", "-c", 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"', "sh"],
        )
        self.assertEqual(proc.port, port)
        inherited = f"socket:[{os.fstat(sock.fileno()).st_ino}]"
        for index, pid in worker_pids(proc).items():
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            self.assertIn(inherited, links, f"worker {index} does not accept on the inherited socket")
        http = fresh(self)
        lines = await until_both_workers_served(self, proc, http, "r")
        self.assertEqual({e["worker"] for e in lines}, {0, 1})


def _listening_inodes(proc: Twistd) -> set[str]:
    """``socket:[inode]`` of every listening TCP socket on crossbar's port (v4 and v6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == proc.port and fields[3] == "0A":  # LISTEN
                out.add(f"socket:[{fields[9]}]")
    return out


class ControlGroupTests(TestCase):
    timeout = 120

    async def test_sigterm_to_every_process_drains_cleanly(self) -> None:
        """What systemd's default ``KillMode=control-group`` does: SIGTERM to the
        supervisor and every worker at once. Each worker drains once (its own signal
        and the supervisor's ``drain`` command are one drain), a stream in flight
        finishes, and nothing logs a traceback."""
        upstream = FakeLlama()
        proc = await start_workers(self, host_yaml(await listen(self, upstream), drain="{delay: 0.5, grace: 10}"))
        streams = [ClientStream(fresh(self), proc.base + "/r/v1/chat/completions", 20, 0.05) for _ in range(4)]
        for s in streams:
            await s.first
        proc.signal("TERM")
        for pid in worker_pids(proc).values():
            os.kill(pid, signal.SIGTERM)
        for s in streams:
            outcome, body = await s.done
            self.assertEqual(outcome, "complete")
            self.assertEqual(ClientStream.events(body), list(range(20)))
        code, sig = await proc.ended
        self.assertTrue(code == 0 or sig == signal.SIGTERM, proc.text())
        text = proc.text()
        self.assertNotIn("Traceback", text)
        self.assertNotIn("ReactorNotRunning", text)
        self.assertEqual(sorted(e["worker"] for e in events(proc) if e.get("message") == "drained"), [0, 1], text)
