"""``contrib/haproxy/haproxy.cfg`` in front of two real crossbar processes: SIGTERM one
under streaming load and no request fails (docs/design.md §Workers, last point; §Operations,
SIGTERM drains).

The test runs the shipped file itself, unchanged: every address in it is an environment
variable with a ``presetenv`` default, and the test sets the variables (listen port,
the two crossbars, log to stdout). Each crossbar fronts its own :class:`FakeLlama`, so
the upstream that saw a request tells which crossbar served it.

Timeline of :meth:`HAProxyDrainTests.test_sigterm_one_under_streaming_load`: six clients
stream chat completions through HAProxy in a loop (2 to 7 s each, 10 events/s). Once
both crossbars carry streams, crossbar1 gets SIGTERM: its readyz turns 503, HAProxy
marks it DOWN (before crossbar1 stops accepting, since ``drain.delay`` exceeds the
check's ``inter * fall + timeout check``), the streams in flight through it run on to
their end (no ``on-marked-down shutdown-sessions``), new streams go to crossbar2, and
crossbar1 exits with nothing aborted. The load goes on for a while after that; every
stream of the run must be complete, in order, ending with ``[DONE]``.

Needs Debian's ``haproxy``: skipped when it is not installed, a failure under
``CI=true`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred, gatherResults
from twisted.internet.task import deferLater
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase

from tests.harness import FakeLlama, http_client, listen, upstream_requests, wait_for
from tests.process import ROOT, ClientStream, Twistd, start_twistd, twistd_env

CONFIG = os.path.join(ROOT, "contrib", "haproxy", "haproxy.cfg")

# drain.delay must exceed HAProxy's time to mark a server DOWN: inter 1 s * fall 2 +
# timeout check 1 s = 3 s in the shipped file.
DRAIN_DELAY = 4.0
DRAIN_GRACE = 15.0
CLIENTS = 6
EVENT_DELAY = 0.1           # s between events: 10 events/s per stream
MAX_STREAMS_PER_CLIENT = 12  # bounds the load in count...
MAX_LOAD_SECONDS = 60.0      # ...and in time
AFTER_EXIT = 3.0             # s of load after crossbar1 has exited (> the shortest stream)

# httplog: "... llm crossbar/crossbar2 0/0/0/1/2003 200 1234 - - ---- ..."
_HTTPLOG = re.compile(r" llm crossbar/(\S+) \S+ (-?\d+) ")


def find_haproxy() -> str | None:
    """The haproxy executable (PATH, then Debian's /usr/sbin), or None."""
    found = shutil.which("haproxy")
    if found:
        return found
    return "/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None


def require_haproxy(case: SynchronousTestCase) -> str:
    """The haproxy executable; skips ``case`` when there is none, fails it under
    ``CI=true``.

    :raises SkipTest: no haproxy, not under CI.
    """
    found = find_haproxy()
    if found:
        return found
    reason = "haproxy is not installed (Debian: apt-get install -y haproxy)"
    if os.environ.get("CI", "").lower() == "true":
        case.fail(f"CI=true requires haproxy: {reason}")
    raise SkipTest(reason)


def free_port() -> int:
    """A loopback port free at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def crossbar_config(upstream: str) -> str:
    return f"""
health: {{interval: 0.5, timeout: 2}}
drain: {{delay: {DRAIN_DELAY}, grace: {DRAIN_GRACE}}}
hosts:
  gpu: {upstream}
routes:
  r:
    hosts: [gpu]
"""


def in_flight(upstream: FakeLlama) -> int:
    """Streams the upstream is still sending."""
    return sum(1 for closed in upstream.streams_closed if not closed.called)


class ConfigTests(TestCase):
    def test_shipped_config_is_valid(self) -> None:
        """``haproxy -c`` accepts the shipped file with its own defaults."""
        haproxy = require_haproxy(self)

        env = {k: v for k, v in os.environ.items() if not k.startswith("CROSSBAR_")}
        done = subprocess.run([haproxy, "-c", "-f", CONFIG], env=env, capture_output=True, text=True, timeout=30)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)

    def test_no_shutdown_sessions_on_mark_down(self) -> None:
        """In-flight streams must outlive the mark-down (the drain depends on it)."""
        with open(CONFIG, encoding="utf-8") as f:
            directives = [line.split("#")[0] for line in f]
        self.assertFalse([d for d in directives if "shutdown-sessions" in d])
        self.assertTrue([d for d in directives if "/_crossbar/readyz" in d])


class HAProxyDrainTests(TestCase):
    timeout = 150

    async def _haproxy(self, executable: str, env: dict[str, str]) -> Twistd:
        """Run ``haproxy -db -f CONFIG`` (foreground) until the test ends."""
        proc = Twistd()  # a ProcessProtocol that collects output lines
        env = {**twistd_env(), **env}
        reactor.spawnProcess(
            proc, executable, [executable, "-db", "-f", CONFIG], env=env, path=ROOT,
        )

        async def stop() -> None:
            if proc.exit is None:
                proc.signal(signal.SIGKILL)
                await proc.ended

        self.addCleanup(stop)
        return proc

    def test_sigterm_one_under_streaming_load(self) -> object:
        executable = require_haproxy(self)

        async def go() -> None:
            up1, up2 = FakeLlama(), FakeLlama()
            url1, url2 = await listen(self, up1), await listen(self, up2)
            cb1, cb2 = await gatherResults([
                ensureDeferred(start_twistd(self, crossbar_config(url1))),
                ensureDeferred(start_twistd(self, crossbar_config(url2))),
            ])
            lb_port = free_port()
            lb = await self._haproxy(executable, {
                "CROSSBAR_LB_BIND": f"127.0.0.1:{lb_port}",
                "CROSSBAR_1": f"127.0.0.1:{cb1.port}",
                "CROSSBAR_2": f"127.0.0.1:{cb2.port}",
                "CROSSBAR_LB_LOG": "stdout",
            })
            base = f"http://127.0.0.1:{lb_port}"
            http = http_client(self)

            async def lb_ready() -> bool:
                try:
                    response = await http.get(base + "/_crossbar/readyz")
                except Exception:
                    return False
                await treq.content(response)
                return bool(response.code == 200)

            await wait_for(lb_ready, 20, "HAProxy answering")

            # The load: CLIENTS loops of streamed completions, bounded in count and time.
            started = reactor.seconds()
            stop_at: list[float] = [started + MAX_LOAD_SECONDS]
            results: list[tuple[int, str, bytes]] = []

            async def client(i: int) -> None:
                n = 20 + 10 * i  # 2 s to 7 s per stream
                for _ in range(MAX_STREAMS_PER_CLIENT):
                    if reactor.seconds() >= stop_at[0]:
                        return
                    how, body = await ClientStream(http, base + "/r/v1/chat/completions", n=n, delay=EVENT_DELAY).done
                    results.append((n, how, body))

            load = gatherResults([ensureDeferred(client(i)) for i in range(CLIENTS)])

            await wait_for(lambda: in_flight(up1) >= 2 and in_flight(up2) >= 2, 10, "streams through both crossbars")
            on_1_at_term = in_flight(up1)
            moments: dict[str, float] = {}

            def mark(name: str) -> Any:
                def record(line: str) -> str:
                    moments[name] = reactor.seconds()
                    return line
                return record

            down: Deferred[str] = lb.line(lambda line: "crossbar1 is DOWN" in line, timeout=DRAIN_DELAY + 5)
            stopped: Deferred[str] = cb1.line(lambda line: "stopped accepting" in line, timeout=DRAIN_DELAY + 5)
            cb1.signal(signal.SIGTERM)
            moments["term"] = reactor.seconds()
            down.addCallback(mark("down"))
            stopped.addCallback(mark("stopped"))
            await down
            through_1_at_down = in_flight(up1)
            await stopped
            # A request HAProxy sent just before the mark-down may still be on its way.
            await deferLater(reactor, 0.5)
            reached_1 = len(upstream_requests(up1))
            code, sig = await cb1.ended
            moments["exit"] = reactor.seconds()
            reached_2_at_exit = len(upstream_requests(up2))
            await deferLater(reactor, AFTER_EXIT)
            stop_at[0] = reactor.seconds()
            await load

            # Every stream of the run is complete and in order.
            self.assertGreaterEqual(len(results), 2 * CLIENTS, "the load ran")
            for n, how, body in results:
                self.assertEqual(how, "complete", body[-200:])
                self.assertEqual(ClientStream.events(body), list(range(n)))
                self.assertTrue(body.endswith(b"data: [DONE]\n\n"))

            # HAProxy noticed readyz's 503 within the delay, i.e. before crossbar1
            # stopped accepting; the streams it carried went on past the mark-down.
            self.assertLess(moments["down"] - moments["term"], DRAIN_DELAY, moments)
            self.assertLess(moments["down"], moments["stopped"], moments)
            self.assertGreaterEqual(on_1_at_term, 2)
            self.assertGreaterEqual(through_1_at_down, 1, "a stream through crossbar1 outlived its mark-down")
            # After the mark-down no request reached crossbar1; crossbar2 took them.
            self.assertEqual(len(upstream_requests(up1)), reached_1)
            self.assertGreater(len(upstream_requests(up2)), reached_2_at_exit, "traffic went on through crossbar2")

            # crossbar1 drained cleanly: nothing aborted.
            self.assertTrue(code == 0 or sig == signal.SIGTERM, (code, sig, cb1.text()))
            self.assertNotIn("aborting", cb1.text())
            self.assertNotIn("Traceback", cb1.text() + cb2.text())

            # HAProxy's own access log agrees: every proxied answer was a 200, both
            # servers served, and crossbar2 is still up.
            logged = [m.groups() for m in map(_HTTPLOG.search, lb.out) if m]
            self.assertGreaterEqual(len(logged), len(results), lb.text())
            self.assertEqual({status for _, status in logged}, {"200"}, lb.text())
            self.assertEqual({server for server, _ in logged}, {"crossbar1", "crossbar2"})
            self.assertNotIn("crossbar2 is DOWN", lb.text())

        return ensureDeferred(go())
