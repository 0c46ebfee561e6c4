"""Placement shared across workers and instances (docs/design.md §Where models live, rule 7;
§Workers; §Several crossbars): one process's load counts as loading for another's
choice at once, a model in flight through one is in use for the other, the last use is
the latest of all; through the workers' shared counts and through a cluster view."""

from __future__ import annotations

import os
from typing import Any

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import parse_config
from crossbar.hosts.balance import Chosen, Fit
from crossbar.state.placement_share import SLOTS, ClusterShare, WorkerShare
from crossbar.state.runtime import Runtime
from crossbar.state.shared import SharedCounts
from crossbar.state.worker_counts import WorkerCounts
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
        raise NotImplementedError


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
        return out[0], out[1]
