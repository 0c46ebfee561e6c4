"""Placement shared across workers and instances (docs/design.md §Where models live, rules 4
and 7; §Workers; §Several crossbars): one process's load counts as loading for another's
choice at once, one process's unload as not loaded for the other's (no request into
it, no second command), a model in flight through one is in use for the other, the
last use is the latest of all; through the workers' shared counts and through a
cluster view."""

from __future__ import annotations

import os
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import ConfigError, Host, parse_config
from crossbar.hosts.balance import Chosen, Fit
from crossbar.state.placement_share import SLOTS, ClusterShare, WorkerShare, fingerprint, share_names
from crossbar.state.placer import Placer
from crossbar.state.runtime import Runtime
from crossbar.state.shared import SharedCounts
from crossbar.state.worker_counts import WorkerCounts, check_capacity
from tests.test_placement import CONFIG, _listed


class _FakeCluster:
    """Two instances' views of one shared store: what ``others`` and ``largest`` read."""

    def __init__(self, store: dict[str, dict[str, int]], me: str) -> None:
        self.store, self.me, self.joined = store, me, True

    def set(self, name: str, value: int) -> None:
        self.store.setdefault(self.me, {})[name] = value

    def others(self, name: str) -> int:
        return sum(v.get(name, 0) for k, v in self.store.items() if k != self.me)

    def largest(self, name: str) -> int:
        return max((v.get(name, 0) for k, v in self.store.items() if k != self.me), default=0)

    def unsettled(self, name: str) -> bool:
        return False

    def instances(self) -> int:
        return len(self.store)

    def take(self, name: str, value: int, limit: int) -> Any:
        """As the real one's script: set ``value`` only while every instance's counts stay
        within ``limit``, in one step."""
        if sum(v.get(name, 0) for k, v in self.store.items() if k != self.me) + value > limit:  # Redis's own
            return succeed(False)
        self.set(name, value)
        return succeed(True)


def idle_placers(a: Runtime, b: Runtime, clock: Clock) -> list[tuple[Placer, "_Commands"]]:
    """A Placer (and its noted commands) for each of ``a`` and ``b``, reconfigured with
    ``idle_unload: 10`` on route ``r``."""
    config = parse_config(CONFIG.replace("{spread_after: 5}", "{spread_after: 5, idle_unload: 10}"))
    placers: list[tuple[Placer, _Commands]] = []
    for runtime in (a, b):
        runtime.reconfigure(config)
        commands = _Commands()
        placers.append((Placer(runtime, commands, clock), commands))
    return placers


class _Commands:
    """The Placer's commands, noted and never answered (the host is still at it)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, str]] = []

    def send(self, host: Host, action: str, model: str) -> Deferred[None]:
        self.sent.append((host.name, action, model))
        return Deferred()


class _Shared:
    """The same checks for each way of sharing (mixed into a TestCase)."""

    clock: Clock

    def runtimes(self) -> tuple[Runtime, Runtime]:
        raise NotImplementedError

    def setUp(self) -> None:
        self.clock = Clock()
        self.clock.advance(1_000_000)
        self.a, self.b = self.runtimes()
        for runtime in (self.a, self.b):
            for h in "abc":
                runtime.table.record_success(h, _listed(x="unloaded", y="loaded"))

    def test_an_unload_one_process_saw_refused_restarts_everyones_idle_time(self) -> None:
        """Rule 4: A's unload of y failed (or the host kept y): y's idle time starts again
        in B too, so B does not send the next unload at once (an attack run saw each
        worker and instance of a set send its own, one after another)."""
        tc: Any = self
        tc.assertEqual(self.b.placement.idle_since("a", "y"), None)
        self.a.placement.unloading_started("a", "y")
        self.clock.advance(5)
        self.a.placement.unload_refused("a", "y")
        tc.assertEqual(self.b.placement.idle_since("a", "y"), 1_000_005.0)
        tc.assertFalse(self.b.placement.others_unloading("a", "y"))

    def test_a_load_by_one_is_loading_for_the_other(self) -> None:
        route = self.a.config.routes["r"]
        first = self.a.choose(route, "x", None, [])
        assert isinstance(first, Chosen)
        tc: Any = self
        second = self.b.choose(self.b.config.routes["r"], "x", None, [])
        assert isinstance(second, Chosen)
        tc.assertEqual((second.host, second.fit, second.load), (first.host, Fit.LOADING, ""))
        self.a.placement.drop(first.host, "x")  # a poll settled it there
        third = self.b.choose(self.b.config.routes["r"], "x", None, [])
        assert isinstance(third, Chosen)
        tc.assertEqual(third.load, "load")

    def test_a_settled_load_lingers_for_the_others_until_their_polls(self) -> None:
        tc: Any = self
        first = self.a.choose(self.a.config.routes["r"], "x", None, [])
        assert isinstance(first, Chosen)
        self.a.placement.drop(first.host, "x", linger=2.0)  # a's poll saw it loaded
        tc.assertEqual(self.a.placement.loading, {})
        share = self.b.placement.share
        assert share is not None
        tc.assertTrue(share.loading(first.host, "x"))
        self.clock.advance(1)
        self.a.placement.expire(300)
        tc.assertTrue(share.loading(first.host, "x"))
        self.clock.advance(1)
        self.a.placement.expire(300)
        tc.assertFalse(share.loading(first.host, "x"))

    def hosts_chosen(self, runtime: Runtime, model: str) -> set[str]:
        """The hosts ``runtime`` chooses for ``model`` in six choices in a row (ties go
        round-robin: every host that has it loaded)."""
        out = set()
        for _ in range(6):
            chosen = runtime.choose(runtime.config.routes["r"], model, None, [])
            assert isinstance(chosen, Chosen)
            out.add(chosen.host)
        return out

    def test_an_unload_by_one_is_not_loaded_for_the_other(self) -> None:
        """Rule 4: from one process's unload command until its poll shows the model gone,
        the other sends no request for it to that host (the host would cut it)."""
        tc: Any = self
        placement = self.a.placement
        tc.assertEqual(self.hosts_chosen(self.b, "y"), {"a", "b", "c"})
        self.clock.advance(1)
        placement.unloading_started("a", "y")
        tc.assertEqual(self.hosts_chosen(self.b, "y"), {"b", "c"})
        tc.assertEqual(self.hosts_chosen(self.a, "y"), {"b", "c"})
        self.clock.advance(0.1)
        placement.unloaded("a", "y", "idle")  # the command succeeded
        tc.assertEqual(self.hosts_chosen(self.b, "y"), {"b", "c"})
        self.a.table.record_success("a", _listed(x="unloaded", y="unloaded"))
        status = self.a.table.get("a")
        assert status is not None
        placement.polled("a", status, started=self.clock.seconds() - 0.05)  # began before the command ended
        tc.assertEqual(self.hosts_chosen(self.b, "y"), {"b", "c"})
        placement.polled("a", status, started=self.clock.seconds())
        tc.assertEqual(placement.unloading, {})
        # b's table still says loaded there (its own poll will say otherwise): the mark is over
        tc.assertEqual(self.hosts_chosen(self.b, "y"), {"a", "b", "c"})

    def test_an_unload_ends_for_the_others_when_it_fails_expires_or_is_forgotten(self) -> None:
        tc: Any = self
        placement = self.a.placement
        share = self.b.placement.share
        assert share is not None
        tc.assertFalse(share.unloading("a", "y"))
        placement.unloading_started("a", "y")
        tc.assertTrue(share.unloading("a", "y"))
        tc.assertFalse(share.loading("a", "y") or share.unloading("b", "y") or share.unloading("a", "x"))
        placement.unloading_ended("a", "y")  # the command failed
        tc.assertFalse(share.unloading("a", "y"))
        tc.assertEqual(self.hosts_chosen(self.b, "y"), {"a", "b", "c"})
        placement.unloading_started("a", "y")
        self.clock.advance(59)
        placement.expire(60)
        tc.assertTrue(share.unloading("a", "y"))
        self.clock.advance(1)
        placement.expire(60)  # timeouts.first_byte passed
        tc.assertFalse(share.unloading("a", "y"))
        placement.unloading_started("a", "y")
        placement.forget(["b", "c"])  # a reload removed host a
        tc.assertFalse(share.unloading("a", "y"))

    def test_a_finished_unload_lingers_for_the_others_until_their_polls(self) -> None:
        tc: Any = self
        placement = self.a.placement
        share = self.b.placement.share
        assert share is not None
        placement.unloading_started("a", "y")
        placement.unloaded("a", "y", "idle")
        gone = _listed(x="unloaded", y="unloaded")
        self.a.table.record_success("a", gone)
        placement.polled("a", self.a.table.get("a"), started=self.clock.seconds(), linger=2.0)  # type: ignore[arg-type]
        tc.assertEqual(placement.unloading, {})
        tc.assertTrue(share.unloading("a", "y"))
        self.clock.advance(1)
        placement.expire(300)
        tc.assertTrue(share.unloading("a", "y"))
        placement.republish()  # a reload meanwhile: still shown
        tc.assertTrue(share.unloading("a", "y"))
        self.clock.advance(1)
        placement.expire(300)
        tc.assertFalse(share.unloading("a", "y"))
        placement.unloading_started("a", "y")  # a new unload ends a linger: its own mark stays
        placement.unloading_ended("a", "y", linger=2.0)
        placement.unloading_started("a", "y")
        self.clock.advance(2)
        placement.expire(300)
        tc.assertTrue(share.unloading("a", "y"))

    def test_no_second_unload_of_a_model_another_is_unloading(self) -> None:
        """Rule 4 and 6: each process's Placer finds the model idle after its own poll;
        the first to do so unloads it, the other sends no second command."""
        tc: Any = self
        placers = idle_placers(self.a, self.b, self.clock)
        for placer, _ in placers:
            placer.polled("a", 0.0, True)  # y seen loaded: idle from now
        self.clock.advance(11)
        placers[0][0].polled("a", 0.0, True)
        tc.assertEqual(placers[0][1].sent, [("a", "unload", "y")])
        placers[1][0].polled("a", 0.0, True)
        tc.assertEqual(placers[1][1].sent, [])
        tc.assertFalse(self.a.placement.others_unloading("a", "y"))
        tc.assertTrue(self.b.placement.others_unloading("a", "y"))

    def test_in_flight_and_last_use_are_everyones(self) -> None:
        tc: Any = self
        lease = self.a.inflight.enter("r", "a")
        self.a.inflight.use_model(lease, "y")
        tc.assertEqual(self.b.inflight.host_model("a", "y"), 1)
        lease.release()
        tc.assertEqual(self.b.inflight.host_model("a", "y"), 0)
        tc.assertIsNone(self.b.placement.last_use("a", "y"))
        self.a.placement.used("a", "y")
        tc.assertEqual(self.b.placement.last_use("a", "y"), 1_000_000.0)
        self.clock.advance(5)
        self.b.placement.used("a", "y")
        tc.assertEqual(self.a.placement.last_use("a", "y"), 1_000_005.0)


class WorkerShareTests(_Shared, SynchronousTestCase):
    def runtimes(self) -> tuple[Runtime, Runtime]:
        config = parse_config(CONFIG)
        path = os.path.join(self.mktemp() + "-counts")
        SharedCounts.create(path, 2)
        out = []
        for row in range(2):
            runtime = Runtime(config, self.clock.seconds)
            runtime.attach(WorkerCounts(SharedCounts(path, 2, row), config))
            self.assertIsInstance(runtime.placement.share, WorkerShare)
            out.append(runtime)
        return out[0], out[1]

    def test_two_models_on_one_slot(self) -> None:
        share = self.a.placement.share
        assert isinstance(share, WorkerShare)
        other = self.b.placement.share
        assert isinstance(other, WorkerShare)
        names = [f"m{i}" for i in range(SLOTS + 1)]  # two of them share a slot
        for m in names:
            share.publish_inflight("a", m, 1)
        self.assertTrue(all(other.inflight("a", m) >= 1 for m in names))
        share.publish_loading("a", "m0", True)
        self.assertTrue(other.loading("a", "m0"))
        self.assertEqual([m for m in names[1:] if other.loading("a", m)], [])  # only its own mark
        self.assertEqual([m for m in names if other.unloading("a", m)], [])  # another fact

    def test_two_unloads_on_one_slot(self) -> None:
        """A worker's marks of two models of one slot: the latest shows, and when it
        ends the other's shows again (two unloads of one host: the first one's mark
        lasts until a poll shows it gone)."""
        share = self.a.placement.share
        assert isinstance(share, WorkerShare)
        other = self.b.placement.share
        assert isinstance(other, WorkerShare)
        by_slot: dict[int, list[str]] = {}
        for m in (f"m{i}" for i in range(SLOTS + 1)):
            by_slot.setdefault(fingerprint(m) % SLOTS, []).append(m)
        one, two = next(ms for ms in by_slot.values() if len(ms) > 1)[:2]
        share.publish_unloading("a", one, True)
        share.publish_unloading("a", two, True)
        self.assertEqual((other.unloading("a", one), other.unloading("a", two)), (False, True))
        share.publish_unloading("a", two, False)
        self.assertEqual((other.unloading("a", one), other.unloading("a", two)), (True, False))
        share.publish_unloading("a", one, False)
        self.assertEqual((other.unloading("a", one), other.unloading("a", two)), (False, False))

    def test_a_dead_or_reloaded_worker(self) -> None:
        """A worker's unloading mark goes with it when it dies (the supervisor clears its
        row), and is written again after a reload (which clears the row too)."""
        share = self.b.placement.share
        assert share is not None
        self.a.placement.unloading_started("a", "y")
        self.a.reconfigure(self.a.config)
        self.assertTrue(share.unloading("a", "y"))
        fleet = self.b.fleet
        assert fleet is not None
        fleet.shared.clear_row(0)  # worker 0 died
        self.assertFalse(share.unloading("a", "y"))


class ClusterShareTests(_Shared, SynchronousTestCase):
    def runtimes(self) -> tuple[Runtime, Runtime]:
        config = parse_config(CONFIG)
        store: dict[str, dict[str, int]] = {}
        out = []
        for me in ("one", "two"):
            runtime = Runtime(config, self.clock.seconds)
            runtime.join(_FakeCluster(store, me))  # type: ignore[arg-type]
            self.assertIsInstance(runtime.placement.share, ClusterShare)
            out.append(runtime)
        self.store = store
        return out[0], out[1]

    def test_a_dead_instance(self) -> None:
        """An instance's unloading mark goes with its counts (Redis expires them)."""
        share = self.b.placement.share
        assert share is not None
        self.a.placement.unloading_started("a", "y")
        self.assertTrue(share.unloading("a", "y"))
        del self.store["one"]
        self.assertFalse(share.unloading("a", "y"))


    def test_two_instances_deciding_at_once_send_one_unload(self) -> None:
        """Rule 4 over Redis: both instances find the model idle in the same moment, each
        view still without the other's mark (Redis has not told them yet); the unload is
        claimed in one atomic step of Redis (``take`` with a limit of 1), so one sends it
        (an attack run saw both send it, in 3 of 6 cycles)."""
        placers = idle_placers(self.a, self.b, self.clock)
        for runtime in (self.a, self.b):
            cluster: Any = runtime.cluster
            cluster.others = lambda name: 0  # a view that has not heard of the other's mark
        for placer, _ in placers:
            placer.polled("a", 0.0, True)
        self.clock.advance(11)
        for placer, _ in placers:
            placer.polled("a", 0.0, True)
        self.assertEqual([c.sent for _, c in placers], [[("a", "unload", "y")], []])


    def test_a_claimed_unload_not_sent_is_released(self) -> None:
        """Rule 4: Redis answers the claim late, and meanwhile a reload removed the host:
        nothing is sent, and the claim no longer holds the model away from that host
        for the other instance."""
        placer, commands = idle_placers(self.a, self.b, self.clock)[0]
        cluster: Any = self.a.cluster
        answer: Deferred[bool] = Deferred()
        take = cluster.take
        cluster.take = lambda name, value, limit: (take(name, value, limit), answer)[1]  # written, answered later
        placer.polled("a", 0.0, True)
        self.clock.advance(11)
        placer.polled("a", 0.0, True)
        self.assertTrue(self.b.placement.others_unloading("a", "y"))  # claimed
        self.a.reconfigure(parse_config(CONFIG.replace("hosts: [a, b, c]", "hosts: [b, c]")
                                        .replace('  a: {url: "http://127.0.0.1:9001", models_max: 2}\n', "")))
        answer.callback(True)
        self.assertEqual(commands.sent, [])
        self.assertFalse(self.b.placement.others_unloading("a", "y"))


class CapacityTests(SynchronousTestCase):
    """Every fact of every host of a ``placement`` route has a cell of the workers' shared
    counts, the unloading mark's included, and the supervisor's capacity check counts
    them: 4 facts x :data:`SLOTS` slots per host (docs/design.md §Workers)."""

    @staticmethod
    def config(hosts: int) -> Any:
        names = [f"h{i}" for i in range(hosts)]
        text = "listen: tcp:0\nworkers: 2\nhosts:\n" + "".join(f"  {h}: {{url: 'http://{h}:1', models_max: 2}}\n"
                                                              for h in names)
        return parse_config(text + f"routes:\n  r: {{hosts: [{', '.join(names)}], placement: {{}}}}\n")

    def test_every_fact_has_a_cell(self) -> None:
        config = self.config(3)
        path = self.mktemp()
        SharedCounts.create(path, 2)
        fleet = WorkerCounts(SharedCounts(path, 2, 0), config)
        names = share_names(list(config.hosts))
        self.assertEqual(len(names), 3 * 4 * SLOTS)
        self.assertEqual([n for n in names if fleet.cell(n) is None], [])
        self.assertEqual(sum(n.startswith("pd\0") for n in names), 3 * SLOTS)

    def test_the_capacity_check_counts_them(self) -> None:
        check_capacity(self.config(59))  # 4,081 cells of 4,096
        with self.assertRaises(ConfigError) as caught:
            check_capacity(self.config(60))
        self.assertIn("needs 4150 shared counters", str(caught.exception))
