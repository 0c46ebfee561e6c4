"""Drain on SIGTERM with a real ``twistd`` process (docs/design.md §Operations).

Timeline of :meth:`DrainTests.test_sigterm_drains`: three long streams from a loopback
upstream are in flight when SIGTERM arrives. During ``drain.delay`` readiness says 503
and crossbar still serves; after it a new connection is refused; the streams that end
within ``drain.grace`` end intact; the one that does not is cut; the process exits
within delay + grace + 5 s.

The delay and grace leave each stream seconds either side of its mark: under a loaded
machine the fake host's events come late, and a 2 s delay and 4 s grace left the
medium stream too little room to end before the cut.
"""

from __future__ import annotations

import signal
from dataclasses import replace

import treq
from twisted.internet import reactor
from twisted.internet.defer import ensureDeferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import Factory, Protocol
from twisted.trial.unittest import TestCase

from crossbar.config import DrainSettings
from tests.harness import FakeLlama, http_client, listen, port_of, start_routes
from tests.process import ClientStream, start_twistd
from tests.raw import parse_responses, raw_exchange, request_bytes

DELAY = 3.0
GRACE = 6.0


def _config(upstream: str, delay: float = DELAY, grace: float = GRACE) -> str:
    return f"""
health: {{interval: 0.5, timeout: 2}}
drain: {{delay: {delay}, grace: {grace}}}
hosts:
  a: {upstream}
routes:
  r:
    hosts: [a]
"""


class DrainTests(TestCase):
    timeout = 90

    def test_sigterm_drains(self) -> object:
        async def go() -> None:
            upstream = FakeLlama()
            url = await listen(self, upstream)
            proc = await start_twistd(self, _config(url))
            http = http_client(self)
            target = proc.base + "/r/v1/chat/completions"
            # short: ends during the delay; medium: ends during the grace; long: cut.
            short = ClientStream(http, target, n=10, delay=0.2)      # ~2 s
            medium = ClientStream(http, target, n=25, delay=0.2)     # ~5 s
            long = ClientStream(http, target, n=300, delay=0.2)      # ~60 s
            for s in (short, medium, long):
                await s.first
            sent = reactor.seconds()
            proc.signal("TERM")
            await proc.line(lambda line: "draining" in line, timeout=10)

            # readiness is 503 at once, while liveness and the proxy still answer.
            probe = http_client(self)
            ready = await probe.get(proc.base + "/_crossbar/readyz")
            self.assertEqual(ready.code, 503)
            self.assertEqual(await treq.json_content(ready), {"status": "not ready"})
            self.assertLess(reactor.seconds() - sent, DELAY, "503 came too late to test the delay")
            live = await probe.get(proc.base + "/_crossbar/livez")
            self.assertEqual(live.code, 200)
            await treq.content(live)
            plain = await probe.post(proc.base + "/r/v1/chat/completions", json={"n": 1, "delay": 0, "stream": True})
            self.assertEqual(plain.code, 200, "still serving during the delay")
            await treq.content(plain)

            # after the delay: a new connection is refused.
            await proc.line(lambda line: "stopped accepting" in line, timeout=DELAY + 5)
            self.assertGreaterEqual(reactor.seconds() - sent, DELAY - 0.2)
            with self.assertRaises(ConnectionRefusedError):
                await TCP4ClientEndpoint(reactor, "127.0.0.1", proc.port).connect(Factory.forProtocol(Protocol))

            # streams ending within the grace end intact; the other is cut.
            for s, n in ((short, 10), (medium, 25)):
                how, body = await s.done
                self.assertEqual(how, "complete")
                self.assertEqual(ClientStream.events(body), list(range(n)))
                self.assertTrue(body.endswith(b"data: [DONE]\n\n"))
            how, body = await long.done
            self.assertEqual(how, "cut")
            self.assertFalse(body.endswith(b"data: [DONE]\n\n"))
            got = ClientStream.events(body)
            self.assertEqual(got, list(range(len(got))), "what arrived arrived in order")
            self.assertGreater(len(got), 20, "the long stream ran through the delay and grace")
            cut_at = reactor.seconds() - sent
            self.assertGreater(cut_at, DELAY + GRACE - 1.0)

            code, sig = await proc.ended
            took = (proc.ended_at or 0) - sent
            # promptly after the grace (a loaded machine takes seconds to end a Python
            # process and tell this one; a second grace would be 6 s more)
            self.assertLess(took, DELAY + GRACE + 5.0, proc.text())
            self.assertTrue(code == 0 or sig == signal.SIGTERM, (code, sig, proc.text()))
            self.assertIn("aborting requests still in flight: 1", proc.text())
            self.assertNotIn("Traceback", proc.text())

        return ensureDeferred(go())

    def test_sigterm_idle_exits_after_delay(self) -> object:
        """With nothing in flight, crossbar exits right after the delay."""

        async def go() -> None:
            upstream = FakeLlama()
            url = await listen(self, upstream)
            proc = await start_twistd(self, _config(url, delay=1.0, grace=30.0))
            sent = reactor.seconds()
            proc.signal("TERM")
            code, sig = await proc.ended
            took = (proc.ended_at or 0) - sent
            self.assertGreaterEqual(took, 1.0 - 0.1)
            self.assertLess(took, 1.0 + 5.0, "did not wait for the grace with nothing in flight")
            self.assertTrue(code == 0 or sig == signal.SIGTERM, (code, sig, proc.text()))

        return ensureDeferred(go())


class RollingRestartTests(TestCase):
    """SIGTERM to one crossbar while a client streams through it finishes the stream."""

    timeout = 60

    def test_stream_survives_sigterm(self) -> object:
        async def go() -> None:
            upstream = FakeLlama()
            url = await listen(self, upstream)
            proc = await start_twistd(self, _config(url, delay=1.0, grace=10.0))
            stream = ClientStream(http_client(self), proc.base + "/r/v1/chat/completions", n=25, delay=0.1)
            await stream.first
            proc.signal("TERM")
            how, body = await stream.done
            self.assertEqual(how, "complete")
            self.assertEqual(ClientStream.events(body), list(range(25)))
            code, sig = await proc.ended
            self.assertTrue(code == 0 or sig == signal.SIGTERM, (code, sig, proc.text()))
            self.assertNotIn("aborting", proc.text())

        return ensureDeferred(go())


class DrainClosesKeepAliveTests(TestCase):
    """During a drain, answers say ``Connection: close`` and close their connection, so
    keep-alive clients go elsewhere instead of sending more requests here."""

    def test_answers_close_their_connection_while_draining(self) -> object:
        async def go() -> None:
            upstream = FakeLlama()
            url = await listen(self, upstream)
            service, base = await start_routes(self, {"a": url})
            port = port_of(base)
            keep_alive = request_bytes(b"GET", b"/r/v1/models", close=False)
            before, how = await raw_exchange(port, keep_alive, until=lambda data: data.endswith(b"}"), timeout=5)
            self.assertEqual(how, "until")  # served, and the connection stays open
            self.assertEqual(parse_responses(before, at_eof=False)[0].get(b"connection"), [])

            service.runtime.config = replace(service.runtime.config, drain=DrainSettings(delay=0.3, grace=0.3))
            draining = service.drain()
            for target in (b"/r/v1/models", b"/nope/v1/models"):  # proxied, and crossbar's own error
                during, how = await raw_exchange(port, request_bytes(b"GET", target, close=False), timeout=5)
                self.assertIn(how, ("close", "half-close"))  # crossbar closed it
                (answer,) = parse_responses(during)
                self.assertEqual(answer.get(b"connection"), [b"close"])
            await draining

        return ensureDeferred(go())

    def test_idle_keep_alive_connections_are_closed_when_accepting_stops(self) -> object:
        """After ``drain.delay`` crossbar stops accepting; a keep-alive connection that
        sits idle would otherwise bring a new request during the grace. It is closed;
        one with a request in flight is left to finish (and closes after its answer)."""

        async def go() -> None:
            from tests.harness import start_routes
            from tests.raw import connect_raw, request_bytes

            upstream = FakeLlama()
            upstream.event_delay = 0.1
            upstream.events = 8  # ~0.8 s: still running when accepting stops
            service, base = await start_routes(self, {"a": await listen(self, upstream)})
            idle = await connect_raw(self, base, request_bytes(b"GET", b"/r/v1/models", close=False))
            await idle.wait_for(b"tiny-a")
            busy = await connect_raw(
                self, base,
                request_bytes(b"POST", b"/r/v1/chat/completions", [(b"Content-Type", b"application/json"),
                              (b"Content-Length", b"16")], b'{"stream": true}', close=False),
            )
            await busy.wait_for(b"tok0")
            service.runtime.config = replace(service.runtime.config, drain=DrainSettings(delay=0.2, grace=5))
            draining = service.drain()
            started = reactor.seconds()
            await idle.closed  # closed by crossbar once accepting stopped
            self.assertLess(reactor.seconds() - started, 2.0)
            self.assertFalse(busy.closed.called)
            await busy.closed  # its answer ends, then crossbar closes the connection
            self.assertLess(reactor.seconds() - started, 4.0)
            self.assertIn(b"[DONE]", busy.data)
            await draining

        return ensureDeferred(go())


class QueuedDrainTests(TestCase):
    """docs/design.md §Choosing a host, rule 4: a request still waiting in its route's queue
    when the drain's grace ends is answered 503; the one in flight is cut."""

    def test_waiting_request_gets_503_when_the_grace_ends(self) -> object:
        async def go() -> None:
            from tests.harness import start_crossbar, wait_for
            from tests.raw import connect_raw

            upstream = FakeLlama()
            upstream.event_delay = 0.2
            upstream.events = 50  # ~10 s: outlives the grace
            url = await listen(self, upstream)
            service, base = await start_crossbar(self, f"""
health: {{interval: 60, timeout: 5}}
drain: {{delay: 0.1, grace: 0.5}}
hosts:
  a: {{url: {url}, max_inflight: 1}}
routes:
  r:
    hosts: [a]
    queue: {{max: 5, timeout: 30}}
""")
            await service.poller.when_first_round_done()
            body = b'{"stream": true}'
            head = [(b"Content-Type", b"application/json"), (b"Content-Length", b"%d" % len(body))]
            busy = await connect_raw(self, base, request_bytes(b"POST", b"/r/v1/chat/completions", head, body))
            await busy.wait_for(b"tok0")
            waiting = await connect_raw(self, base, request_bytes(b"POST", b"/r/v1/chat/completions", head, body))
            await wait_for(lambda: service.runtime.queued("r") == 1, 2.0)
            await service.drain()
            await waiting.closed
            (answer,) = parse_responses(waiting.data)
            self.assertEqual(answer.status, 503)
            self.assertEqual(upstream.seen[-1].uri, b"/v1/chat/completions")
            self.assertEqual(len([s for s in upstream.seen if s.uri == b"/v1/chat/completions"]), 1)
            await busy.closed
            self.assertNotIn(b"[DONE]", busy.data)
            self.assertEqual(service.runtime.queued("r"), 0)
            self.assertEqual(service.runtime.active, set())

        return ensureDeferred(go())
