"""Unit tests of how :class:`crossbar.state.cluster.RedisCluster` sends its commands
(docs/design.md §Several crossbars): the one watchdog that bounds every reply, EVALSHA
with the script's hash, and how often this instance writes. A fake connection stands in
for txredisapi's (same methods); the tests with a real Redis are tests/test_cluster.py."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from twisted.internet.defer import Deferred, TimeoutError, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

import txredisapi

from crossbar.config import RedisURL
from crossbar.state import cluster as cluster_module
from crossbar.state.cluster import BOUND, FLUSH, GAP, RedisCluster


class FakeConnection:
    """txredisapi's connection as RedisCluster uses it: ``execute_command`` and ``eval``.

    :ivar sent: every command's arguments, in order.
    :ivar replies: the Deferred of each command (answered at once with ``answer`` unless
        ``answer`` is None: then left for the test to fire).
    """

    connected = 1

    def __init__(self, answer: Any = "{}") -> None:
        self.answer = answer
        self.sent: list[tuple[Any, ...]] = []
        self.replies: list[Deferred[Any]] = []
        self.evals: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any) -> Deferred[Any]:
        self.sent.append(args)
        d: Deferred[Any] = succeed(self.answer) if self.answer is not None else Deferred()
        self.replies.append(d)
        return d

    def eval(self, script: str, keys: Any, args: Any) -> Deferred[Any]:
        self.evals.append((script, tuple(keys), tuple(args)))
        return succeed("evaluated")


class FakeFactory:
    def __init__(self, connection: FakeConnection) -> None:
        self.pool = [connection]


def cluster(connection: FakeConnection) -> tuple[RedisCluster, Clock]:
    clock = Clock()
    c = RedisCluster(RedisURL(tls=False, host="127.0.0.1", port=6379), clock, instance="me")
    c.link.factory = FakeFactory(connection)
    return c, clock


def outcome(d: Deferred[Any]) -> list[Any]:
    out: list[Any] = []
    d.addBoth(out.append)
    return out


class Watchdog(SynchronousTestCase):
    def test_one_timer_bounds_every_command(self) -> None:
        """Every command's reply is bounded by BOUND, with one timer for all of them."""
        conn = FakeConnection(answer=None)
        c, clock = cluster(conn)
        first = [outcome(c.command("eval", "return 1", [], [])) for _ in range(3)]
        clock.advance(BOUND / 2)
        late = outcome(c.command("eval", "return 1", [], []))
        self.assertEqual(len(clock.getDelayedCalls()), 1)
        conn.replies[0].callback("ok")
        self.assertEqual(first[0], ["ok"])
        clock.advance(BOUND / 2)  # the first three's bound has passed
        for out in first[1:]:
            self.assertEqual(len(out), 1)
            self.assertIsInstance(out[0], Failure)
            out[0].trap(TimeoutError)
        self.assertEqual(late, [])
        clock.advance(BOUND / 2)
        self.assertIsInstance(late[0], Failure)
        late[0].trap(TimeoutError)
        self.assertEqual(clock.getDelayedCalls(), [])

    def test_shorter_bound_after_longer(self) -> None:
        """A command with a shorter bound than one already waiting still fails on time."""
        conn = FakeConnection(answer=None)
        c, clock = cluster(conn)
        long = outcome(c.command("eval", "return 1", [], [], bound=0.5))
        short = outcome(c.command("eval", "return 2", [], []))
        clock.advance(BOUND)
        self.assertEqual(long, [])
        short[0].trap(TimeoutError)
        clock.advance(0.5)
        long[0].trap(TimeoutError)

    def test_not_connected(self) -> None:
        conn = FakeConnection()
        conn.connected = 0
        c, clock = cluster(conn)
        outcome(c.command("eval", "return 1", [], []))[0].trap(txredisapi.ConnectionError)
        self.assertEqual(clock.getDelayedCalls(), [])


class Scripts(SynchronousTestCase):
    def test_evalsha(self) -> None:
        """A script goes as EVALSHA with its SHA1 (not its text)."""
        conn = FakeConnection(answer="1")
        c, _ = cluster(conn)
        self.assertEqual(outcome(c.command("eval", "return 1", ["k"], ["a", 2])), ["1"])
        sha = hashlib.sha1(b"return 1").hexdigest()
        self.assertEqual(conn.sent, [("EVALSHA", sha, 1, "k", "a", 2)])

    def test_noscript_sends_the_script(self) -> None:
        """Redis that does not know the script (restarted, flushed) gets its text."""
        conn = FakeConnection(answer=None)
        c, _ = cluster(conn)
        out = outcome(c.command("eval", "return 1", ["k"], ["a"]))
        conn.replies[0].errback(txredisapi.ResponseError("NOSCRIPT No matching script."))
        self.assertEqual(out, ["evaluated"])
        self.assertEqual(conn.evals, [("return 1", ("k",), ("a",))])

    def test_other_errors_pass(self) -> None:
        conn = FakeConnection(answer=None)
        c, _ = cluster(conn)
        out = outcome(c.command("eval", "return 1", [], []))
        conn.replies[0].errback(txredisapi.ResponseError("ERR wrong"))
        out[0].trap(txredisapi.ResponseError)
        self.assertEqual(conn.evals, [])


def written(conn: FakeConnection) -> list[dict[str, int]]:
    """The fields of each write (its PUBLISHed message's)."""
    return [json.loads(args[9])[2] for args in conn.sent if args[9]]


class Writes(SynchronousTestCase):
    def setUp(self) -> None:
        self.conn = FakeConnection()
        self.c, self.clock = cluster(self.conn)
        self.c.joined = True

    def test_rise_gathers_for_flush(self) -> None:
        self.c.set("h\0a", 1)
        self.c.set("h\0b", 1)
        self.clock.advance(FLUSH * 0.9)
        self.assertEqual(written(self.conn), [])
        self.clock.advance(FLUSH * 0.1)
        self.assertEqual(written(self.conn), [{"h\0a": 1, "h\0b": 1}])

    def test_fall_goes_at_the_end_of_the_turn(self) -> None:
        """A freed slot after a quiet spell is written at once (with any rise pending)."""
        self.c.set("h\0a", 2)
        self.clock.advance(FLUSH)
        self.clock.advance(1)
        self.c.set("h\0b", 1)
        self.c.set("h\0a", 1)
        self.clock.advance(0)
        self.assertEqual(written(self.conn), [{"h\0a": 2}, {"h\0a": 1, "h\0b": 1}])

    def test_writes_at_most_every_gap(self) -> None:
        """Right after a write, changes gather until GAP has passed: under load one write
        carries many requests' changes (and a freed slot still goes within GAP)."""
        self.c.set("h\0a", 1)
        self.clock.advance(FLUSH)
        self.assertEqual(len(written(self.conn)), 1)
        for n in (2, 3, 2, 1, 0, 1):
            self.c.set("h\0a", n)
            self.clock.advance(GAP / 10)
        self.assertEqual(len(written(self.conn)), 1)
        self.clock.advance(GAP - 6 * GAP / 10 - 1e-6)
        self.assertEqual(len(written(self.conn)), 1)
        self.clock.advance(2e-6)
        self.assertEqual(written(self.conn), [{"h\0a": 1}, {"h\0a": 1}])

    def test_alone_writes_nothing(self) -> None:
        self.c.joined = False
        self.c.set("h\0a", 1)
        self.c.set("h\0a", 0)
        self.clock.advance(1)
        self.assertEqual(self.conn.sent, [])


class Drains(SynchronousTestCase):
    """Host drains through Redis (docs/design.md §Several crossbars, §Operations)."""

    def test_drain_while_alone_is_written_on_rejoining(self) -> None:
        conn = FakeConnection()
        c, clock = cluster(conn)
        told: list[tuple[dict[str, bool], bool]] = []
        c.on_drains = lambda drains, whole: told.append((drains, whole))
        c.drain("h", True)
        self.assertEqual(conn.sent, [])
        c._read(json.dumps({"#drained": {}}))  # Redis answers again: joined
        drains = [args[3:] for args in conn.sent if args[1] == hashlib.sha1(cluster_module._DRAIN.encode()).hexdigest()]
        self.assertEqual(drains, [("crossbar:drained", "crossbar:0:drains", "h", "1")])
        self.assertEqual(told, [])  # that read did not know of it yet
        c._read(json.dumps({"#drained": ["h"]}), c._drain_writes)
        self.assertEqual(told, [({"h": True}, True)])

    def test_a_read_older_than_a_drain_is_not_applied(self) -> None:
        conn = FakeConnection()
        c, clock = cluster(conn)
        c.joined = True
        told: list[tuple[dict[str, bool], bool]] = []
        c.on_drains = lambda drains, whole: told.append((drains, whole))
        sent_at = c._drain_writes
        c.drain("h", True)
        c._read(json.dumps({"#drained": {}}), sent_at)
        self.assertEqual(told, [])
        c.drain_message(json.dumps(["h", "0"]))
        self.assertEqual(told, [({"h": False}, False)])


class Settling(SynchronousTestCase):
    """Readiness waits until the first connection to Redis succeeded or failed, at most
    SETTLE seconds (docs/design.md §Several crossbars)."""

    def start(self) -> tuple[RedisCluster, MemoryReactorClock]:
        reactor = MemoryReactorClock()
        c = RedisCluster(RedisURL(tls=False, host="127.0.0.1", port=6379), reactor, instance="me")
        c.start()
        self.addCleanup(c.stop)
        return c, reactor

    def test_at_most_settle_seconds(self) -> None:
        """A connection that neither succeeds nor fails (a black-holed address)."""
        c, reactor = self.start()
        reactor.advance(cluster_module.SETTLE - 0.01)
        self.assertFalse(c.settled)
        reactor.advance(0.01)
        self.assertTrue(c.settled)
        self.assertFalse(c.joined)

    def test_at_the_first_refused_connection(self) -> None:
        c, reactor = self.start()
        host, port, factory, _, _ = reactor.tcpClients[0]
        self.assertEqual((host, port), ("127.0.0.1", 6379))
        factory.clientConnectionFailed(None, Failure(ConnectionRefusedError()))
        reactor.advance(0.5)  # HostnameEndpoint gives up on its addresses after 0.3 s
        self.assertTrue(c.settled)
        self.assertFalse(c.joined)

    def test_when_joined(self) -> None:
        c, reactor = self.start()
        factory, c.link.factory = c.link.factory, FakeFactory(FakeConnection())  # connected: Redis answers
        c._read(json.dumps({"#drained": {}}))
        self.assertTrue(c.settled and c.joined)
        c.link.factory = factory
