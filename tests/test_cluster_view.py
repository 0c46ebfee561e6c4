"""The rules the runtime applies to a cluster's view (docs/design.md §Several crossbars),
over a fake :class:`~crossbar.state.cluster.ClusterView` (the real one, over Redis, is
tested in tests/test_cluster.py)."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import SynchronousTestCase

from crossbar.config import parse_config
from crossbar.state.cluster import ClusterView
from crossbar.state.inflight import Inflight
from crossbar.state.runtime import Runtime


class FakeCluster:
    """A :class:`ClusterView` whose other instances' counts a test sets."""

    def __init__(self, instances: int = 2) -> None:
        self.joined = True
        self.settled = True
        self.totals: dict[str, int] = {}
        self.mine: dict[str, int] = {}
        self.taken: list[tuple[str, int, int]] = []
        self.n = instances
        self.drains: list[tuple[str, bool]] = []
        self.on_drains: Any = None

    def drain(self, host: str, draining: bool) -> None:
        self.drains.append((host, draining))

    def others(self, name: str) -> int:
        return self.totals.get(name, 0) if self.joined else 0

    def set(self, name: str, value: int) -> None:
        self.mine[name] = value

    def take(self, name: str, value: int, limit: int) -> Deferred[bool]:
        self.taken.append((name, value, limit))
        ok = self.totals.get(name, 0) + value <= limit
        if ok:
            self.mine[name] = value
        return succeed(ok)

    def instances(self) -> int:
        return self.n if self.joined else 1


class InflightOverCluster(SynchronousTestCase):
    def test_counts(self) -> None:
        cluster = FakeCluster(instances=3)
        view: ClusterView = cluster
        inflight = Inflight()
        inflight.counts.cluster = view
        cluster.totals["h\0a"] = 4
        self.assertEqual(inflight.host("a"), 4)
        lease = inflight.enter("r", "a")
        self.assertEqual(cluster.mine, {"h\0a": 1})
        self.assertIsNone(lease.taken)  # no max_inflight: nothing to take
        # The count, not a guess: what status shows (issue 29: no room padding here).
        self.assertEqual(inflight.host("a"), 1 + 4)
        lease.release()
        self.assertEqual(cluster.mine, {"h\0a": 0})
        self.assertEqual(inflight.host("a"), 4)
        cluster.joined = False  # Redis away: this instance's own counts only
        self.assertEqual(inflight.host("a"), 0)

    def test_key_max_inflight(self) -> None:
        config = parse_config(
            "listen: tcp:0\nhosts:\n  h: http://h:1\nroutes:\n  r:\n    hosts: [h]\n"
            "    keys:\n      ci: {secret: s-1, max_inflight: 2}\n", "c.yaml", {})
        runtime = Runtime(config, lambda: 0.0)
        cluster = FakeCluster()
        runtime.join(cluster)
        route = config.routes["r"]
        self.assertTrue(runtime.key_admits(route, "ci"))
        cluster.totals["k\0r\0ci"] = 2
        self.assertFalse(runtime.key_admits(route, "ci"))
        cluster.joined = False
        self.assertTrue(runtime.key_admits(route, "ci"))


class ReadyOnceSettled(SynchronousTestCase):
    """docs/design.md §Several crossbars: with ``cluster.redis`` an instance is not
    ready until its first connection to Redis has succeeded or failed."""

    def test_not_ready_before_redis_answered(self) -> None:
        config = parse_config("listen: tcp:0\nhosts:\n  h: http://h:1\nroutes:\n  r:\n    hosts: [h]\n", "c.yaml", {})
        runtime = Runtime(config, lambda: 0.0)
        runtime.table.record_success("h", ["m"])
        self.assertTrue(runtime.ready)
        cluster = FakeCluster()
        cluster.joined = cluster.settled = False
        runtime.join(cluster)
        self.assertFalse(runtime.ready)
        cluster.settled = True  # Redis refused or did not answer: ready, counting alone
        self.assertTrue(runtime.ready)

    def test_room_is_taken_in_redis(self) -> None:
        """With a ``max_inflight`` the place is taken through the cluster (one script
        call), with this instance's new count and the limit; refused when full."""
        cluster = FakeCluster()
        inflight = Inflight()
        inflight.counts.cluster = cluster
        cluster.totals["h\0a"] = 1
        lease = inflight.enter("r", "a", limit=2)
        self.assertEqual(cluster.taken, [("h\0a", 1, 2)])
        assert lease.taken is not None
        self.assertEqual(self.successResultOf(lease.taken), True)
        refused = inflight.enter("r", "a", limit=2)
        assert refused.taken is not None
        self.assertEqual(self.successResultOf(refused.taken), False)
        refused.release()
        self.assertEqual(cluster.mine, {"h\0a": 1})
        cluster.joined = False  # alone: nothing to take, counted here
        alone = inflight.enter("r", "a", limit=2)
        self.assertIsNone(alone.taken)
