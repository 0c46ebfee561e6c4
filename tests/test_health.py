"""The health table's bookkeeping, one docs/design.md §"The health table" rule per test.

No I/O: a ``Clock`` gives the time, results are fed in directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from twisted.internet.task import Clock
from twisted.logger import LogEvent
from twisted.trial.unittest import TestCase

from crossbar.hosts.health import HealthTable, HostStatus
from tests.logs import LogCapture


def table(recovery_polls: int = 2, failure_threshold: int = 1, hosts: tuple[str, ...] = ("a", "b")) -> tuple[HealthTable, Clock]:
    clock = Clock()
    clock.advance(1_000_000)
    return HealthTable(hosts, recovery_polls, failure_threshold, clock.seconds), clock


def status(t: HealthTable, name: str = "a") -> HostStatus:
    s = t.get(name)
    assert s is not None
    return s


class InitialStateTests(TestCase):
    def test_every_host_starts_unhealthy_and_empty(self) -> None:
        """Rule 1: unhealthy, nothing loaded, counters 0, no last_ok, no error."""
        t, _ = table()
        self.assertEqual(tuple(t.all()), ("a", "b"))
        for name in ("a", "b"):
            s = status(t, name)
            self.assertEqual(
                (s.healthy, s.loaded, s.last_ok, s.last_err, s.consecutive, s.failures),
                (False, (), None, "", 0, 0),
            )
            self.assertFalse(t.is_healthy(name))
        self.assertIsNone(t.get("nope"))
        self.assertFalse(t.is_healthy("nope"))


class SuccessTests(TestCase):
    def test_good_poll_bookkeeping(self) -> None:
        """Rule 3: consecutive += 1, failures = 0, last_ok = now, last_err "", loaded replaced
        (empty ids and duplicates dropped, sorted)."""
        t, clock = table(recovery_polls=1, failure_threshold=5)
        t.record_success("a", ["m1"])
        t.record_failure("a", "health: HTTP 503")  # failures 1, still healthy (threshold 5)
        self.assertEqual(status(t).failures, 1)
        clock.advance(7.5)
        t.record_success("a", ["zeta", "", "alpha", "zeta"])
        s = status(t)
        self.assertEqual(s.consecutive, 1)
        self.assertEqual(s.failures, 0)
        self.assertEqual(s.last_ok, clock.seconds())
        self.assertEqual(s.last_err, "")
        self.assertEqual(s.loaded, ("alpha", "zeta"))
        clock.advance(1)
        t.record_success("a", [])
        self.assertEqual(status(t).consecutive, 2)
        self.assertEqual(status(t).loaded, ())  # replaced, not merged
        self.assertEqual(status(t).last_ok, clock.seconds())

    def test_never_failed_host_trusted_on_first_good_poll(self) -> None:
        """Rule 3: a host that never failed is healthy after one good poll, whatever
        recovery_polls says."""
        t, _ = table(recovery_polls=3)
        t.record_success("a", ["m"])
        self.assertTrue(status(t).healthy)
        self.assertFalse(status(t, "b").healthy)  # others untouched


class RecoveryTests(TestCase):
    def test_failed_host_needs_recovery_polls(self) -> None:
        """Rules 3/4: after a failure a host needs recovery_polls good polls in a row."""
        t, _ = table(recovery_polls=3)
        t.record_success("a", ["m"])
        t.record_failure("a", "health: HTTP 503")
        self.assertFalse(status(t).healthy)
        t.record_success("a", ["m"])
        t.record_success("a", ["m"])
        self.assertFalse(status(t).healthy)
        self.assertEqual(status(t).consecutive, 2)
        t.record_success("a", ["m"])
        self.assertTrue(status(t).healthy)

    def test_failure_during_recovery_restarts_count(self) -> None:
        """Rule 4: good polls must be in a row; a failure in between starts over."""
        t, _ = table(recovery_polls=2)
        t.record_failure("a", "health: x")
        t.record_success("a", [])
        t.record_failure("a", "health: y")
        t.record_success("a", [])
        self.assertFalse(status(t).healthy)
        t.record_success("a", [])
        self.assertTrue(status(t).healthy)

    def test_first_poll_failing_needs_recovery_polls(self) -> None:
        """Rule 4: a host whose very first poll fails "has failed" (was unhealthy)."""
        t, _ = table(recovery_polls=2, failure_threshold=3)
        t.record_failure("a", "health: connection refused")
        t.record_success("a", ["m"])
        self.assertFalse(status(t).healthy)
        t.record_success("a", ["m"])
        self.assertTrue(status(t).healthy)

    def test_recovered_host_is_trusted_again(self) -> None:
        """Once recovered, a failed poll below failure_threshold followed by a good one
        leaves the host healthy (a good poll never takes a healthy host down)."""
        t, _ = table(recovery_polls=2, failure_threshold=2)
        t.record_failure("a", "health: x")
        t.record_success("a", [])
        t.record_success("a", [])
        self.assertTrue(status(t).healthy)
        t.record_failure("a", "health: y")  # 1 < threshold 2: stays healthy
        self.assertTrue(status(t).healthy)
        t.record_success("a", [])
        self.assertTrue(status(t).healthy)


class FailureThresholdTests(TestCase):
    def test_trusted_host_goes_down_after_threshold_failures(self) -> None:
        """Rule 4: a healthy host goes down once failures >= failure_threshold."""
        t, _ = table(recovery_polls=2, failure_threshold=3)
        t.record_success("a", ["m"])
        t.record_failure("a", "health: 1")
        t.record_failure("a", "health: 2")
        self.assertTrue(status(t).healthy)
        self.assertEqual(status(t).failures, 2)
        t.record_failure("a", "health: 3")
        self.assertFalse(status(t).healthy)
        self.assertEqual(status(t).failures, 3)
        self.assertEqual(status(t).last_err, "health: 3")
        # and it now "has failed": one good poll is not enough
        t.record_success("a", ["m"])
        self.assertFalse(status(t).healthy)

    def test_good_poll_in_between_resets_failures(self) -> None:
        """Rule 3/4: failures must be in a row; a good poll resets the count."""
        t, _ = table(recovery_polls=2, failure_threshold=2)
        t.record_success("a", [])
        t.record_failure("a", "health: 1")
        t.record_success("a", [])
        self.assertEqual(status(t).failures, 0)
        t.record_failure("a", "health: 2")
        self.assertTrue(status(t).healthy)
        t.record_failure("a", "health: 3")
        self.assertFalse(status(t).healthy)

    def test_threshold_one_is_immediate(self) -> None:
        t, _ = table(failure_threshold=1)
        t.record_success("a", [])
        t.record_failure("a", "models: HTTP 500")
        s = status(t)
        self.assertEqual((s.healthy, s.failures, s.consecutive, s.last_err), (False, 1, 0, "models: HTTP 500"))


class MarkDownTests(TestCase):
    def test_mark_down_is_immediate(self) -> None:
        """Rule 5: healthy = False at once (whatever failure_threshold), consecutive 0,
        last_err "marked down: " + reason, and the host then needs recovery_polls."""
        t, _ = table(recovery_polls=2, failure_threshold=5)
        t.record_success("a", ["m"])
        t.record_success("a", ["m"])
        t.mark_down("a", "connection refused")
        s = status(t)
        self.assertFalse(s.healthy)
        self.assertEqual(s.consecutive, 0)
        self.assertEqual(s.last_err, "marked down: connection refused")
        self.assertEqual(s.loaded, ("m",))
        t.record_success("a", ["m"])
        self.assertFalse(status(t).healthy)
        t.record_success("a", ["m"])
        self.assertTrue(status(t).healthy)

    def test_mark_down_unknown_name_ignored(self) -> None:
        t, _ = table()
        t.record_success("a", [])
        before = t.all()
        t.mark_down("nope", "boom")
        t.record_success("nope", ["x"])
        t.record_failure("nope", "x")
        self.assertEqual(t.all(), before)
        self.assertNotIn("nope", t.all())


class LoadedKeptTests(TestCase):
    def test_loaded_kept_on_failure(self) -> None:
        """Rule 4: a failed poll leaves loaded as last seen."""
        t, clock = table()
        t.record_success("a", ["m2", "m1"])
        ok_at = status(t).last_ok
        clock.advance(10)
        t.record_failure("a", "models: bad JSON: Expecting value")
        s = status(t)
        self.assertEqual(s.loaded, ("m1", "m2"))
        self.assertEqual(s.last_ok, ok_at)
        self.assertEqual(s.consecutive, 0)


class CopiesTests(TestCase):
    def test_readers_get_copies(self) -> None:
        """Rule 8: records are frozen; all() returns a new dict each time."""
        t, _ = table()
        t.record_success("a", ["m"])
        snapshot = t.all()
        s = snapshot["a"]
        with self.assertRaises(dataclasses.FrozenInstanceError):
            s.healthy = False  # type: ignore[misc]
        self.assertIsInstance(s.loaded, tuple)
        snapshot["a"] = HostStatus()
        del snapshot["b"]
        self.assertTrue(status(t).healthy)
        self.assertIn("b", t.all())
        self.assertIsNot(t.all(), t.all())
        # a snapshot does not change when the table does
        t.mark_down("a", "x")
        self.assertTrue(s.healthy)


class TransitionLogTests(TestCase):
    def capture(self) -> list[LogEvent]:
        return LogCapture(self).events

    @staticmethod
    def transitions(events: list[LogEvent]) -> list[dict[str, Any]]:
        return [
            {"host": e["host"], "healthy": e["healthy"], "reason": e["reason"]}
            for e in events
            if "healthy" in e and "host" in e
        ]

    def test_logs_only_transitions(self) -> None:
        """A structured line (host, healthy, reason) when a host changes between healthy
        and unhealthy; none for a good poll that changes nothing."""
        events = self.capture()
        t, _ = table(recovery_polls=2, failure_threshold=2)
        t.record_success("a", ["m"])  # unhealthy -> healthy
        for _ in range(5):
            t.record_success("a", ["m"])  # nothing
        t.record_failure("a", "health: HTTP 503")  # below threshold: nothing
        t.record_failure("a", "health: HTTP 502")  # -> unhealthy
        t.record_failure("a", "health: HTTP 501")  # still unhealthy: nothing
        t.record_success("a", [])  # 1 of 2: nothing
        t.record_success("a", [])  # -> healthy
        t.mark_down("a", "reset by peer")  # -> unhealthy
        t.mark_down("a", "again")  # nothing
        got = self.transitions(events)
        self.assertEqual(
            [(g["host"], g["healthy"]) for g in got],
            [("a", True), ("a", False), ("a", True), ("a", False)],
        )
        self.assertEqual(got[1]["reason"], "health: HTTP 502")
        self.assertEqual(got[3]["reason"], "marked down: reset by peer")
        self.assertTrue(got[0]["reason"])
        self.assertTrue(got[2]["reason"])
        # the rendered text carries the reason too
        from twisted.logger import formatEvent

        down = [e for e in events if e.get("healthy") is False]
        self.assertIn("health: HTTP 502", formatEvent(down[0]))
        self.assertIn("a", formatEvent(down[0]))

    def test_logs_a_host_unhealthy_from_the_start(self) -> None:
        """A host whose first poll fails never changes state, yet the operator hears of
        it once; later failed polls stay quiet."""
        events = self.capture()
        t, _ = table(recovery_polls=2, failure_threshold=1)
        t.record_failure("a", "health: connection refused")
        t.record_failure("a", "health: connection refused")
        got = self.transitions(events)
        self.assertEqual(got, [{"host": "a", "healthy": False, "reason": "health: connection refused"}])


class HostTextInTheLogTests(TestCase):
    def test_model_ids_are_escaped_in_the_transition_line(self) -> None:
        """A host's model ids are its own text: a terminal escape or a lone surrogate
        is escaped in the line (the surrogate once lost the line from a UTF-8 log)."""
        from twisted.logger import formatEvent

        log = LogCapture(self)
        t, _ = table(recovery_polls=1, hosts=("a",))
        t.record_success("a", ["m\x1b[31mRED", "\ud800"])
        [line] = [formatEvent(e) for e in log.events if "is healthy" in formatEvent(e)]
        self.assertEqual(line, "host a is healthy: 1 good poll(s) in a row (models: m\\x1b[31mRED, \\ud800)")
        line.encode("utf-8")  # no lone surrogate left

    def test_a_host_listing_thousands_of_models_gets_a_short_line(self) -> None:
        """The line names the first 20 loaded ids and counts the rest (a host listing
        20,000 made a 180 KB line)."""
        from twisted.logger import formatEvent

        log = LogCapture(self)
        t, _ = table(recovery_polls=1, hosts=("a",))
        t.record_success("a", [f"m{i:05d}" for i in range(20_000)])
        [event] = [e for e in log.events if "is healthy" in formatEvent(e)]
        names = ", ".join(f"m{i:05d}" for i in range(20))
        self.assertEqual(formatEvent(event),
                         f"host a is healthy: 1 good poll(s) in a row (models: {names} and 19980 more)")
        self.assertEqual(len(event["loaded"]), 20)

    def test_a_router_mode_host_says_how_many_models_it_can_load(self) -> None:
        """A router-mode host with nothing loaded is not "models: none": the line says
        how many it lists as loading and available (issue 29, item 13)."""
        from twisted.logger import formatEvent

        from crossbar.hosts.models import ModelList

        log = LogCapture(self)
        t, _ = table(recovery_polls=1, hosts=("r", "s", "e"))
        t.record_success("r", ModelList(available=("tiny-a", "tiny-b", "x"), router=True))
        t.record_success("s", ModelList(loaded=("tiny-a",), loading=("tiny-b",), available=("x",), router=True))
        t.record_success("e", [])
        lines = [formatEvent(e) for e in log.events if "is healthy" in formatEvent(e)]
        self.assertEqual(lines, [
            "host r is healthy: 1 good poll(s) in a row (models: none loaded; 3 available)",
            "host s is healthy: 1 good poll(s) in a row (models: tiny-a; 1 loading, 1 available)",
            "host e is healthy: 1 good poll(s) in a row (models: none)",
        ])


class SignOfLifeTests(TestCase):
    """A host slow on one request is busy, not dead, when it showed another sign of
    life since (docs/design.md §The proxy rule 7; issue 20 item 5)."""

    def test_a_good_poll_or_a_byte_of_an_answer_since(self) -> None:
        clock = Clock()
        table = HealthTable(["a", "b"], 2, 1, clock.seconds)
        table.record_success("a", ["m"])
        clock.advance(10)
        self.assertFalse(table.alive_since("a", 5.0))  # the poll was before
        self.assertTrue(table.alive_since("a", 0.0))
        table.life_sign("b").at = 12.0
        self.assertTrue(table.alive_since("b", 11.0))
        self.assertFalse(table.alive_since("b", 12.5))
        clock.advance(5)
        table.record_success("a", ["m"])
        self.assertTrue(table.alive_since("a", 14.0))
        self.assertFalse(table.alive_since("unknown", 0.0))
        table.life_sign("unknown").at = 20.0  # a host the table does not track: noted nowhere
        self.assertFalse(table.alive_since("unknown", 0.0))
        a_life, b_life = table.life_sign("a"), table.life_sign("b")
        self.assertIs(table.life_sign("a"), a_life)  # one sign per host: relays in flight note into it
        a_life.at = 16.0
        table.set_hosts(["a", "b"], reset=["b"])  # b's URL changed: its signs of life were another host's
        self.assertTrue(table.alive_since("a", 16.0))
        b_life.at = 30.0  # a relay of the old host's answer, still in flight
        self.assertFalse(table.alive_since("b", 0.0))
        self.assertIsNot(table.life_sign("b"), b_life)
