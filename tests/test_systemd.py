"""systemd notification and socket activation (docs/design.md §Operations).

A unix datagram socket stands in for systemd's ``$NOTIFY_SOCKET``; the process tests
run a real ``twistd``.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.protocol import DatagramProtocol
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase
from twisted.web.server import NOT_DONE_YET

from crossbar.ops.systemd import Notifier, SystemdNotifier, watchdog_interval
from tests.harness import FakeLlama, http_client, listen, wait_for
from tests.process import start_twistd


class _Collector(DatagramProtocol):
    def __init__(self) -> None:
        self.messages: list[tuple[float, dict[str, str]]] = []

    def datagramReceived(self, data: bytes, addr: object) -> None:
        fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
        self.messages.append((reactor.seconds(), fields))

    def with_key(self, key: str) -> list[tuple[float, dict[str, str]]]:
        return [m for m in self.messages if key in m[1]]


def _fake_systemd(case: TestCase) -> tuple[str, _Collector]:
    directory = tempfile.mkdtemp(prefix="crossbar-sd-")  # short: AF_UNIX paths are limited
    case.addCleanup(shutil.rmtree, directory, True)
    path = os.path.join(directory, "notify")
    collector = _Collector()
    port = reactor.listenUNIXDatagram(path, collector)
    case.addCleanup(port.stopListening)
    return path, collector


class NotifierTests(TestCase):
    def _receiver(self, address: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(address)
        sock.settimeout(2)
        self.addCleanup(sock.close)
        return sock

    def test_path_socket(self) -> None:
        directory = tempfile.mkdtemp(prefix="crossbar-sd-")
        self.addCleanup(shutil.rmtree, directory, True)
        path = os.path.join(directory, "notify")
        receiver = self._receiver(path)
        notifier = Notifier(path)
        self.addCleanup(notifier.close)
        self.assertTrue(notifier.notify(READY="1", STATUS="two\nlines"))
        self.assertEqual(receiver.recv(1024), b"READY=1\nSTATUS=two lines")

    def test_abstract_namespace(self) -> None:
        name = "crossbar-test-" + uuid.uuid4().hex
        receiver = self._receiver("\0" + name)
        notifier = Notifier("@" + name)
        self.addCleanup(notifier.close)
        self.assertTrue(notifier.notify(WATCHDOG="1"))
        self.assertEqual(receiver.recv(1024), b"WATCHDOG=1")

    def test_nobody_listening_is_not_an_error(self) -> None:
        notifier = Notifier("/nonexistent/crossbar-notify")
        self.addCleanup(notifier.close)
        self.assertFalse(notifier.notify(READY="1"))
        self.flushLoggedErrors()

    def test_environment(self) -> None:
        self.assertIsNone(Notifier.from_environment({}))
        self.assertIsNone(Notifier.from_environment({"NOTIFY_SOCKET": ""}))
        with self.assertRaises(ValueError):
            Notifier.from_environment({"NOTIFY_SOCKET": "relative"})
        n = Notifier.from_environment({"NOTIFY_SOCKET": "@x"})
        assert n is not None
        self.addCleanup(n.close)
        self.assertEqual(n.address, "\0x")

    def test_watchdog_interval(self) -> None:
        self.assertIsNone(watchdog_interval({}))
        self.assertEqual(watchdog_interval({"WATCHDOG_USEC": "20000000"}), 10.0)
        self.assertEqual(watchdog_interval({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "7"}, pid=7), 10.0)
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "8"}, pid=7))
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "0"}))
        self.assertIsNone(watchdog_interval({"WATCHDOG_USEC": "soon"}))


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[dict[str, str]] = []

    def notify(self, **fields: str) -> bool:
        self.sent.append(fields)
        return True


class SystemdNotifierTests(TestCase):
    """The service's rules, on a Clock."""

    def test_ready_only_when_ready_and_watchdog_on_the_clock(self) -> None:
        clock = Clock()
        ready: Deferred[object] = Deferred()
        healthy = {"a": False, "b": False}
        recorder = _Recorder()
        service = SystemdNotifier(recorder, clock, lambda: ready, lambda: dict(healthy), watchdog=5.0)  # type: ignore[arg-type]
        service.startService()
        self.assertEqual(recorder.sent, [{"WATCHDOG": "1"}, {"STATUS": "starting; 0/2 hosts healthy"}])
        clock.advance(5)
        self.assertEqual(recorder.sent[-1], {"WATCHDOG": "1"})
        self.assertFalse(any("READY" in m for m in recorder.sent))
        healthy["a"] = True
        service.health_changed()
        self.assertEqual(recorder.sent[-1], {"STATUS": "starting; 1/2 hosts healthy"})
        count = len(recorder.sent)
        service.health_changed()  # no change: nothing sent
        self.assertEqual(len(recorder.sent), count)
        ready.callback(None)
        self.assertEqual(recorder.sent[-1]["READY"], "1")
        self.assertEqual(recorder.sent[-1]["STATUS"], "serving; 1/2 hosts healthy")
        service.draining()
        self.assertEqual(recorder.sent[-1], {"STOPPING": "1", "STATUS": "draining; 1/2 hosts healthy"})
        service.stopService()
        count = len(recorder.sent)
        clock.advance(50)
        self.assertEqual(len(recorder.sent), count, "no watchdog after stop")

    def test_no_watchdog_without_usec(self) -> None:
        clock = Clock()
        recorder = _Recorder()
        service = SystemdNotifier(recorder, clock, Deferred, lambda: {}, watchdog=None)  # type: ignore[arg-type]
        service.startService()
        clock.advance(100)
        self.assertFalse(any("WATCHDOG" in m for m in recorder.sent))
        service.stopService()


class TwistdNotifyTests(TestCase):
    timeout = 60

    def test_ready_watchdog_status_stopping(self) -> object:
        async def go() -> None:
            upstream = FakeLlama()
            gate: Deferred[None] = Deferred()
            answered = {"first": True}

            def slow_health(request: object, body: bytes) -> object:
                if answered["first"]:
                    answered["first"] = False
                    def finish(_: object) -> None:
                        request.write(b'{"status":"ok"}')  # type: ignore[attr-defined]
                        request.finish()  # type: ignore[attr-defined]
                    gate.addCallback(finish)
                    return NOT_DONE_YET
                return b'{"status":"ok"}'

            upstream.handlers[b"/health"] = slow_health
            url = await listen(self, upstream)
            dead = socket.socket()
            dead.bind(("127.0.0.1", 0))
            dead_port = dead.getsockname()[1]
            dead.close()  # nothing listens there: connection refused
            path, systemd = _fake_systemd(self)
            proc = await start_twistd(
                self,
                f"""
health: {{interval: 0.3, timeout: 5}}
drain: {{delay: 0.5, grace: 1}}
hosts:
  a: {url}
  b: http://127.0.0.1:{dead_port}
routes:
  r:
    hosts: [a, b]
""",
                env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"},
                ready=False,
            )
            # Listening, but host a's first poll is held: no READY yet, watchdog already on.
            await wait_for(lambda: len(systemd.with_key("WATCHDOG")) >= 3, 10, "watchdog pings")
            self.assertEqual(systemd.with_key("READY"), [])
            response = await http_client(self).get(proc.base + "/_crossbar/readyz")
            self.assertEqual(response.code, 503)
            await treq.content(response)
            gate.callback(None)
            await wait_for(lambda: systemd.with_key("READY"), 10, "READY=1")
            (_, ready), = systemd.with_key("READY")
            self.assertEqual(ready["READY"], "1")
            self.assertEqual(ready["STATUS"], "serving; 1/2 hosts healthy")
            self.assertEqual(ready["MAINPID"], str(proc.transport.pid))  # type: ignore[union-attr]

            # Watchdog every half WATCHDOG_USEC (0.1 s), from the reactor: pings keep
            # coming, never more than ~14 a second. (The interval itself is pinned on a
            # Clock above; here the wait for 4 pings is bounded by 10 s, not 1 s, so a
            # child starved of CPU on a loaded machine is not taken for a silent one.)
            before = len(systemd.with_key("WATCHDOG"))
            started = reactor.seconds()
            await wait_for(lambda: len(systemd.with_key("WATCHDOG")) - before >= 4, 10,
                           "4 more watchdog pings (one every 0.1 s expected)", step=0.01)
            await wait_for(lambda: reactor.seconds() - started > 1.0, 5)
            elapsed = reactor.seconds() - started
            pings = len(systemd.with_key("WATCHDOG")) - before
            self.assertGreaterEqual(pings, 4)
            self.assertLessEqual(pings, 14 * elapsed, f"{pings} pings in {elapsed:.2f}s: more often than every 0.1 s")

            proc.signal("TERM")
            await wait_for(lambda: systemd.with_key("STOPPING"), 5, "STOPPING=1")
            (_, stopping), = systemd.with_key("STOPPING")
            self.assertTrue(stopping["STATUS"].startswith("draining;"))
            code, sig = await proc.ended
            self.assertTrue(code == 0 or sig is not None, proc.text())

        return ensureDeferred(go())

    def test_socket_activation(self) -> object:
        """``listen: "systemd:domain=INET:index=0"`` adopts the socket passed as fd 3
        with ``LISTEN_FDS``/``LISTEN_PID`` (what ``crossbar.socket`` does)."""

        async def go() -> None:
            upstream = FakeLlama()
            url = await listen(self, upstream)
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(16)
            self.addCleanup(sock.close)
            port = sock.getsockname()[1]
            proc = await start_twistd(
                self,
                f"""
listen: "systemd:domain=INET:index=0"
health: {{interval: 0.3, timeout: 2}}
drain: {{delay: 0.2, grace: 1}}
hosts:
  a: {url}
routes:
  r:
    hosts: [a]
""",
                # systemd >= 227 always sets LISTEN_FDNAMES (default: the socket unit's name).
                env={"LISTEN_FDS": "1", "LISTEN_FDNAMES": "crossbar.socket"},
                child_fds={0: "w", 1: "r", 2: "r", 3: sock.fileno()},
                argv_prefix=["/bin/sh", "-c", 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"', "sh"],
            )
            self.assertEqual(proc.port, port)
            response = await http_client(self).post(
                f"http://127.0.0.1:{port}/r/v1/chat/completions", json={"model": "tiny-a", "messages": []}
            )
            self.assertEqual(response.code, 200)
            self.assertEqual((await treq.json_content(response))["model"], "tiny-a")
            proc.signal("TERM")
            await proc.ended

        return ensureDeferred(go())
