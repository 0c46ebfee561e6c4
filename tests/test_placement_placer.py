"""The Placer's commands against hosts that answer late, refuse or never load
(docs/design.md §Where models live, rules 1 and 5-7): a load in flight keeps its mark,
two routes or a name and its alias load a kept model once, a refused command is no
load and is logged by streaks, a kept model no host lists is warned of once."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred
from twisted.internet.task import Clock
from twisted.logger import LogLevel, formatEvent
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from crossbar.config import Host, parse_config
from crossbar.hosts.commands import CommandFailed, HTTPModelCommands
from crossbar.state.placer import Placer
from crossbar.state.runtime import Runtime
from crossbar.upstream.pools import UpstreamPools
from tests.harness import listen, wait_for
from tests.logs import LogCapture
from tests.test_placement import _listed


def config(routes: str, hosts: str = "ab", first_byte: float = 8) -> str:
    """Router-mode hosts ``hosts`` (models_max 2) and the ``routes:`` block ``routes``."""
    lines = [f'  {h}: {{url: "http://127.0.0.1:{9001 + i}", models_max: 2}}' for i, h in enumerate(hosts)]
    return (f'listen: "tcp:0"\nhealth: {{interval: 1, timeout: 1}}\ntimeouts: {{first_byte: {first_byte}}}\n'
            "hosts:\n" + "\n".join(lines) + "\nroutes:\n" + routes)


class _Commands:
    """The Placer's commands, each a Deferred the test answers (or never does)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []
        self.pending: list[Deferred[None]] = []

    def send(self, host: Host, action: str, model: str) -> Deferred[None]:
        self.sent.append((host.name, action, model))
        d: Deferred[None] = Deferred()
        self.pending.append(d)
        return d

    def answer(self, result: Any = None) -> None:
        """Answer the oldest pending command (None: accepted; an exception: failed)."""
        d = self.pending.pop(0)
        if isinstance(result, BaseException):
            d.errback(Failure(result))
        else:
            d.callback(result)


class _Case(SynchronousTestCase):
    routes = "  r: {hosts: [a, b], placement: {keep_loaded: [m1]}}\n"
    hosts = "ab"

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(100)
        self.runtime = Runtime(parse_config(config(self.routes, self.hosts)), self.clock.seconds)
        self.commands = _Commands()
        self.placer = Placer(self.runtime, self.commands, self.clock)
        self.moves: list[tuple[str, str, str, str]] = []
        self.runtime.placement.on_move = lambda *move: self.moves.append(move)
        self.failures: list[tuple[str, str, str]] = []
        self.placer.on_failure = lambda *failure: self.failures.append(failure)
        self.addCleanup(self.placer.stop)
        for h in self.hosts:
            self.list(h, m1="unloaded", m2="unloaded")

    def list(self, host: str, **states: str) -> None:
        """A good poll of ``host`` that lists ``states`` was recorded (not yet told the Placer)."""
        self.runtime.table.record_success(host, _listed(**states))

    def poll(self, host: str, took: float = 0.1, **states: str) -> None:
        """A good poll of ``host`` listing ``states`` (default: what it listed last), told the Placer."""
        if states:
            self.list(host, **states)
        self.placer.polled(host, took, True)


class InFlightTests(_Case):
    def test_a_load_in_flight_keeps_counting_as_loading(self) -> None:
        """Item 1: the host has not answered the load yet, so its polls do not show the
        model loading: the mark stays while the command is in flight (no copy on the
        other host); it ends when the command fails."""
        self.poll("a")
        self.assertEqual(self.commands.sent, [("a", "load", "m1")])
        for _ in range(3):
            self.clock.advance(1)
            self.poll("a")
            self.poll("b")
        self.assertEqual(self.commands.sent, [("a", "load", "m1")])
        self.assertIn(("a", "m1"), self.runtime.placement.loading)
        self.commands.answer(CommandFailed("HTTP 500", "http_5xx"))
        self.assertEqual(self.runtime.placement.loading, {})

    def test_a_poll_that_started_before_the_host_accepted_says_nothing(self) -> None:
        """The host accepted the load during a poll: that poll may not show it loading
        yet and keeps the mark; the next one, which does not show it either, ends it."""
        self.poll("a")
        self.clock.advance(1)
        self.commands.answer()
        self.clock.advance(0.5)
        self.poll("a", took=1.0)  # started before the answer
        self.poll("b")
        self.assertEqual(self.commands.sent, [("a", "load", "m1")])
        self.clock.advance(1)
        self.poll("a", took=0.1)  # started after it: the host did not load it, so it is told again
        self.assertEqual(self.commands.sent, [("a", "load", "m1")] * 2)
        self.assertEqual(self.runtime.placement.loading[("a", "m1")].since, 102.5)

    def test_the_bound_still_ends_a_hanging_load(self) -> None:
        self.poll("a")
        self.clock.advance(8)
        self.placer.tick()
        self.assertEqual(self.runtime.placement.loading, {})
        self.assertEqual(self.failures, [("a", "load", "timeout")])


class OneCopyTests(_Case):
    routes = ("  r1: {hosts: [a, b, c], placement: {keep_loaded: [m1]}}\n"
              "  r2: {hosts: [a, b, c], placement: {keep_loaded: [m1]}}\n")
    hosts = "abc"

    def test_two_routes_keeping_one_model_load_it_once(self) -> None:
        self.poll("a")
        self.assertEqual(self.commands.sent, [("a", "load", "m1")])


class AliasTests(_Case):
    routes = "  r: {hosts: [a, b], placement: {keep_loaded: [m1, alias-of-m1], idle_unload: 10}}\n"

    def test_a_model_and_its_alias_load_once(self) -> None:
        self.poll("a")
        self.assertEqual(self.commands.sent, [("a", "load", "m1")])

    def test_a_model_kept_by_its_alias_is_never_idle(self) -> None:
        self.runtime.reconfigure(parse_config(config(
            "  r: {hosts: [a, b], placement: {keep_loaded: [alias-of-m1], idle_unload: 10}}\n")))
        self.poll("a", m1="loaded", m2="loaded")
        self.clock.advance(11)
        self.poll("a")
        self.assertEqual(self.commands.sent, [("a", "unload", "m2")])


class FailedCommandTests(_Case):
    routes = "  r: {hosts: [a], placement: {keep_loaded: [m1]}}\n"
    hosts = "a"

    def warnings(self, log: LogCapture) -> list[str]:
        return [formatEvent(e) for e in log.events if e.get("log_level") == LogLevel.warn]

    def test_a_refused_load_is_no_load(self) -> None:
        """Item 4: a failed command caused no load (rule 7): no metric, no last load;
        it counts as a failed command; an accepted one counts as a load."""
        self.poll("a")
        self.commands.answer(CommandFailed("HTTP 500", "http_5xx"))
        self.assertEqual((self.moves, self.runtime.placement.last_load), ([], {}))
        self.assertEqual(self.failures, [("a", "load", "http_5xx")])
        self.clock.advance(1)
        self.poll("a")
        self.commands.answer()
        self.assertEqual(self.moves, [("a", "m1", "load", "keep")])
        self.assertEqual(self.runtime.placement.last_load["a"].model, "m1")

    def test_a_failing_command_is_logged_by_streak(self) -> None:
        log = LogCapture(self)
        for _ in range(1000):
            self.poll("a")
            self.commands.answer(CommandFailed("HTTP 500", "http_5xx"))
            self.clock.advance(1)
        self.assertEqual(len(self.commands.sent), 1000)  # retried at each poll (rule 6)
        warned = self.warnings(log)
        self.assertEqual(len(warned), 4, warned)
        self.assertEqual(warned[0], "host a: load m1 failed: HTTP 500 (again after its next poll)")
        self.assertIn("10 failures in a row", warned[1])
        self.assertIn("1000 failures in a row", warned[3])
        sends = [formatEvent(e) for e in log.events if formatEvent(e) == "host a: load m1 (keep)"]
        self.assertEqual(len(sends), 1)  # the retries are not logged again
        self.poll("a")
        self.commands.answer()
        self.assertIn("host a: load m1 done after 1000 failures", [formatEvent(e) for e in log.events])
        self.assertEqual(len(self.failures), 1000)

    def test_a_host_that_accepts_but_never_loads_is_warned_of_once(self) -> None:
        log = LogCapture(self)
        for _ in range(6):
            self.poll("a")
            self.commands.answer()
            self.clock.advance(1)
        self.assertEqual(len(self.commands.sent), 6)
        self.assertEqual(self.warnings(log), ["host a accepted load m1 3 times but never listed it loading"])

    def test_error_texts(self) -> None:
        """Item 5: a command with no answer within the bound says so."""
        log = LogCapture(self)
        self.poll("a")
        self.clock.advance(8)
        self.assertEqual(self.warnings(log), ["host a: load m1 failed: no answer within 8 s (again after its next poll)"])


class UnlistedKeepTests(_Case):
    routes = "  r: {hosts: [a, b], placement: {keep_loaded: [m1, nosuch]}}\n"

    def test_a_kept_model_no_host_lists_is_warned_of_once(self) -> None:
        log = LogCapture(self)
        fresh = Runtime(parse_config(config(self.routes)), self.clock.seconds)
        placer = Placer(fresh, self.commands, self.clock)
        fresh.table.record_success("a", _listed(m1="unloaded"))
        placer.polled("a", 0.1, True)  # b not polled yet: nothing said

        def warned() -> list[str]:
            return [formatEvent(e) for e in log.events if "keep_loaded" in (formatEvent(e) or "")]
        self.assertEqual(warned(), [])
        for _ in range(3):
            fresh.table.record_success("b", _listed(m1="unloaded"))
            placer.polled("b", 0.1, True)
            placer.polled("a", 0.1, True)
        self.assertEqual(warned(), ["route r: keep_loaded model nosuch is listed by no host of the route"])
        from crossbar.ops.app import route_placement
        self.assertEqual(route_placement(fresh, fresh.config.routes["r"]),
                         {"keep_loaded": ["m1", "nosuch"], "unlisted": ["nosuch"]})
        fresh.table.record_success("b", _listed(m1="unloaded", nosuch="unloaded"))
        placer.polled("b", 0.1, True)
        fresh.table.record_success("b", _listed(m1="unloaded"))
        placer.polled("b", 0.1, True)
        self.assertEqual(len(warned()), 2)  # seen listed, then missing again


class _Odd(Resource):
    """A host whose commands hang (``hang``), or answer 200 with a body too large (``huge``)."""

    isLeaf = True

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.hung: list[Request] = []

    def render_POST(self, request: Request) -> Any:
        if self.mode == "hang":
            self.hung.append(request)
            return NOT_DONE_YET
        return b"x" * 100_000


class CommandTextTests(TestCase):
    """Item 5: the real commands' failures read as what happened, not a class name."""

    async def placer(self, mode: str) -> tuple[Placer, LogCapture]:
        from twisted.internet import reactor
        url = await listen(self, _Odd(mode))
        text = config("  r: {hosts: [a], placement: {keep_loaded: [m1]}}\n", "a", first_byte=0.3)
        runtime = Runtime(parse_config(text.replace("http://127.0.0.1:9001", url)), reactor.seconds)
        runtime.table.record_success("a", _listed(m1="unloaded"))
        pools = UpstreamPools(reactor, 5)
        self.addCleanup(pools.close)
        placer = Placer(runtime, HTTPModelCommands(pools), reactor)
        failures: list[tuple[str, str, str]] = []
        placer.on_failure = lambda *f: failures.append(f)
        self.addCleanup(placer.stop)
        log = LogCapture(self)
        placer.polled("a", 0.0, True)
        await wait_for(lambda: bool(failures), what="the command's failure")
        return placer, log

    def warned(self, log: LogCapture) -> list[str]:
        return [formatEvent(e) for e in log.events if e.get("log_level") == LogLevel.warn]

    def test_no_answer(self) -> Deferred[None]:
        async def go() -> None:
            _, log = await self.placer("hang")
            self.assertEqual(self.warned(log), ["host a: load m1 failed: no answer within 0.3 s "
                                                "(again after its next poll)"])
        return ensureDeferred(go())

    def test_an_answer_too_large(self) -> Deferred[None]:
        async def go() -> None:
            _, log = await self.placer("huge")
            self.assertEqual(self.warned(log), ["host a: load m1 failed: answer over 65536 bytes "
                                                "(again after its next poll)"])
        return ensureDeferred(go())


class IdleUnloadTests(_Case):
    """Rule 4 against hosts that answer an unload and keep the model, or never answer,
    and while crossbar drains (found by an attack run: a re-unload every poll, every
    request for the model answered 503)."""

    routes = "  r: {hosts: [a], placement: {idle_unload: 10}}\n"
    hosts = "a"

    def setUp(self) -> None:
        super().setUp()
        self.list("a", m1="loaded", m2="unloaded")

    def unloads(self) -> list[tuple[str, str, str]]:
        return [c for c in self.commands.sent if c[1] == "unload"]

    def test_a_host_that_answers_the_unload_and_keeps_the_model_is_not_told_again_at_once(self) -> None:
        log = LogCapture(self)
        self.poll("a")  # m1 first seen loaded at 100
        self.clock.advance(10)
        self.poll("a")
        self.assertEqual(self.unloads(), [("a", "unload", "m1")])
        self.commands.answer()  # {"success": true}, and m1 stays
        for _ in range(2):
            self.clock.advance(1)
            self.poll("a")
        self.assertEqual(self.runtime.placement.unloading, {})  # the mark ended: m1 takes requests
        self.assertEqual(self.failures, [("a", "unload", "kept")])
        self.assertEqual([m for m in self.moves if m[2] == "unload"], [])  # kept: no unload counted
        self.assertNotIn("a", self.runtime.placement.last_unload)
        for _ in range(9):
            self.clock.advance(1)
            self.poll("a")
        self.assertEqual(self.unloads(), [("a", "unload", "m1")])  # not before another idle_unload
        self.clock.advance(1)
        self.poll("a")
        self.assertEqual(self.unloads(), [("a", "unload", "m1")] * 2)
        warnings = [formatEvent(e) for e in log.events if e["log_level"] is LogLevel.warn]
        self.assertEqual(warnings, ["host a: unload m1 failed: the host answered it but still lists the model "
                                    "loaded (not again before another idle_unload)"])

    def test_an_unload_counts_once_a_poll_shows_it_done(self) -> None:
        """Rule 7: the unload metric and status's last unload count what the host did:
        answered, then gone at a poll (not the answer alone, which a host may not keep)."""
        self.poll("a")
        self.clock.advance(10)
        self.poll("a")
        self.commands.answer()
        self.assertEqual(self.moves, [])
        self.clock.advance(1)
        self.poll("a", m1="unloaded", m2="unloaded")
        self.assertEqual(self.moves, [("a", "m1", "unload", "idle")])
        self.assertEqual(self.runtime.placement.last_unload["a"].model, "m1")

    def test_a_failed_unload_waits_another_idle_unload(self) -> None:
        self.poll("a")
        self.clock.advance(10)
        self.poll("a")
        self.commands.answer(CommandFailed("HTTP 500", "http_5xx"))
        for _ in range(9):
            self.clock.advance(1)
            self.poll("a")
        self.assertEqual(self.unloads(), [("a", "unload", "m1")])
        self.clock.advance(1)
        self.poll("a")
        self.assertEqual(self.unloads(), [("a", "unload", "m1")] * 2)

    def test_a_model_a_queued_request_waits_for_is_not_idle(self) -> None:
        class Waiter:
            route_name, queued_at, model, key = "r", 100.0, "m1", ""

            def retry(self) -> bool:
                return False

        self.runtime.queues.add(Waiter())  # type: ignore[arg-type]
        self.poll("a")
        self.clock.advance(30)
        self.poll("a")
        self.assertEqual(self.unloads(), [])

    def test_a_draining_crossbar_unloads_nothing(self) -> None:
        self.poll("a")
        self.clock.advance(30)
        self.runtime.draining = True
        self.poll("a")
        self.assertEqual(self.unloads(), [])
