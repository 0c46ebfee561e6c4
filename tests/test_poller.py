"""The health poller (docs/design.md §"The health table", rules 2, 6, 7, 9).

``HealthPollerTests`` drive :class:`HealthPoller` with a :class:`FakeProbe` and a
``Clock``: no sockets, no sleeps. ``HTTPProbeTests`` run the real :class:`HTTPProbe`
against hostile hosts on loopback. ``NeverSlotsTests`` runs the real poller against a
:class:`FakeLlama` for many rounds and checks every path it asked for.
"""

from __future__ import annotations

import json
import socket
from typing import Any, Callable

from twisted.internet import reactor
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import Clock, deferLater
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.hosts.health import HealthTable, HostStatus
from crossbar.hosts.poller import MAX_POLL_BODY, HealthPoller, HTTPProbe, PollCancelled, PollFailed
from tests.fakes import FakeProbe
from crossbar.upstream.pools import PollAgent, UpstreamEndpoints, poll_pool
from tests.harness import FakeLlama, listen
from tests.logs import LogCapture

URLS = {"a": "http://a.test", "b": "http://b.test", "c": "http://c.test"}
INTERVAL = 2.0
TIMEOUT = 5.0


class _Setup:
    def __init__(self, case: TestCase, probe: Any = None, on_poll: Callable[[str, float, bool], None] | None = None,
                 hosts: dict[str, str] | None = None, recovery_polls: int = 2) -> None:
        self.clock = Clock()
        self.clock.advance(1000)
        hosts = hosts or URLS
        self.table = HealthTable(hosts, recovery_polls, 1, self.clock.seconds)
        self.probe = probe if probe is not None else FakeProbe()
        self.poller = HealthPoller(self.table, hosts, self.probe, INTERVAL, TIMEOUT, self.clock, on_poll=on_poll)
        self.poller.startService()
        case.addCleanup(lambda: self.poller.stopService() if self.poller.running else None)

    def s(self, name: str) -> HostStatus:
        s = self.table.get(name)
        assert s is not None
        return s

    def count(self, url: str) -> int:
        return sum(1 for u, _ in self.probe.polls if u == url)


class HealthPollerTests(TestCase):
    def test_first_tick_polls_every_host_at_once(self) -> None:
        """Rule 7: the LoopingCall starts a poll of every host, all concurrently."""
        t = _Setup(self)
        self.assertEqual(sorted(u for u, _ in t.probe.polls), sorted(URLS.values()))

    def test_tick_skips_hosts_with_poll_in_flight(self) -> None:
        """Rule 7: each tick polls every host that has no poll in flight, only those."""
        t = _Setup(self)
        t.probe.succeed(URLS["a"])
        t.probe.fail(URLS["c"])
        t.clock.advance(INTERVAL)
        self.assertEqual((t.count(URLS["a"]), t.count(URLS["b"]), t.count(URLS["c"])), (2, 1, 2))

    def test_polls_of_one_host_never_overlap(self) -> None:
        """Rule 7: a host never has two polls in flight, over many ticks and timeouts."""
        t = _Setup(self)
        for _ in range(40):
            t.clock.advance(INTERVAL / 4)
            for url in URLS.values():
                self.assertLessEqual(len(t.probe.pending(url)), 1)
            if t.probe.pending(URLS["a"]):  # a answers; b and c hang until their timeout
                t.probe.succeed(URLS["a"])
        self.assertGreater(t.count(URLS["b"]), 1)  # b was polled again after timeouts

    def test_result_recorded_as_it_arrives(self) -> None:
        """Rule 7: a result is in the table the moment it arrives, not at the next tick."""
        t = _Setup(self)
        t.clock.advance(0.3)
        t.probe.succeed(URLS["b"], ("m",))
        self.assertTrue(t.s("b").healthy)
        self.assertEqual(t.s("b").loaded, ("m",))
        self.assertEqual(t.s("b").last_ok, t.clock.seconds())
        t.clock.advance(0.4)
        t.probe.fail(URLS["a"], "models: HTTP 500")
        self.assertEqual(t.s("a").last_err, "models: HTTP 500")
        self.assertEqual(t.s("a").failures, 1)

    def test_hung_host_delays_neither_others_nor_its_next_poll(self) -> None:
        """Rule 7: a host that never answers is cut off at health.timeout, recorded as
        timed out, and polled again at the next tick; the others go on meanwhile."""
        t = _Setup(self)
        t.probe.succeed(URLS["a"], ("m",))
        t.probe.succeed(URLS["c"], ("m",))
        self.assertTrue(t.s("a").healthy)  # not waiting for b
        for _ in range(2):  # ticks at +2, +4 while b hangs
            t.clock.advance(INTERVAL)
            t.probe.succeed(URLS["a"], ("m",))
            t.probe.succeed(URLS["c"], ("m",))
        self.assertEqual(t.s("a").consecutive, 3)
        self.assertEqual(t.count(URLS["b"]), 1)
        self.assertFalse(t.s("b").polled)
        t.clock.advance(TIMEOUT - 2 * INTERVAL)  # +5: b's poll is cut off
        self.assertEqual(t.s("b").last_err, "health: timed out after 5s")
        self.assertEqual(t.s("b").failures, 1)
        self.assertEqual(len(t.probe.pending(URLS["b"])), 0)
        t.clock.advance(INTERVAL - (TIMEOUT - 2 * INTERVAL))  # +6: next tick polls b again
        self.assertEqual(t.count(URLS["b"]), 2)

    def test_timeout_in_models_phase(self) -> None:
        """The timeout reason names the phase the poll was in."""
        t = _Setup(self)
        t.probe.advance(URLS["a"])
        t.clock.advance(TIMEOUT)
        self.assertEqual(t.s("a").last_err, "models: timed out after 5s")
        self.assertEqual(t.s("b").last_err, "health: timed out after 5s")

    def test_timeout_of_probe_without_phases(self) -> None:
        """A probe whose Deferred simply fails with CancelledError still gets a reason."""

        class Hangs:
            polls: list[tuple[str, Deferred[Any]]] = []

            def poll(self, url: str) -> Deferred[Any]:
                d: Deferred[Any] = Deferred()
                self.polls.append((url, d))
                return d

        t = _Setup(self, probe=Hangs(), hosts={"a": URLS["a"]})
        t.clock.advance(TIMEOUT)
        self.assertEqual(t.s("a").last_err, "health: timed out after 5s")

    def test_first_round_done_after_timeout(self) -> None:
        """Readiness input: every host's first poll has finished or timed out."""
        t = _Setup(self)
        waiter = t.poller.when_first_round_done()
        t.probe.succeed(URLS["a"])
        t.probe.succeed(URLS["b"])
        self.assertFalse(t.poller.first_round_done)
        self.assertNoResult(waiter)
        t.clock.advance(TIMEOUT)
        self.assertTrue(t.poller.first_round_done)
        self.successResultOf(waiter)

    def test_stop_cancels_inflight_and_records_nothing(self) -> None:
        """Rule 6: stopService cancels every poll in flight, records nothing for them,
        returns a Deferred that has fired once they are gone, and polls no more."""
        t = _Setup(self)
        t.probe.succeed(URLS["a"], ("m",))
        before = t.table.all()
        inflight = t.probe.pending(URLS["b"]) + t.probe.pending(URLS["c"])
        self.assertEqual(len(inflight), 2)
        stopped = t.poller.stopService()
        self.successResultOf(stopped)
        for d in inflight:
            self.assertTrue(d.called)
        self.assertEqual(t.table.all(), before)
        self.assertFalse(t.s("b").polled)
        polls = len(t.probe.polls)
        t.clock.advance(10 * INTERVAL)
        self.assertEqual(len(t.probe.polls), polls)
        self.assertEqual(t.clock.getDelayedCalls(), [])  # no timers left behind

    def test_stop_records_nothing_even_for_failed_cancellation(self) -> None:
        """Rule 6: whatever a poll cancelled at stop errbacks with (here a PollFailed, as a
        probe might wrap the cancellation), nothing is recorded."""

        class WrapsCancel:
            polls: list[tuple[str, Deferred[Any]]] = []

            def poll(self, url: str) -> Deferred[Any]:
                d: Deferred[Any] = Deferred(lambda d: d.errback(PollFailed("health: Connection was aborted")))
                self.polls.append((url, d))
                return d

        t = _Setup(self, probe=WrapsCancel(), hosts={"a": URLS["a"]})
        before = t.table.all()
        self.successResultOf(t.poller.stopService())
        self.assertEqual(t.table.all(), before)

    def test_probe_raising_synchronously_keeps_loop_running(self) -> None:
        """A probe that raises is a failed poll, and the LoopingCall keeps polling."""

        class Raises:
            calls = 0
            polls: list[tuple[str, Any]] = []

            def poll(self, url: str) -> Deferred[Any]:
                self.calls += 1
                raise RuntimeError("probe bug")

        probe = Raises()
        t = _Setup(self, probe=probe, hosts={"a": URLS["a"], "b": URLS["b"]})
        self.assertEqual(probe.calls, 2)
        self.assertEqual(t.s("a").last_err, "health: probe bug")
        for _ in range(3):
            t.clock.advance(INTERVAL)
        self.assertEqual(probe.calls, 8)
        self.assertTrue(t.poller._loop is not None and t.poller._loop.running)

    def test_recording_bug_keeps_loop_running(self) -> None:
        """A bug while recording (here in on_poll) is logged; polling goes on."""
        calls: list[str] = []

        def on_poll(host: str, took: float, ok: bool) -> None:
            calls.append(host)
            raise ValueError("recording bug")

        t = _Setup(self, on_poll=on_poll, hosts={"a": URLS["a"]})
        for i in range(3):
            t.probe.succeed(URLS["a"])
            t.clock.advance(INTERVAL)
        self.assertEqual(len(calls), 3)
        self.assertEqual(t.count(URLS["a"]), 4)
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 3)

    def test_start_failure_keeps_loop_running(self) -> None:
        """Even a failure before the probe is called (here the table) is contained."""
        t = _Setup(self, hosts={"a": URLS["a"]})

        def broken(name: str, models: Any) -> None:
            raise KeyError("table bug")

        t.table.record_success = broken  # type: ignore[method-assign]
        t.probe.succeed(URLS["a"])
        t.clock.advance(INTERVAL)
        t.probe.succeed(URLS["a"])
        t.clock.advance(INTERVAL)
        self.assertEqual(t.count(URLS["a"]), 3)
        self.assertEqual(len(self.flushLoggedErrors(KeyError)), 2)

    def test_on_poll_reports_duration_and_outcome(self) -> None:
        seen: list[tuple[str, float, bool]] = []
        t = _Setup(self, on_poll=lambda h, s, ok: seen.append((h, s, ok)), hosts={"a": URLS["a"], "b": URLS["b"]})
        t.clock.advance(1.5)
        t.probe.succeed(URLS["a"])
        t.probe.fail(URLS["b"])
        self.assertEqual(seen, [("a", 1.5, True), ("b", 1.5, False)])


# --------------------------------------------------------------------------- real HTTP


class _Handler(Resource):
    """A leaf resource answering with ``handler(request)``."""

    isLeaf = True

    def __init__(self, handler: Callable[[Request], Any]) -> None:
        super().__init__()
        self.handler = handler
        self.paths: list[bytes] = []

    def render(self, request: Request) -> Any:
        self.paths.append(request.path)
        return self.handler(request)


def _ok_health(then: Callable[[Request], Any]) -> Callable[[Request], Any]:
    def handle(request: Request) -> Any:
        if request.path == b"/health":
            return b'{"status":"ok"}'
        return then(request)

    return handle


class _Streamer:
    """Writes a body of ``total`` bytes as fast as the client takes it, counting bytes
    handed to the transport, and notes when the connection is lost."""

    def __init__(self, request: Request, total: int, chunk: int = 64 * 1024) -> None:
        self.request = request
        self.remaining = total
        self.sent = 0
        self.chunk = b"x" * chunk
        self.lost: Deferred[None] = Deferred()
        request.notifyFinish().addBoth(self._gone)
        request.registerProducer(self, True)
        self.paused = False
        self.resumeProducing()

    def _gone(self, _: object) -> None:
        if not self.lost.called:
            self.lost.callback(None)

    def resumeProducing(self) -> None:
        self.paused = False
        while not self.paused and self.remaining > 0 and not self.lost.called:  # until the client pushes back
            data = self.chunk[: self.remaining]
            self.remaining -= len(data)
            self.sent += len(data)
            self.request.write(data)
        if self.remaining <= 0 and not self.lost.called:
            self.request.unregisterProducer()
            self.request.finish()

    def pauseProducing(self) -> None:
        self.paused = True

    def stopProducing(self) -> None:
        self.paused = True


class HTTPProbeTests(TestCase):
    timeout = 60

    def probe(self, connect_timeout: float = 5.0) -> HTTPProbe:
        pool = poll_pool(reactor)
        self.addCleanup(pool.close)
        return HTTPProbe(PollAgent(UpstreamEndpoints(reactor, connect_timeout), pool))

    async def poll_failure(self, url: str, probe: HTTPProbe | None = None) -> str:
        try:
            models = await (probe or self.probe()).poll(url)
        except PollFailed as e:
            return e.reason
        self.fail(f"poll succeeded with {models}")

    def test_good_poll(self) -> Deferred[None]:
        async def go() -> None:
            upstream = FakeLlama(["b", "a", "a", ""])
            url = await listen(self, upstream)
            self.assertEqual((await self.probe().poll(url)).loaded, ("a", "b"))  # type: ignore[union-attr]
            self.assertEqual([s.uri for s in upstream.seen], [b"/health", b"/v1/models"])
            self.assertEqual({s.method for s in upstream.seen}, {b"GET"})

        return ensureDeferred(go())

    def test_health_http_status(self) -> Deferred[None]:
        async def go() -> None:
            upstream = FakeLlama()
            upstream.health_code = 503
            url = await listen(self, upstream)
            self.assertEqual(await self.poll_failure(url), "health: HTTP 503")
            self.assertEqual([s.uri for s in upstream.seen], [b"/health"])  # models not asked

        return ensureDeferred(go())

    def test_connection_refused(self) -> Deferred[None]:
        async def go() -> None:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()  # nothing listens there now
            reason = await self.poll_failure(f"http://127.0.0.1:{port}")
            self.assertTrue(reason.startswith("health: "), reason)
            self.assertIn("refused", reason.lower())
            self.assertNotIn("\n", reason)

        return ensureDeferred(go())

    def test_models_http_status(self) -> Deferred[None]:
        async def go() -> None:
            upstream = FakeLlama()

            def models(request: Request, body: bytes) -> bytes:
                request.setResponseCode(500)
                return b'{"error":"boom"}'

            upstream.handlers[b"/v1/models"] = models
            url = await listen(self, upstream)
            self.assertEqual(await self.poll_failure(url), "models: HTTP 500")

        return ensureDeferred(go())

    def test_models_bad_json(self) -> Deferred[None]:
        async def go() -> None:
            upstream = FakeLlama()
            upstream.models = b"<html>not json</html>"
            url = await listen(self, upstream)
            reason = await self.poll_failure(url)
            self.assertTrue(reason.startswith("models: bad JSON"), reason)

        return ensureDeferred(go())

    def test_models_wrong_shape(self) -> Deferred[None]:
        async def go() -> None:
            upstream = FakeLlama()
            upstream.models = {"models": ["a"]}
            url = await listen(self, upstream)
            self.assertEqual(await self.poll_failure(url), 'models: "data" is not a list')

        return ensureDeferred(go())

    def test_redirect_not_followed(self) -> Deferred[None]:
        async def go() -> None:
            target = FakeLlama()
            target_url = await listen(self, target)

            def redirect(request: Request) -> bytes:
                request.redirect((target_url + request.path.decode()).encode())
                return b""

            url = await listen(self, _Handler(redirect))
            self.assertEqual(await self.poll_failure(url), "health: HTTP 302")
            upstream = _Handler(_ok_health(redirect))
            url = await listen(self, upstream)
            self.assertEqual(await self.poll_failure(url), "models: HTTP 302")
            self.assertEqual(target.seen, [])

        return ensureDeferred(go())

    def test_body_exactly_at_limit_is_read(self) -> Deferred[None]:
        async def go() -> None:
            prefix = b'{"data": [{"id": "big"}], "pad": "'
            body = prefix + b"x" * (MAX_POLL_BODY - len(prefix) - 2) + b'"}'
            self.assertEqual(len(body), MAX_POLL_BODY)
            url = await listen(self, _Handler(_ok_health(lambda r: body)))
            self.assertEqual((await self.probe().poll(url)).loaded, ("big",))  # type: ignore[union-attr]

        return ensureDeferred(go())

    def _stream_test(self, path: bytes, total: int, chunked: bool) -> Deferred[None]:
        """A host streaming ``total`` bytes on ``path``: crossbar stops reading past
        1 MiB, closes the connection and fails with the size reason."""

        async def go() -> None:
            streams: list[_Streamer] = []

            def handle(request: Request) -> Any:
                if request.path != path:
                    return b'{"status":"ok"}'
                if not chunked:
                    request.setHeader(b"content-length", str(total).encode())
                streams.append(_Streamer(request, total))
                return NOT_DONE_YET

            url = await listen(self, _Handler(handle))
            phase = "health" if path == b"/health" else "models"
            self.assertEqual(await self.poll_failure(url), f"{phase}: body larger than {MAX_POLL_BODY} bytes")
            [stream] = streams
            # the server sees the connection go away, long before 100 MB are sent
            await stream.lost
            self.assertLess(stream.sent, 8 * MAX_POLL_BODY)
            self.assertGreater(stream.remaining, 0)

        return ensureDeferred(go())

    def test_models_body_over_limit_chunked(self) -> Deferred[None]:
        return self._stream_test(b"/v1/models", 100 * 1024 * 1024, chunked=True)

    def test_models_body_over_limit_with_length(self) -> Deferred[None]:
        return self._stream_test(b"/v1/models", 100 * 1024 * 1024, chunked=False)

    def test_health_body_over_limit(self) -> Deferred[None]:
        return self._stream_test(b"/health", 100 * 1024 * 1024, chunked=True)

    def test_hung_host_bounded_by_timeout(self) -> Deferred[None]:
        """A host that accepts and never answers: the poller's health.timeout ends the
        poll with the timeout reason, and the connection is closed."""

        async def go() -> None:
            connections: list[Protocol] = []
            lost: list[Deferred[None]] = []

            class Silent(Protocol):
                def connectionMade(self) -> None:
                    connections.append(self)
                    self.gone: Deferred[None] = Deferred()
                    lost.append(self.gone)

                def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
                    self.gone.callback(None)

            from twisted.internet.endpoints import TCP4ServerEndpoint

            port = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(Factory.forProtocol(Silent))
            self.addCleanup(port.stopListening)
            url = f"http://127.0.0.1:{port.getHost().port}"
            await self._timeout_case(url, "health", lost)

        return ensureDeferred(go())

    def test_dripping_body_bounded_by_timeout(self) -> Deferred[None]:
        """A host that sends headers, then a byte now and then forever: the poll ends at
        health.timeout ("models: timed out") and its connection is closed."""

        async def go() -> None:
            lost: list[Deferred[None]] = []

            def drip(request: Request) -> Any:
                gone: Deferred[None] = Deferred()
                lost.append(gone)
                request.write(b'{"data": [')
                state: dict[str, Any] = {}

                def more() -> None:
                    request.write(b" ")
                    state["call"] = reactor.callLater(0.05, more)

                def stop(_: object) -> None:
                    state["call"].cancel()
                    gone.callback(None)

                more()
                request.notifyFinish().addBoth(stop)
                return NOT_DONE_YET

            url = await listen(self, _Handler(_ok_health(drip)))
            await self._timeout_case(url, "models", lost)

        return ensureDeferred(go())

    async def _timeout_case(self, url: str, phase: str, lost: list[Deferred[None]]) -> None:
        timeout = 1.0
        table = HealthTable({"h": url}, 1, 1, reactor.seconds)
        poller = HealthPoller(table, {"h": url}, self.probe(), 60, timeout, reactor)
        started = reactor.seconds()
        poller.startService()
        self.addCleanup(lambda: poller.stopService() if poller.running else None)
        await poller.when_first_round_done()
        took = reactor.seconds() - started
        status = table.get("h")
        assert status is not None
        self.assertEqual(status.last_err, f"{phase}: timed out after 1s")
        self.assertGreaterEqual(took, timeout * 0.9)
        self.assertLess(took, timeout + 10)
        # the host sees its connection closed (the poll does not linger past its timeout)
        self.assertEqual(len(lost), 1)
        await lost[0]

    def test_stop_cancels_real_poll_and_records_nothing(self) -> Deferred[None]:
        """Rule 6 on real sockets: stopping mid-poll records nothing and closes the
        connection."""

        async def go() -> None:
            lost: list[Deferred[None]] = []

            def hang(request: Request) -> Any:
                gone: Deferred[None] = Deferred()
                lost.append(gone)
                request.notifyFinish().addBoth(lambda _: gone.callback(None))
                return NOT_DONE_YET

            url = await listen(self, _Handler(hang))
            table = HealthTable({"h": url}, 1, 1, reactor.seconds)
            poller = HealthPoller(table, {"h": url}, self.probe(), 60, 30, reactor)
            poller.startService()
            while not lost:
                await deferLater(reactor, 0.01)
            before = table.all()
            await poller.stopService()
            self.assertEqual(table.all(), before)
            await lost[0]

        return ensureDeferred(go())


class NeverSlotsTests(TestCase):
    timeout = 60

    def test_only_health_and_models_requested(self) -> Deferred[None]:
        """Rule 9: over many rounds (good, failing and recovering) the real poller asks
        for exactly /health and /v1/models, nothing else (never /slots)."""

        async def go() -> None:
            upstream = FakeLlama(["tiny-a"])
            url = await listen(self, upstream)
            pool = poll_pool(reactor)
            self.addCleanup(pool.close)
            probe = HTTPProbe(PollAgent(UpstreamEndpoints(reactor, 2), pool))
            table = HealthTable({"h": url}, 2, 1, reactor.seconds)
            rounds: list[bool] = []
            poller = HealthPoller(table, {"h": url}, probe, 0.02, 2, reactor,
                                  on_poll=lambda h, s, ok: rounds.append(ok))
            poller.startService()
            self.addCleanup(lambda: poller.stopService() if poller.running else None)
            # Rounds may pass several at a time on a loaded machine: switch once each.
            back_at = None
            while len(rounds) < 40 or back_at is None or len(rounds) < back_at + 3:
                if len(rounds) >= 15 and upstream.health_code == 200 and back_at is None:
                    upstream.health_code = 503
                if len(rounds) >= 25 and upstream.health_code == 503 and False in rounds:
                    upstream.health_code = 200
                    back_at = len(rounds)
                await deferLater(reactor, 0.02)
            await poller.stopService()
            self.assertIn(False, rounds)
            self.assertTrue(rounds[-1])
            paths = {s.uri for s in upstream.seen}
            self.assertEqual(paths, {b"/health", b"/v1/models"})
            self.assertEqual({s.method for s in upstream.seen}, {b"GET"})
            self.assertGreaterEqual(len(upstream.seen), 60)

        return ensureDeferred(go())


class TransitionLogTests(TestCase):
    def test_poller_logs_transitions_not_polls(self) -> None:
        """One structured line per healthy/unhealthy change, with the reason; none per
        good poll."""
        events = LogCapture(self).events
        t = _Setup(self, hosts={"a": URLS["a"]}, recovery_polls=1)
        for _ in range(5):
            t.probe.succeed(URLS["a"], ("m",))
            t.clock.advance(INTERVAL)
        t.clock.advance(TIMEOUT)  # the pending poll times out
        mine = [e for e in events if e.get("host") == "a" and "healthy" in e]
        self.assertEqual([e["healthy"] for e in mine], [True, False])
        self.assertEqual(mine[1]["reason"], "health: timed out after 5s")
        self.assertEqual(mine[1]["log_level"].name, "warn")
